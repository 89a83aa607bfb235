"""Tiny random embedding checkpoints in the sentence-transformers layout, built locally: a Qwen3
laid out as Qwen3-Embedding ships (the base model's weights, last-token pooling, Normalize, an EOS
appended by the tokenizer's post-processor, a "query" prompt), and Llama ones pooled by mean or CLS."""
import json
import os

QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
MAX_SEQ_LENGTH = 200
_MODULES = {"Transformer": ("", "Transformer"), "Pooling": ("1_Pooling", "Pooling"),
            "Normalize": ("2_Normalize", "Normalize")}


def build_embedding_checkpoint(path: str, arch: str = "qwen3", pooling: str = "lasttoken", normalize: bool = True,
                               eos: bool = True, tied: bool = True, seed: int = 0) -> str:
    """A checkpoint directory SentenceTransformer(path) and pagoda both load. eos: the tokenizer appends
    <|eos|> to every text (TemplateProcessing, as Qwen3-Embedding's appends <|endoftext|>). tied: the
    head shares the embeddings; untied, no head is saved at all (Qwen3-Embedding-4B's and 8B's files)."""
    import torch
    import transformers as tf
    from pagoda.engine.demo import build_byte_tokenizer
    from tokenizers.processors import TemplateProcessing

    tokenizer = build_byte_tokenizer(unk_token="<|endoftext|>" if arch == "qwen3" else None)
    if eos:
        eos_id = tokenizer.eos_token_id
        tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
            single="$A <|eos|>", pair="$A <|eos|> $B <|eos|>", special_tokens=[("<|eos|>", eos_id)])
    config_cls, model_cls = {"qwen3": (tf.Qwen3Config, tf.Qwen3Model), "llama": (tf.LlamaConfig, tf.LlamaModel)}[arch]
    config = config_cls(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        initializer_range=0.3, tie_word_embeddings=tied, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)  # the base model: its tensors have no "model." prefix
    model.save_pretrained(path, safe_serialization=True)
    config.architectures = [f"{'Qwen3' if arch == 'qwen3' else 'Llama'}ForCausalLM"]  # as the shipped config.json
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    _write_sentence_transformers(path, pooling, normalize)
    return path


def _write_sentence_transformers(path: str, pooling: str, normalize: bool) -> None:
    kinds = ["Transformer", "Pooling"] + (["Normalize"] if normalize else [])
    modules = [{"idx": i, "name": str(i), "path": _MODULES[k][0], "type": f"sentence_transformers.models.{k}"}
               for i, k in enumerate(kinds)]
    _dump(path, "modules.json", modules)
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
    _dump(path, "1_Pooling/config.json", {"word_embedding_dimension": 64, "include_prompt": True,
                                          **{f"pooling_mode_{m}": m == pooling for m in modes}})
    if normalize:
        os.makedirs(os.path.join(path, "2_Normalize"), exist_ok=True)
    _dump(path, "sentence_bert_config.json", {"max_seq_length": MAX_SEQ_LENGTH, "do_lower_case": False})
    _dump(path, "config_sentence_transformers.json", {"prompts": {"query": QUERY_PROMPT, "document": ""},
                                                      "default_prompt_name": None, "similarity_fn_name": "cosine"})


def _dump(path: str, name: str, value) -> None:
    file = os.path.join(path, name)
    os.makedirs(os.path.dirname(file), exist_ok=True)
    with open(file, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)

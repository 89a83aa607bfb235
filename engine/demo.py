"""The built-in demo model and tiny test checkpoints, made locally with no network.

Weights are random: the demo shows the machinery, not a language model. Point `model` at a
real checkpoint (a directory or a hub id) for real text.
"""
import contextlib
import logging
import os
import tempfile

log = logging.getLogger("pagoda.engine")

_SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
DEMO_CONFIG = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=4, max_position_embeddings=2048)
_DEMO_VERSION = "3"
DEMO_MODEL_NAME = "pagoda-demo"  # what the server calls the demo model (its files live in a cache path)


def build_byte_tokenizer(vocab_size: int | None = None, unk_token: str | None = None):
    """A byte-level tokenizer: ids 0..255 are bytes, then special tokens, then (to fill a
    larger vocabulary) plain tokens <|extra_N|>. unk_token: one more special token, for tokenizer
    classes that add a default one on loading (Qwen2's adds <|endoftext|> past the vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from pagoda.engine.detokenizer import byte_level_alphabet

    vocab = {char: byte for byte, char in enumerate(byte_level_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = _SPECIALS + ([unk_token] if unk_token else [])
    tok.add_special_tokens(specials)
    n = len(vocab) + len(specials)
    if vocab_size is not None and vocab_size > n:
        tok.add_tokens([f"<|extra_{i}|>" for i in range(vocab_size - n)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>", unk_token=unk_token, chat_template=CHAT_TEMPLATE)


def build_tiny_checkpoint(path: str, arch: str = "llama", seed: int = 0, printable_output: bool = False,
                          tokenizer=None, **overrides) -> str:
    """Write a small random checkpoint with transformers' own model class, in safetensors.
    printable_output zeroes the output rows of every token but printable ASCII bytes and scales
    those up, so the random model babbles in readable characters (needs untied embeddings)."""
    import torch
    import transformers as tf

    if tokenizer is None:
        unk = "<|endoftext|>" if arch in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") else None
        tokenizer = build_byte_tokenizer(overrides.pop("vocab_size", None), unk_token=unk)
    vocab = len(tokenizer)
    common = dict(vocab_size=vocab, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512)
    if arch == "gpt2":
        config = tf.GPT2Config(**{**common, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512, **overrides})
        model_cls = tf.GPT2LMHeadModel
    else:
        config_cls, model_cls = {
            "llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
            "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM), "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
            "granite": (tf.GraniteConfig, tf.GraniteForCausalLM), "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM),
            "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM), "smollm3": (tf.SmolLM3Config, tf.SmolLM3ForCausalLM),
            "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM), "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
            "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM), "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM),
            "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM), "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM),
            "qwen3_5": (tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM),
            "qwen3_5_moe": (tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM),
            "qwen3_next": (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM),
        }[arch]
        config = config_cls(**{**common, **small, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    if printable_output:
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[[tokenizer.convert_tokens_to_ids(c) for c in map(chr, range(33, 127))]] = True
        keep[tokenizer.convert_tokens_to_ids("\u0120")] = True  # the byte-level space
        with torch.no_grad():
            head = model.get_output_embeddings().weight
            head[~keep] = 0
            head[keep] *= 6
    with _no_progress_bars():  # a bar for one small shard says nothing
        model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@contextlib.contextmanager
def _no_progress_bars():
    """transformers' progress bars off for a while (its switch is process-wide), then as they were."""
    from transformers.utils import logging as tf_logging

    was_on = tf_logging.is_progress_bar_enabled()
    tf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            tf_logging.enable_progress_bar()


def demo_model_path() -> str:
    """The demo checkpoint, created on first use under the user's cache directory."""
    root = os.environ.get("PAGODA_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagoda")
    path = os.path.join(root, f"demo-llama-v{_DEMO_VERSION}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    log.info("building the demo model (random weights) in %s: on first start only, a few seconds", path)
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=root, prefix=".demo-")
    build_tiny_checkpoint(tmp, "llama", seed=0, initializer_range=0.05, printable_output=True,
                          tie_word_embeddings=False, **DEMO_CONFIG)
    try:
        os.rename(tmp, path)  # atomic: a concurrent builder's copy wins, ours is dropped
    except OSError:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return path

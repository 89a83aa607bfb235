"""Tiny GGUF files written here from tiny transformers checkpoints (engine/demo.py build_tiny_checkpoint), as
llama.cpp's convert script lays them out (its tensor names, a llama's Q/K rows permuted for its RoPE, the
tokenizer as tokenizer.ggml.* metadata), with the `gguf` package's GGUFWriter. Linear weights in a chosen
block type: quantized by gguf.quants where it can (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), else random valid blocks
(the K-quants), so that the file's weights are whatever gguf.quants.dequantize reads from it."""
import os

import gguf
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize
from safetensors.torch import load_file

LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "output")
_HF_TO_GGUF = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
# (offset of each f16 scale in a block, its value): random bytes elsewhere are valid quants and sub-scales
_SCALES = {Q.Q4_K: ((0, 0.002), (2, 0.015)), Q.Q5_K: ((0, 0.001), (2, 0.015)), Q.Q6_K: ((208, 1e-4),),
           Q.Q2_K: ((80, 0.01), (82, 0.01)), Q.Q3_K: ((108, 0.002),), Q.IQ4_NL: ((0, 0.004),)}


_GPT2 = {"transformer.wte": "token_embd", "transformer.wpe": "position_embd", "transformer.ln_f": "output_norm",
         "lm_head": "output"}
_GPT2_LAYER = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
               "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
CONV1D = ("c_attn.weight", "c_proj.weight", "c_fc.weight")  # GPT-2's Conv1D weights: [in, out] in its checkpoints


def gguf_name(hf: str) -> str | None:
    base, _, kind = hf.rpartition(".")
    if base in _HF_TO_GGUF or base in _GPT2:
        return f"{_HF_TO_GGUF.get(base) or _GPT2[base]}.{kind}"
    parts = base.split(".", 3)  # model, layers, N, rest (GPT-2: transformer, h, N, rest)
    table = _GPT2_LAYER if parts[0] == "transformer" else _LAYER
    if len(parts) == 4 and parts[3] in table:
        return f"blk.{parts[2]}.{table[parts[3]]}.{kind}"
    return None


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def blocks(w: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """w [rows, in] float32 in `qtype`'s blocks: [rows, in / block * block_bytes] uint8."""
    if qtype in _SCALES:
        n, size = GGML_QUANT_SIZES[qtype]
        b = rng.integers(0, 256, (w.shape[0], w.shape[1] // n, size), dtype=np.uint8)
        for at, value in _SCALES[qtype]:
            scale = (value * rng.uniform(0.5, 1.5, b.shape[:2])).astype(np.float16)
            b[..., at:at + 2] = scale.view(np.uint8).reshape(*b.shape[:2], 2)
        return b.reshape(w.shape[0], -1)
    return quantize(w, qtype)


def write_gguf(ckpt: str, path: str, types: dict | None = None, float_type: Q = Q.F32, split: int = 0,
               seed: int = 0, file_type: int | None = 1) -> str:
    """The checkpoint at `ckpt` as a GGUF at `path` (split: at most this many tensors a file, named
    -0000i-of-0000n.gguf). types: llama.cpp tensor kind (attn_q, ffn_down, output, token_embd, ...) -> block
    type; every other tensor in float_type (norms in F32, as llama.cpp keeps them). file_type: general.file_type
    (gguf.LlamaFileType; None: not written)."""
    from transformers import AutoConfig, AutoTokenizer

    cfg, tok = AutoConfig.from_pretrained(ckpt), AutoTokenizer.from_pretrained(ckpt)
    arch = {"mistral": "llama"}.get(cfg.model_type, cfg.model_type)  # llama.cpp writes Mistral as llama
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch, split_max_tensors=split)
    w.add_name(f"tiny-{cfg.model_type}")  # transformers tells Mistral from Llama by "mistral" in the name
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    if arch == "gpt2":
        w.add_feed_forward_length(cfg.n_inner or 4 * cfg.n_embd)
        w.add_layer_norm_eps(cfg.layer_norm_epsilon)
    else:
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count_kv(cfg.num_key_value_heads)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_dimension_count(head_dim)
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None)
                             else cfg.rope_theta)
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if file_type is not None:
        w.add_file_type(file_type)
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    specials = set(tok.all_special_tokens)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])
    w.add_token_merges([])
    w.add_token_scores([0.0] * len(tokens))  # no merges (a byte vocabulary): transformers then reads scores
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(tok.chat_template)
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type") == "llama3":  # convert_hf_to_gguf.py LlamaModel.generate_extra_tensors
        dim = head_dim
        wavelen = 2 * np.pi * rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        low, high, orig = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
        factors = [1.0 if w < orig / high else rope["factor"] if w > orig / low else
                   1 / ((1 - (orig / w - low) / (high - low)) / rope["factor"] + (orig / w - low) / (high - low))
                   for w in wavelen]
        w.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    state = load_file(os.path.join(ckpt, "model.safetensors"))
    for name, t in state.items():
        gname = gguf_name(name)
        if gname is None:
            continue
        a = t.float().numpy()
        if name.endswith(CONV1D):  # llama.cpp stores them [out, in]
            a = np.ascontiguousarray(a.T)
        kind = gname.split(".")[-2]
        if arch == "llama" and kind in ("attn_q", "attn_k"):
            a = permute(a, cfg.num_attention_heads if kind == "attn_q" else cfg.num_key_value_heads)
        qtype = (types or {}).get(kind)
        if qtype is not None and a.ndim == 2:
            b = blocks(a, qtype, rng)
            w.add_tensor(gname, b, raw_shape=b.shape, raw_dtype=qtype)
        elif a.ndim == 1 or float_type == Q.F32:
            w.add_tensor(gname, a)
        elif float_type == Q.F16:
            w.add_tensor(gname, a.astype(np.float16))
        else:  # BF16: the bits, as llama.cpp writes them
            bits = torch.from_numpy(a).bfloat16().view(torch.int16).numpy().view(np.uint8)
            w.add_tensor(gname, bits, raw_shape=bits.shape, raw_dtype=Q.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def dequantized_state(path: str, cfg) -> dict[str, torch.Tensor]:
    """The file's tensors as a transformers checkpoint's state dict, dequantized by gguf.quants (the oracle),
    a llama's Q/K rows put back in Hugging Face's order."""
    from gguf.quants import dequantize
    from pagoda.engine.gguf import hf_name, split_files

    state = {}
    arch = gguf.GGUFReader(path).fields["general.architecture"].contents()
    for file in split_files(path):
        for t in gguf.GGUFReader(file).tensors:
            a = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(list(reversed([int(n) for n in t.shape])))
            kind = t.name.split(".")[-2]
            if arch == "llama" and kind in ("attn_q", "attn_k"):
                heads = cfg.num_attention_heads if kind == "attn_q" else cfg.num_key_value_heads
                a = a.reshape(heads, a.shape[0] // heads // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
            name = hf_name(t.name, arch)
            if name is None:  # rope_freqs.weight: config, not a parameter
                continue
            state[name] = torch.from_numpy(np.ascontiguousarray(a.T if name.endswith(CONV1D) else a))
    return state

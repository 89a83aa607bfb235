"""Tiny GGUF files written here from tiny transformers checkpoints (engine/demo.py build_tiny_checkpoint), as
llama.cpp's convert script lays them out (its tensor names, a llama's Q/K rows permuted for its RoPE, Gemma's
norms as 1 + w, each family's metadata, the tokenizer as tokenizer.ggml.* metadata), with the `gguf` package's
GGUFWriter. Linear weights in a chosen block type: quantized by gguf.quants where it can (Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1), else random valid blocks (the K-quants, IQ4_NL, IQ4_XS, IQ2_XXS), so that the file's weights are
whatever gguf.quants.dequantize reads from it."""
import math
import os
import re

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
           Q.Q2_K: ((80, 0.01), (82, 0.01)), Q.Q3_K: ((108, 0.002),), Q.IQ4_NL: ((0, 0.004),),
           Q.IQ4_XS: ((0, 2e-4),), Q.IQ2_XXS: ((0, 0.003),)}


_GPT2 = {"transformer.wte": "token_embd", "transformer.wpe": "position_embd", "transformer.ln_f": "output_norm",
         "lm_head": "output"}
_GPT2_LAYER = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
               "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
CONV1D = ("c_attn.weight", "c_proj.weight", "c_fc.weight")  # GPT-2's Conv1D weights: [in, out] in its checkpoints
# llama.cpp's names where a family's differ from Llama's: Gemma's and OLMo 2's norms after attention and the MLP,
# Phi-3's fused q|k|v and gate|up
_POST_NORMS = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}
# hybrid linear attention: transformers' model_type -> llama.cpp's architecture, and its layers' names
HYBRID_ARCH = {"qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe", "qwen3_next": "qwen3next"}
_HYBRID_LAYER = {"post_attention_layernorm": "post_attention_norm", "linear_attn.in_proj_qkv": "attn_qkv",
                 "linear_attn.in_proj_z": "attn_gate", "linear_attn.in_proj_b": "ssm_beta",
                 "linear_attn.in_proj_a": "ssm_alpha", "linear_attn.in_proj_ba": "ssm_ba",
                 "linear_attn.conv1d": "ssm_conv1d", "linear_attn.dt_proj": "ssm_dt", "linear_attn.norm": "ssm_norm",
                 "linear_attn.out_proj": "ssm_out"}
_FAMILY_LAYER = {"gemma2": _POST_NORMS, "gemma3": _POST_NORMS, "olmo2": _POST_NORMS,
                 "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
                 **dict.fromkeys(HYBRID_ARCH.values(), _HYBRID_LAYER)}
PERMUTED = ("llama", "granite", "smollm3")  # convert_hf_to_gguf.py's LlamaModel and its subclasses permute Q/K
GEMMA = ("gemma2", "gemma3")  # the converter stores each RMSNorm weight as 1 + w (Gemma's norms scale by it)


def gguf_name(hf: str, arch: str = "llama") -> str | None:
    base, _, kind = hf.rpartition(".")
    parts = base.split(".", 3)
    if len(parts) == 4 and parts[0] == "model" and parts[3] in _FAMILY_LAYER.get(arch, {}):
        return f"blk.{parts[2]}.{_FAMILY_LAYER[arch][parts[3]]}.{kind}"
    if arch == "gemma2" and base == "lm_head":  # the converter drops it: Gemma 2 ties it to the embedding
        return None
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


def _gemma2(w, cfg, head_dim):  # convert_hf_to_gguf.py Gemma2Model: no RoPE base (llama.cpp's default 10000)
    w.add_key_length(head_dim), w.add_value_length(head_dim), w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_sliding_window(cfg.sliding_window)


def _gemma3(w, cfg, head_dim):  # Gemma3Model: the full layers' RoPE (the sliding ones' is llama.cpp's constant)
    full = cfg.rope_parameters["full_attention"]
    w.add_key_length(head_dim), w.add_value_length(head_dim), w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(full["rope_theta"])
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    if cfg.final_logit_softcapping:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if "sliding_attention" in cfg.layer_types:
        w.add_sliding_window(cfg.sliding_window)


def _phi3(w, cfg, head_dim):  # Phi3MiniModel: the rotated dimensions, the window (0: none); no head_dim
    rope = cfg.rope_parameters
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
    w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // cfg.num_attention_heads)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(cfg.sliding_window or 0)
    if rope.get("long_factor"):
        scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(cfg.original_max_position_embeddings)))
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))


def _llama_like(w, cfg, head_dim):  # TextModel (OLMo 2), LlamaModel (SmolLM3), GraniteModel: its multipliers
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if cfg.model_type != "olmo2":
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    if cfg.model_type == "granite":
        w.add_attention_scale(cfg.attention_multiplier), w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier), w.add_logit_scale(cfg.logits_scaling)


def _hybrid(w, cfg, head_dim):  # TextModel, then Qwen3NextModel's linear-attention sizes and partial RoPE
    rope = cfg.rope_parameters
    w.add_key_length(head_dim), w.add_value_length(head_dim)
    if "mrope_section" in rope:
        w.add_rope_dimension_sections((list(rope["mrope_section"]) + [0] * 4)[:4])
    w.add_rope_freq_base(rope["rope_theta"]), w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim), w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads), w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    w.add_full_attention_interval(getattr(cfg, "full_attention_interval", 4))
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25)))


# the metadata convert_hf_to_gguf.py writes for these families (beside the sizes every file has)
FAMILY_METADATA = {"gemma2": _gemma2, "gemma3": _gemma3, "phi3": _phi3, "olmo2": _llama_like,
                   "granite": _llama_like, "smollm3": _llama_like, **dict.fromkeys(HYBRID_ARCH.values(), _hybrid)}


def reorder_v_heads(t: torch.Tensor, dim: int, nk: int, r: int, size: int) -> torch.Tensor:
    """convert_hf_to_gguf.py _LinearAttentionVReorderBase._reorder_v_heads: value heads grouped by key head
    ([nk, r] heads of `size`) to tiled ([r, nk]); with nk and r swapped, back."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], nk, r, size, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).contiguous().reshape(shape)


def _hybrid_state(state: dict, cfg, arch: str) -> dict:
    """Qwen3.5's / Qwen3-Next's linear-attention tensors as llama.cpp's converter writes them (the rest as they
    are): Qwen3.5's value heads tiled (_LinearAttentionVReorderBase), then Qwen3NextModel.modify_tensors: A as
    -exp(A_log) (blk.N.ssm_a), dt_bias as ssm_dt.bias, the conv1d squeezed, every RMSNorm but the gated one as
    1 + w, Qwen3-Next's q|k|v|z grouped per key head split into q|k|v (each over all heads) and z."""
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, nv // nk
    out = {}
    for name, t in state.items():
        if name.startswith("mtp."):
            continue
        if arch != "qwen3next" and nk != nv and "linear_attn." in name:
            if ".in_proj_qkv." in name or ".conv1d." in name:
                t = t.squeeze() if ".conv1d." in name else t
                t = torch.cat([t[:2 * nk * dk], reorder_v_heads(t[2 * nk * dk:], 0, nk, r, dv)])
            elif ".in_proj_z." in name:
                t = reorder_v_heads(t, 0, nk, r, dv)
            elif ".in_proj_b." in name or ".in_proj_a." in name or name.endswith((".A_log", ".dt_bias")):
                t = reorder_v_heads(t, 0, nk, r, 1)
            elif ".out_proj." in name:
                t = reorder_v_heads(t, 1, nk, r, dv)
        n = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith(".A_log"):
            out[f"blk.{n}.ssm_a"] = -torch.exp(t)
            continue
        if name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif "conv1d" in name:
            t = t.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        if "in_proj_qkvz.weight" in name:
            q, k, v, z = t.view(nk, -1, t.shape[-1]).split([dk, dk, r * dv, r * dv], dim=1)
            out[f"blk.{n}.attn_qkv.weight"] = torch.cat([p.reshape(-1, t.shape[-1]) for p in (q, k, v)])
            out[f"blk.{n}.attn_gate.weight"] = z.reshape(-1, t.shape[-1])
        else:
            out[name] = t
    return out


# mixtures of experts: transformers' model_type -> llama.cpp's architecture (Mixtral: llama with experts)
MOE_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss"}
_MOE_NAMES = {"gate": "ffn_gate_inp", "router": "ffn_gate_inp", "shared_expert.gate_proj": "ffn_gate_shexp",
              "shared_expert.up_proj": "ffn_up_shexp", "shared_expert.down_proj": "ffn_down_shexp",
              "shared_expert_gate": "ffn_gate_inp_shexp"}
_EXPERT = re.compile(r"^experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_PIECE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def _moe_metadata(w, cfg, arch: str) -> None:
    """What convert_hf_to_gguf.py writes of a mixture of experts (gpt-oss: its window, YaRN and SwiGLU clamp)."""
    w.add_expert_count(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch != "llama":
        w.add_expert_feed_forward_length(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch == "qwen3moe":
        w.add_expert_weights_norm(bool(cfg.norm_topk_prob))
    if arch == "gpt-oss":
        rope = cfg.rope_parameters
        w.add_sliding_window(cfg.sliding_window)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_float32(f"{arch}.swiglu_clamp_exp", cfg.swiglu_limit)  # llama.cpp reads one value for every layer


def _moe_state(state: dict, cfg) -> dict:
    """A mixture of experts' tensors as llama.cpp's converter writes them (its names, the rest left as they are):
    each projection's experts in one 3-d tensor [E, out, in] (gpt-oss's gate | up de-interleaved), the router,
    Qwen2-MoE's shared expert (its gate [hidden]), gpt-oss's sinks and post-attention norm."""
    out, experts = {}, {}  # experts: (layer, piece) -> {expert: [out, in]}
    gpt_oss = cfg.model_type == "gpt_oss"
    for name, t in state.items():
        m = re.match(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(.*)\.(weight|bias)$", name) or \
            re.match(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(experts\.\w+)()$", name)
        n = None if m is None else m[1]
        if m is not None and _EXPERT.match(f"{m[2]}.{m[3]}"):
            e, piece = _EXPERT.match(f"{m[2]}.{m[3]}").groups()
            experts.setdefault((n, _PIECE[piece]), {})[int(e)] = t
        elif gpt_oss and m is not None and m[2].startswith("experts."):  # [E, H, 2I] gate | up interleaved, ...
            kind = "bias" if m[2].endswith("_bias") else "weight"
            t = t if kind == "bias" else t.transpose(1, 2)  # [E, out, in]
            if "gate_up" in m[2]:
                out[f"blk.{n}.ffn_gate_exps.{kind}"], out[f"blk.{n}.ffn_up_exps.{kind}"] = t[:, 0::2], t[:, 1::2]
            else:
                out[f"blk.{n}.ffn_down_exps.{kind}"] = t
        elif m is not None and m[2] in ("experts.gate_up_proj", "experts.down_proj"):  # fused: [E, 2I, H], [E, H, I]
            if m[2] == "experts.down_proj":
                out[f"blk.{n}.ffn_down_exps.weight"] = t
            else:
                out[f"blk.{n}.ffn_gate_exps.weight"], out[f"blk.{n}.ffn_up_exps.weight"] = t.chunk(2, dim=1)
        elif m is not None and m[2] in _MOE_NAMES:
            out[f"blk.{n}.{_MOE_NAMES[m[2]]}.{m[3]}"] = t.reshape(-1) if m[2] == "shared_expert_gate" else t
        elif gpt_oss and name.endswith("self_attn.sinks"):
            out[f"blk.{name.split('.')[2]}.attn_sinks.weight"] = t
        elif gpt_oss and name.endswith("post_attention_layernorm.weight"):
            out[f"blk.{name.split('.')[2]}.post_attention_norm.weight"] = t
        else:
            out[name] = t
    for (n, piece), ts in experts.items():
        out[f"blk.{n}.ffn_{piece}_exps.weight"] = torch.stack([ts[e] for e in range(len(ts))])
    return out


def write_gguf(ckpt: str, path: str, types: dict | None = None, float_type: Q = Q.F32, split: int = 0,
               seed: int = 0, file_type: int | None = 1) -> str:
    """The checkpoint at `ckpt` as a GGUF at `path` (split: at most this many tensors a file, named
    -0000i-of-0000n.gguf). types: llama.cpp tensor kind (attn_q, ffn_down, output, token_embd, ...) -> block
    type; every other tensor in float_type (norms in F32, as llama.cpp keeps them). file_type: general.file_type
    (gguf.LlamaFileType; None: not written)."""
    from transformers import AutoConfig, AutoTokenizer

    cfg, tok = AutoConfig.from_pretrained(ckpt), AutoTokenizer.from_pretrained(ckpt)
    # llama.cpp writes Mistral as llama, and Gemma 3's text model as gemma3
    arch = {"mistral": "llama", "gemma3_text": "gemma3", **MOE_ARCH, **HYBRID_ARCH}.get(cfg.model_type,
                                                                                     cfg.model_type)
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
        if getattr(cfg, "intermediate_size", None) is not None:  # Qwen3.5-MoE has none
            w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count_kv(cfg.num_key_value_heads)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if cfg.model_type in MOE_ARCH or getattr(cfg, "num_experts", 0):
        _moe_metadata(w, cfg, arch)
    if arch in FAMILY_METADATA:
        FAMILY_METADATA[arch](w, cfg, head_dim)
    elif arch != "gpt2":
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
    if cfg.model_type in MOE_ARCH or getattr(cfg, "num_experts", 0):
        state = _moe_state(state, cfg)
    if arch in HYBRID_ARCH.values():
        state = _hybrid_state(state, cfg, arch)
    for name, t in state.items():
        gname = name if name.startswith("blk.") else gguf_name(name, arch)
        if gname is None:
            continue
        a = t.float().numpy()
        if name.endswith(CONV1D):  # llama.cpp stores them [out, in]
            a = np.ascontiguousarray(a.T)
        kind = gname.split(".")[-2]
        if arch in PERMUTED and kind in ("attn_q", "attn_k"):
            a = permute(a, cfg.num_attention_heads if kind == "attn_q" else cfg.num_key_value_heads)
        if arch in GEMMA and name.endswith("norm.weight"):
            a = a + 1
        qtype = (types or {}).get(kind)
        if qtype is not None and a.ndim >= 2:  # experts [E, out, in]: their rows' blocks
            b = blocks(a.reshape(-1, a.shape[-1]), qtype, rng).reshape(*a.shape[:-1], -1)
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


def assert_config_matches(ckpt: str, path: str, keys: list[str]):
    """The config pagoda builds from a GGUF file's metadata against the source checkpoint's: model type,
    architectures, and each of `keys` the checkpoint sets. Returns (checkpoint's, file's)."""
    import pytest
    from pagoda.engine.gguf import load_config
    from transformers import AutoConfig

    want, got = AutoConfig.from_pretrained(ckpt), load_config(path)
    assert got.model_type == want.model_type and got.architectures == want.architectures
    for k in keys:  # None in the checkpoint: a size it leaves implied (Mixtral's head_dim)
        if getattr(want, k, None) is not None:
            assert getattr(got, k, None) == pytest.approx(getattr(want, k)), k
    return want, got


def engine_greedy(model: str, prompt: list[int], n: int, **options) -> tuple[list[int], torch.nn.Module]:
    """(pagoda's greedy tokens after `prompt`, the engine's model) for a GGUF file (or hub name of one)."""
    from grpc_fixtures import engine_config
    from pagoda.engine import LLM, SamplingParams

    llm = LLM(**vars(engine_config(model, num_kv_blocks=32, max_num_batched_tokens=128, **options)))
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
        return list(out.outputs[0].token_ids), llm.engine.model
    finally:
        llm.engine.close()


def transformers_greedy(ckpt: str, prompt: list[int], n: int, state: dict | None = None) -> list[int]:
    """transformers' float32 greedy tokens after `prompt`, over `state` (a file's dequantized weights) if given."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    if state is not None:
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = model.config.tie_word_embeddings
        assert not unexpected and not [m for m in missing if "rotary" not in m and not (tied and "lm_head" in m)], \
            (missing, unexpected)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def dequantized_state(path: str, cfg) -> dict[str, torch.Tensor]:
    """The file's tensors as a transformers checkpoint's state dict, dequantized by gguf.quants (the oracle),
    a llama's (Granite's, SmolLM3's) Q/K rows put back in Hugging Face's order, Gemma's norms less the 1."""
    from gguf.quants import dequantize
    from pagoda.engine.gguf import hf_name, split_files

    state, experts = {}, {}
    arch = gguf.GGUFReader(path).fields["general.architecture"].contents()
    hybrid = arch in HYBRID_ARCH.values()
    for file in split_files(path):
        for t in gguf.GGUFReader(file).tensors:
            a = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(list(reversed([int(n) for n in t.shape])))
            kind = t.name.split(".")[-2]
            if arch in PERMUTED and kind in ("attn_q", "attn_k"):
                heads = cfg.num_attention_heads if kind == "attn_q" else cfg.num_key_value_heads
                a = a.reshape(heads, a.shape[0] // heads // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
            if arch in GEMMA and t.name.endswith("norm.weight"):
                a = a - 1
            if re.match(r"^blk\.\d+\.ffn_(gate|up|down)_exps\.", t.name):
                experts[t.name] = torch.from_numpy(a.copy())
                continue
            name = hf_name(t.name, arch)
            if name is None:  # rope_freqs.weight, rope_factors_*: config, not parameters
                continue
            if name.endswith("shared_expert_gate.weight"):  # [hidden] in the file
                a = a.reshape(1, -1)
            state[name] = torch.from_numpy(np.ascontiguousarray(a.T if name.endswith(CONV1D) else a))
            if hybrid:
                state[name] = _hf_hybrid(name, state[name], cfg, arch)
    if arch == "qwen3next":  # q|k|v and z back into one tensor grouped per key head
        nk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        for name in [n for n in state if n.endswith("in_proj_qkv.weight")]:
            qkv, z = state.pop(name), state.pop(name.replace("in_proj_qkv", "in_proj_z"))
            pieces = [p.reshape(nk, -1, p.shape[-1]) for p in (*qkv.split([nk * dk, nk * dk, z.shape[0]]), z)]
            state[name.replace("in_proj_qkv", "in_proj_qkvz")] = torch.cat(pieces, dim=1).reshape(-1, z.shape[-1])
    return {**state, **_hf_experts(experts, arch)}


def _hf_hybrid(name: str, t: torch.Tensor, cfg, arch: str) -> torch.Tensor:
    """A hybrid's tensor of the file back as transformers holds it: norms less the 1, A_log from A, the conv1d
    [channels, 1, kernel], Qwen3.5's value heads back from tiled to grouped by key head."""
    from pagoda.engine.gguf import a_log

    nk, nv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return t - 1
    if arch != "qwen3next" and nk != nv and ".linear_attn." in name:
        r = nv // nk
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            t = torch.cat([t[:2 * nk * dk], reorder_v_heads(t[2 * nk * dk:], 0, r, nk, dv)])
        elif name.endswith("in_proj_z.weight"):
            t = reorder_v_heads(t, 0, r, nk, dv)
        elif name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
            t = reorder_v_heads(t, 0, r, nk, 1)
        elif name.endswith("out_proj.weight"):
            t = reorder_v_heads(t, 1, r, nk, dv)
    if name.endswith("A_log"):
        return a_log(t)
    return t.unsqueeze(1) if name.endswith("conv1d.weight") else t


def _hf_experts(experts: dict, arch: str) -> dict[str, torch.Tensor]:
    """The experts' 3-d tensors ([E, out, in], biases [E, out]) as transformers' fused parameters: gate_up_proj
    [E, 2I, H] (gate | up) and down_proj [E, H, I]; gpt-oss's [E, H, 2I] (gate | up interleaved) and [E, I, H]."""
    state = {}
    for name in experts:
        n, kind = name.split(".")[1], name.split(".")[-1]
        if "ffn_gate_exps" not in name:
            continue
        gate, up, down = (experts[f"blk.{n}.ffn_{p}_exps.{kind}"] for p in ("gate", "up", "down"))
        prefix, suffix = f"model.layers.{n}.mlp.experts.", "_bias" if kind == "bias" else ""
        if arch == "gpt-oss":
            gate_up = torch.stack([gate, up], dim=2).flatten(1, 2)  # [E, 2I(, H)] interleaved
            state[prefix + "gate_up_proj" + suffix] = gate_up if kind == "bias" else gate_up.transpose(1, 2)
            state[prefix + "down_proj" + suffix] = down if kind == "bias" else down.transpose(1, 2)
        else:
            state[prefix + "gate_up_proj"], state[prefix + "down_proj"] = torch.cat([gate, up], dim=1), down
    return {k: v.contiguous() for k, v in state.items()}

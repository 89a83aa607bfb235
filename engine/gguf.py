"""GGUF checkpoints (llama.cpp's files, Ollama's blobs): where one is (a file, a directory holding one, split
files, `ollama:NAME[:TAG]` in the local Ollama store; on the hub: engine/loader.py hub_gguf), its config and
tokenizer from its metadata (transformers' GGUF readers; _family_config), and its tensors into a model (this
rank's rows, or columns in whole blocks): floats as floats, the block types pagoda's CPU kernels compute on kept
as blocks (GGUFWeight, computed on by engine/layers/quantization.py), other types widened to the model's dtype.
Mixtures of experts (Mixtral, written as llama with experts; Qwen2-MoE; Qwen3-MoE; gpt-oss): each projection's
experts are one 3-d tensor, placed per expert and kept in its blocks for the CPU expert op (csrc/moe_cpu.cpp:
those types and MXFP4).

Reading uses the `gguf` package (llama.cpp's own gguf-py, which transformers' GGUF support needs as well):
it follows the format as llama.cpp changes it, and its dequantize is the tests' oracle for every type."""
import glob
import json
import logging
import os
import re
from dataclasses import dataclass

import numpy as np
import torch
from pagoda.engine.layers import cpu_ops

log = logging.getLogger("pagoda.engine")

MAGIC = b"GGUF"
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
# general.architecture -> the transformers class pagoda serves it as
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gpt2": "GPT2LMHeadModel", "qwen2moe": "Qwen2MoeForCausalLM",
                 "qwen3moe": "Qwen3MoeForCausalLM", "gpt-oss": "GptOssForCausalLM",  # Mixtral: llama with experts
                 "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
                 "olmo2": "Olmo2ForCausalLM", "granite": "GraniteForCausalLM", "smollm3": "SmolLM3ForCausalLM",
                 "qwen35": "Qwen3_5ForCausalLM", "qwen35moe": "Qwen3_5MoeForCausalLM",
                 "qwen3next": "Qwen3NextForCausalLM"}
# the families whose config is built here from the metadata (_family_config): transformers' GGUF reader knows none of
# the last three, and leaves out of the first three what their models read (soft-caps, layer pattern, partial RoPE)
_FAMILIES = ("gemma2", "gemma3", "phi3", "olmo2", "granite", "smollm3")
_TOKEN_IDS = (("bos", "bos"), ("eos", "eos"), ("pad", "padding"))  # the config's and tokenizer.ggml.*'s names
# families transformers' GGUF reader refuses (gpt-oss: it fails on the rope.scaling.* fields its files have)
_NO_READER = ("olmo2", "granite", "smollm3", "gpt-oss", "qwen35", "qwen35moe", "qwen3next")
# hybrid linear attention (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): config from the metadata here (_hybrid_config)
_HYBRID = ("qwen35", "qwen35moe", "qwen3next")
_TILED = ("qwen35", "qwen35moe")  # the converter reorders their value heads from grouped by key head to tiled
_PERMUTED = ("llama", "granite", "smollm3")  # the convert script's LlamaModel and its subclasses permute Q/K rows
# llama.cpp's tensor names -> the Hugging Face checkpoint's (a layer's: under model.layers.N.)
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_PREFIX = "model.layers"
_LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
                # mixtures of experts: the router, Qwen2-MoE's shared expert and its gate ([hidden] in the file)
                "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
                "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
_GPT_OSS_NAMES = {**_LAYER_NAMES, "ffn_gate_inp": "mlp.router", "post_attention_norm": "post_attention_layernorm",
                  "attn_sinks": "self_attn.sinks"}
# Gemma's and OLMo 2's norms after attention and the MLP; Phi-3's fused q|k|v and gate|up
_POST_NORMS = {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# the hybrids' linear-attention layers (Qwen3-Next's q|k|v|z written as Qwen3.5's q|k|v and z, its b|a as one
# tensor grouped per key head); ssm_a (A = -exp(A_log)) and ssm_dt (dt_bias) are parameters of their own
_HYBRID_NAMES = {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                 "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
                 "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
                 "ssm_ba": "linear_attn.in_proj_ba", "ssm_conv1d": "linear_attn.conv1d", "ssm_a": "linear_attn.A_log",
                 "ssm_dt": "linear_attn.dt_bias", "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj"}
_OWN_PARAMS = ("attn_sinks", "ssm_a", "ssm_dt")  # a layer's parameter, not a module's weight / bias
_FAMILY_NAMES = {"gemma2": _POST_NORMS, "gemma3": _POST_NORMS, "olmo2": _POST_NORMS, "gpt-oss": _GPT_OSS_NAMES,
                 "phi3": {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
                 **dict.fromkeys(_HYBRID, _HYBRID_NAMES)}
# the experts' 3-d tensors (one a projection holding every expert: ggml [in, out, E], biases [out, E]) -> the piece
# of engine/layers/moe.py Experts they fill
_EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.(weight|bias)$")
# GPT-2's (its linear weights stored [out, in] as pagoda's layers hold them, not as its Conv1D checkpoints)
_GPT2_NAMES = ({"token_embd": "transformer.wte", "position_embd": "transformer.wpe", "output_norm": "transformer.ln_f",
                "output": "lm_head"}, "transformer.h",
               {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
                "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"})
_FLOATS = ("F32", "F16", "BF16")
# the block types pagoda's CPU kernels compute on (csrc/gguf_cpu.cpp), by ggml type id: (weights, bytes) a block
GGUF_KERNEL_TYPES = {"Q8_0": (8, 32, 34), "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22),
                     "Q5_1": (7, 32, 24), "IQ4_NL": (20, 32, 18), "Q2_K": (10, 256, 84), "Q3_K": (11, 256, 110),
                     "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210),
                     "IQ4_XS": (23, 256, 136)}
# the experts' op (csrc/moe_cpu.cpp) computes on those and on MXFP4 (gpt-oss's experts): (weights, bytes) a block
EXPERT_TYPES = {**{k: v[1:] for k, v in GGUF_KERNEL_TYPES.items()}, "MXFP4": (32, 17)}


@dataclass
class GGUFWeight:
    """A linear layer's or an embedding's weight in GGUF blocks (engine/layers/quantization.py computes on it):
    parts in output order, each (type name, blocks [rows, row_bytes] uint8), or (None, float [rows, in]) for a
    float part (a fused layer whose pieces the file stores in different types). dtype: the model's, of an
    embedding's rows. GPTQ / AWQ checkpoints are repacked into Q4_1 parts (engine/int4.py)."""
    parts: list
    in_features: int
    dtype: torch.dtype = torch.float32
    perm: torch.Tensor | None = None  # [in] the input columns' order the blocks hold (GPTQ act-order), if not theirs

    @property
    def out_features(self) -> int:
        return sum(t.shape[0] for _, t in self.parts)


def is_gguf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def find_gguf(model: str) -> str | None:
    """The GGUF file `model` names (its first piece when split), or None where it names none: a .gguf file, a
    directory holding one and no safetensors, `ollama:NAME[:TAG]`. ValueError naming `model` where it names a
    file that is not GGUF or several."""
    if model.startswith("ollama:"):
        return ollama_blob(model.removeprefix("ollama:"))
    path = os.path.expanduser(model)
    if os.path.isfile(path):
        if is_gguf(path):
            return path
        if path.endswith(".gguf"):
            raise ValueError(f"model {model!r} is not a GGUF file (it does not begin with the GGUF magic)")
        return None
    if not os.path.isdir(path) or glob.glob(os.path.join(path, "*.safetensors")):
        return None
    firsts = sorted(f for f in glob.glob(os.path.join(path, "*.gguf")) if split_names(f)[0] == f)
    if len(firsts) > 1:
        raise ValueError(f"model {model!r} holds several GGUF files ({', '.join(map(os.path.basename, firsts))}): "
                         f"pass the one to serve")
    return find_gguf(firsts[0]) if firsts else None


def ollama_blob(ref: str) -> str:
    """The model blob of an Ollama model (NAME[:TAG], TAG latest by default) in the local store ($OLLAMA_MODELS,
    else ~/.ollama/models), read where it lies."""
    root = os.environ.get("OLLAMA_MODELS") or os.path.expanduser("~/.ollama/models")
    name, _, tag = ref.partition(":")
    parts = name.split("/")
    parts = (["registry.ollama.ai", "library"] + parts)[-3:] if len(parts) < 3 else parts
    manifest = os.path.join(root, "manifests", *parts, tag or "latest")
    if not name or not os.path.isfile(manifest):
        raise ValueError(f"model 'ollama:{ref}': no such model in the Ollama store {root} (no {manifest}; "
                         f"`ollama pull {ref}` first, or set OLLAMA_MODELS)")
    try:
        with open(manifest) as f:
            layers = json.load(f)["layers"]
        digest = next(x["digest"] for x in layers if x["mediaType"] == "application/vnd.ollama.image.model")
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        raise ValueError(f"model 'ollama:{ref}': {manifest} is not an Ollama manifest with a model layer") from None
    blob = os.path.join(root, "blobs", digest.replace(":", "-"))
    if not is_gguf(blob):
        raise ValueError(f"model 'ollama:{ref}': its blob {blob} is missing or not a GGUF file")
    return blob


def split_names(path: str) -> list[str]:
    """Every piece's name of a split GGUF (NAME-00001-of-0000N.gguf, ...) given any of them, else [path]."""
    m = _SPLIT.match(os.path.basename(path))
    if m is None:
        return [path]
    return [os.path.join(os.path.dirname(path), f"{m['stem']}-{i:05d}-of-{m['count']}.gguf")
            for i in range(1, int(m["count"]) + 1)]


def split_files(path: str) -> list[str]:
    """Every piece of a split GGUF given its first, else [path]."""
    files = split_names(path)
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise ValueError(f"{path}: split GGUF lacks {os.path.basename(missing[0])} ({len(files)} pieces)")
    return files


def open_reader(path: str):
    from gguf import GGUFReader

    try:
        return GGUFReader(path, mode="c")  # copy-on-write: tensors are writable views of the file, never written
    except Exception as e:  # noqa: BLE001 - truncated, corrupt: numpy's and gguf's own words
        raise ValueError(f"{path} is not a readable GGUF file ({' '.join(str(e).split()) or type(e).__name__})") \
            from None


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def architecture(reader, path: str) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: general.architecture {arch!r} is not one pagoda serves from GGUF "
                         f"({', '.join(ARCHITECTURES)})")
    return arch


def file_type(reader) -> str:
    """What the file's weights are stored in, as llama.cpp names it (general.file_type: Q4_K_M, Q8_0, F16, ...);
    without that field, the type most of its matrices are in (llama.cpp guesses so too)."""
    from gguf import LlamaFileType

    ft = _field(reader, "general.file_type")
    try:
        name = LlamaFileType(int(ft) & ~LlamaFileType.GUESSED).name
    except (TypeError, ValueError):  # absent, or a type this gguf package does not know
        kinds = [t.tensor_type.name for t in reader.tensors if len(t.shape) > 1]
        return max(set(kinds), key=kinds.count) if kinds else "F32"
    return {"ALL_F32": "F32"}.get(name, name.removeprefix("MOSTLY_"))


def load_config(path: str):
    """The transformers config the file's metadata describes (AutoConfig's GGUF reader; _family_config for
    _FAMILIES), with what it leaves out: the architecture class, head_dim (attention.key_length) and the special
    token ids."""
    from transformers import AutoConfig

    reader = open_reader(path)
    arch = architecture(reader, path)
    if arch in _FAMILIES:
        config = _family_config(reader, arch, path)
    elif arch == "gpt-oss":  # transformers' reader misses most of it, and fails on per-layer arrays
        config = _gpt_oss_config(reader, path)
    elif arch in _HYBRID:  # transformers' reader knows none of them
        config = _hybrid_config(reader, arch, path)
    else:
        try:
            config = AutoConfig.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
        except Exception as e:  # noqa: BLE001 - a field missing or of the wrong type
            raise ValueError(f"{path}: cannot build a config from its metadata ({' '.join(str(e).split())})") \
                from None
    config.architectures = [ARCHITECTURES[config.model_type if config.model_type in ARCHITECTURES else arch]]
    if _field(reader, f"{arch}.expert_count"):
        config = _moe_config(config, reader, arch)
    head_dim = _field(reader, f"{arch}.attention.key_length")
    if head_dim is not None and arch != "gpt2":
        config.head_dim = int(head_dim)
    if arch == "gpt2":  # transformers reads the context into n_ctx and the MLP size into no field GPT-2 has
        config.n_positions = config.n_ctx
        inner = _field(reader, "gpt2.feed_forward_length")
        config.n_inner = None if inner is None else int(inner)
    for key, gguf_key in _TOKEN_IDS:
        token = _field(reader, f"tokenizer.ggml.{gguf_key}_token_id")
        if token is not None:
            setattr(config, f"{key}_token_id", int(token))
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:  # Llama 3.1+: the scaling is in this tensor, not in the metadata
        config.rope_parameters = _llama3_rope(np.array(freqs.data, dtype=np.float32).reshape(-1), reader, arch, path)
    types = sorted({t.tensor_type.name for t in reader.tensors})
    config.gguf = {"file": path, "types": types}  # what the weights are stored in, for the log and refusals
    return config


def _moe_config(config, reader, arch: str):
    """What transformers' GGUF reader leaves out of a mixture of experts' config: Mixtral (llama with experts) as
    MixtralConfig; the experts' sizes; whether the top-k weights are renormalised; the dense layers (no router)."""
    from transformers import MixtralConfig

    if arch == "gpt-oss":  # _gpt_oss_config has it all
        return config
    experts, used = int(_field(reader, f"{arch}.expert_count")), int(_field(reader, f"{arch}.expert_used_count", 1))
    expert_ff = _field(reader, f"{arch}.expert_feed_forward_length")
    layers = config.num_hidden_layers
    if arch == "llama":  # Mixtral: every expert's size is the feed-forward length
        keep = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures", "head_dim")}
        config = MixtralConfig(**keep, num_local_experts=experts, num_experts_per_tok=used)
        config.architectures = ["MixtralForCausalLM"]
        return config
    # Qwen2-MoE / Qwen3-MoE / the hybrids
    config.num_experts, config.num_experts_per_tok = experts, used
    if expert_ff is not None:
        config.moe_intermediate_size = int(expert_ff)
    shared = _field(reader, f"{arch}.expert_shared_feed_forward_length")
    if shared is not None:
        config.shared_expert_intermediate_size = int(shared)
    # llama.cpp renormalises Qwen3's, Qwen3.5's and Qwen3-Next's top-k weights, not Qwen2's
    config.norm_topk_prob = bool(_field(reader, f"{arch}.expert_weights_norm", arch in ("qwen3moe", *_HYBRID)))
    routed = {int(t.name.split(".")[1]) for t in reader.tensors if t.name.endswith("ffn_gate_inp.weight")}
    config.decoder_sparse_step, config.mlp_only_layers = 1, [i for i in range(layers) if i not in routed]
    return config


def _required(reader, arch: str, path: str):
    """(get, tensors) for a config built from the metadata: get(key[, default]) reads `{arch}.{key}`, a ValueError
    naming the file and the field where it is missing and has no default; tensors by name (token_embd checked)."""
    def get(key, default=ValueError):
        value = _field(reader, f"{arch}.{key}", default)
        if value is ValueError:
            raise ValueError(f"{path}: lacks {arch}.{key}, which a {arch} file has")
        return value

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: lacks the tensor token_embd.weight")
    return get, tensors


def _family_config(reader, arch: str, path: str):
    """The config of a _FAMILIES file, from the metadata llama.cpp's convert script writes, and llama.cpp's own
    constants where it writes none: Gemma 2's alternating windows and Gemma 3's five sliding layers to a full one
    (RoPE base 10000 on the sliding ones), Gemma's query scale (the hidden size over the heads for the 27B models,
    else the head size), SmolLM3's RoPE-less fourth layers. ValueError naming the file and the field."""
    from transformers import AutoConfig

    get, tensors = _required(reader, arch, path)
    hidden, heads, layers = int(get("embedding_length")), int(get("attention.head_count")), int(get("block_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    window = int(get("attention.sliding_window", 0) or 0)
    rope = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))}
    scaling = get("rope.scaling.type", "none")
    if scaling == "linear":
        rope.update(rope_type="linear", factor=float(get("rope.scaling.factor")))
    elif scaling != "none":
        raise ValueError(f"{path}: {arch}.rope.scaling.type {scaling!r} is not one pagoda reads from a {arch} file")
    kw = dict(vocab_size=_rows(tensors["token_embd.weight"])[0], hidden_size=hidden, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=int(get("attention.head_count_kv", heads)),
              intermediate_size=int(get("feed_forward_length")), max_position_embeddings=int(get("context_length")),
              rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")), rope_parameters=rope,
              tie_word_embeddings="output.weight" not in tensors,
              attention_bias=any(n.endswith(("attn_q.bias", "attn_qkv.bias")) for n in tensors),
              **{f"{k}_token_id": _field(reader, f"tokenizer.ggml.{g}_token_id") for k, g in _TOKEN_IDS})
    if arch in ("gemma2", "gemma3"):
        big = layers == (46 if arch == "gemma2" else 62)  # llama.cpp's test for the 27B models
        final = float(get("final_logit_softcapping", 30.0 if arch == "gemma2" else 0.0))
        kw.update(head_dim=head_dim, query_pre_attn_scalar=hidden // heads if big else head_dim,
                  final_logit_softcapping=final or None)
    if arch == "gemma2":
        window = window or 4096
        kw.update(attn_logit_softcapping=float(get("attn_logit_softcapping", 50.0)) or None, sliding_window=window,
                  layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)])
    elif arch == "gemma3":
        local = {"rope_type": "default", "rope_theta": 10000.0}
        kw.update(attn_logit_softcapping=None, sliding_window=window or None,
                  rope_parameters={"full_attention": rope, "sliding_attention": local},
                  layer_types=["sliding_attention" if window and (i + 1) % 6 else "full_attention"
                               for i in range(layers)])
    elif arch == "phi3":  # no key_length: the head is hidden / heads, rope.dimension_count of it rotated
        kw["partial_rotary_factor"] = int(get("rope.dimension_count", hidden // heads)) / (hidden // heads)
        rope["partial_rotary_factor"] = kw["partial_rotary_factor"]
        original = int(get("rope.scaling.original_context_length", kw["max_position_embeddings"]))
        if "rope_factors_long.weight" in tensors:  # LongRoPE (Phi-3.5, Phi-4-mini): its factors are tensors
            factors = {k: np.array(tensors[f"rope_factors_{k}.weight"].data, dtype=np.float32).tolist()
                       for k in ("long", "short")}
            rope.update(rope_type="longrope", long_factor=factors["long"], short_factor=factors["short"],
                        original_max_position_embeddings=original)
        kw.update(original_max_position_embeddings=original, sliding_window=window or None)
    elif arch == "olmo2" and window:
        raise ValueError(f"{path}: olmo2.attention.sliding_window is set: an OLMo 3 file, which pagoda does not "
                         f"serve from GGUF")
    elif arch == "granite":  # llama.cpp: no attention.scale is 1/sqrt(head size), no other scale is 1
        kw.update(attention_multiplier=float(get("attention.scale", 0.0)) or head_dim ** -0.5,
                  embedding_multiplier=float(get("embedding_scale", 1.0)),
                  residual_multiplier=float(get("residual_scale", 1.0)), logits_scaling=float(get("logit_scale", 1.0)))
    elif arch == "smollm3":
        kw.update(no_rope_layer_interval=4, use_sliding_window=False)
    return AutoConfig.for_model({"gemma3": "gemma3_text"}.get(arch, arch), **kw)


def _gpt_oss_config(reader, path: str):
    """gpt-oss's config from the metadata llama.cpp's convert script writes, and llama.cpp's own constants where it
    writes none: SwiGLU clamped at 7, sliding windows on the even layers, YaRN's betas 32 and 1. ValueError naming
    the file and the field."""
    from transformers import GptOssConfig

    get, tensors = _required(reader, "gpt-oss", path)
    layers, heads, limit = int(get("block_count")), int(get("attention.head_count")), get("swiglu_clamp_exp", 7.0)
    rope = {"rope_type": "yarn", "rope_theta": float(get("rope.freq_base", 150000.0)),
            "factor": float(get("rope.scaling.factor", 1.0)),
            "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0)), "truncate": False,
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length", get("context_length")))}
    config = GptOssConfig(
        vocab_size=_rows(tensors["token_embd.weight"])[0], hidden_size=int(get("embedding_length")),
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=int(get("attention.head_count_kv")),
        head_dim=int(get("attention.key_length")), max_position_embeddings=int(get("context_length")),
        intermediate_size=int(get("expert_feed_forward_length")), num_local_experts=int(get("expert_count")),
        num_experts_per_tok=int(get("expert_used_count")), rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        sliding_window=int(get("attention.sliding_window")), rope_parameters=rope,
        swiglu_limit=float(limit[0] if isinstance(limit, list) else limit),
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        tie_word_embeddings="output.weight" not in tensors)
    return config


def _hybrid_config(reader, arch: str, path: str):
    """Qwen3.5's, Qwen3.5-MoE's or Qwen3-Next's config from the metadata llama.cpp's convert script writes: the
    linear-attention sizes as its ssm.* fields (state size: the key heads' size; group count: the key heads;
    time-step rank: the value heads; inner size: all value heads), a full-attention layer every
    full_attention_interval, rope.dimension_count of each head rotated (mrope's sections: one position for text,
    so plain RoPE). The experts: _moe_config. ValueError naming the file and the field."""
    from transformers import AutoConfig

    get, tensors = _required(reader, arch, path)
    head_dim, layers = int(get("attention.key_length")), int(get("block_count"))
    every, values = int(get("full_attention_interval")), int(get("ssm.time_step_rank"))
    rope = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0)),
            "partial_rotary_factor": int(get("rope.dimension_count")) / head_dim}
    kw = dict(vocab_size=_rows(tensors["token_embd.weight"])[0], hidden_size=int(get("embedding_length")),
              num_hidden_layers=layers, num_attention_heads=int(get("attention.head_count")),
              num_key_value_heads=int(get("attention.head_count_kv")), head_dim=head_dim,
              max_position_embeddings=int(get("context_length")),
              rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")), rope_parameters=rope,
              tie_word_embeddings="output.weight" not in tensors, linear_conv_kernel_dim=int(get("ssm.conv_kernel")),
              linear_key_head_dim=int(get("ssm.state_size")), linear_num_key_heads=int(get("ssm.group_count")),
              linear_num_value_heads=values, linear_value_head_dim=int(get("ssm.inner_size")) // values,
              layer_types=["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)],
              **{f"{k}_token_id": _field(reader, f"tokenizer.ggml.{g}_token_id") for k, g in _TOKEN_IDS})
    if get("feed_forward_length", None) is not None:  # Qwen3.5-MoE has none
        kw["intermediate_size"] = int(get("feed_forward_length"))
    model_type = {"qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text", "qwen3next": "qwen3_next"}[arch]
    return AutoConfig.for_model(model_type, **kw)


def _untiled(nk: int, r: int, size: int) -> torch.Tensor:
    """The rows (of `size` each value head) that put value heads stored tiled (v0 of every key head, then v1, ...:
    llama.cpp's order for ggml's broadcast) back in Hugging Face's order (each key head's r value heads together)."""
    heads = torch.arange(nk * r)
    return ((heads % r * nk + heads // r)[:, None] * size + torch.arange(size)).reshape(-1)


def a_log(a: torch.Tensor) -> torch.Tensor:
    """A_log from the file's A = -exp(A_log) (float32, as the convert script computes it): the float32 value whose
    -exp is A exactly where one is near log(-A), so that the model's decay (-exp(A_log)) is the file's A."""
    y = torch.log(-a.double()).float()
    out = y.clone()
    for step in (1, -1, 2, -2):
        toward = torch.full_like(y, float("inf") if step > 0 else float("-inf"))
        cand = y
        for _ in range(abs(step)):
            cand = torch.nextafter(cand, toward)
        fix = (-torch.exp(out) != a) & (-torch.exp(cand) == a)
        out = torch.where(fix, cand, out)
    return out


def _hybrid_dims(reader, arch: str) -> tuple[int, int, int, int]:
    """(key heads, value heads as the convert script reordered them: Qwen3-Next's not, so given as the key heads,
    key head size, value head size) of a hybrid file's linear attention."""
    nk, nv = int(_field(reader, f"{arch}.ssm.group_count")), int(_field(reader, f"{arch}.ssm.time_step_rank"))
    dv = int(_field(reader, f"{arch}.ssm.inner_size")) // nv
    return nk, nv if arch in _TILED else nk, int(_field(reader, f"{arch}.ssm.state_size")), dv


def _undo_hybrid(name: str, t: torch.Tensor, dims: tuple, blocks: bool) -> torch.Tensor:
    """Undo what the convert script did to a Qwen3.5 tensor of the whole file (before a rank takes its part): value
    heads back from tiled to grouped order (rows of q|k|v's v, z, b, a, A, dt_bias and the conv1d's v channels;
    ssm_out's columns: whole blocks where `blocks`, rows [out, in bytes]), A back to A_log."""
    nk, nv, dk, dv = dims
    kind = name.split(".")[2] if name.startswith("blk.") else name
    if nv != nk and kind in ("attn_qkv", "ssm_conv1d"):
        t = torch.cat([t[:2 * nk * dk], t[2 * nk * dk:][_untiled(nk, nv // nk, dv)]])
    elif nv != nk and kind in ("attn_gate", "ssm_beta", "ssm_alpha", "ssm_a", "ssm_dt"):
        t = t[_untiled(nk, nv // nk, dv if kind == "attn_gate" else 1)]
    elif nv != nk and kind == "ssm_out" and blocks:  # every head's columns: whole blocks
        t = t.view(t.shape[0], nv, -1)[:, _untiled(nk, nv // nk, 1)].reshape(t.shape[0], -1)
    elif nv != nk and kind == "ssm_out":
        t = t[:, _untiled(nk, nv // nk, dv)]
    return a_log(t) if kind == "ssm_a" else t


def _tiled_columns(name: str, dims: tuple | None, block: int) -> bool:
    """Whether a Qwen3.5 ssm_out's value heads, stored tiled, are parts of blocks (a head of 128 columns in K-quants'
    super-blocks of 256), so that moving its columns back would cut blocks."""
    return bool(dims) and name.endswith("ssm_out.weight") and dims[1] != dims[0] and dims[3] % block != 0


def _llama3_rope(factors: np.ndarray, reader, arch: str, path: str) -> dict:
    """transformers' llama3 rope_parameters that give the per-frequency factors llama.cpp's convert script
    stored in rope_freqs.weight: factor is their largest, low/high_freq_factor and the original context
    are Llama 3's (1, 4, 8192) unless the metadata says otherwise; ValueError where they do not give them."""
    theta = float(_field(reader, f"{arch}.rope.freq_base", 10000.0))
    original = int(_field(reader, f"{arch}.rope.scaling.original_context_length", 8192))
    dim = 2 * factors.shape[0]
    low, high, factor = 1.0, 4.0, float(factors.max())
    params = {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": low,
              "high_freq_factor": high, "original_max_position_embeddings": original}
    wavelen = 2 * np.pi * theta ** (np.arange(0, dim, 2) / dim)
    smooth = np.clip((original / wavelen - low) / (high - low), 0, 1)  # 1: high frequencies, kept; 0: divided
    want = 1 / ((1 - smooth) / factor + smooth)
    if not np.allclose(want, factors, rtol=1e-3):
        raise ValueError(f"{path}: rope_freqs.weight holds RoPE factors that are not Llama 3's scaling (factor "
                         f"{params['factor']:g}, low/high_freq_factor 1/4, original context {original})")
    return params


def load_tokenizer(path: str):
    """The tokenizer (and chat template) the file's metadata describes (transformers' GGUF converter; the
    generic fast tokenizer for a family transformers' GGUF reader does not know, as AutoTokenizer reads that)."""
    from transformers import AutoTokenizer, TokenizersBackend

    cls = TokenizersBackend if _field(open_reader(path), "general.architecture") in _NO_READER else AutoTokenizer
    try:
        return cls.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    except Exception as e:  # noqa: BLE001 - tokenizer.ggml.* fields missing or of a model it cannot rebuild
        raise ValueError(f"{path}: cannot rebuild the tokenizer from its tokenizer.ggml.* metadata "
                         f"({' '.join(str(e).split())}); pass a tokenizer directory") from None


def hf_name(name: str, arch: str = "llama") -> str | None:
    """A llama.cpp tensor name as the Hugging Face checkpoint names it (None: nothing pagoda loads)."""
    names, prefix, layer = _GPT2_NAMES if arch == "gpt2" else (_GLOBAL_NAMES, _LAYER_PREFIX, _LAYER_NAMES)
    layer = _FAMILY_NAMES.get(arch, layer)
    base, _, kind = name.rpartition(".") if not name.endswith(".ssm_a") else (name, "", "")  # A: no suffix
    if base in names:
        return f"{names[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer:
        kind = "" if parts[2] in _OWN_PARAMS else f".{kind}"
        return f"{prefix}.{parts[1]}.{layer[parts[2]]}{kind}"
    return None


def _unpermute(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert script's reordering of a llama Q or K projection's rows (each head's halves
    interleaved for its RoPE), as transformers' GGUF loader does; whole rows, so blocks too."""
    rows = torch.arange(t.shape[0]).view(heads, t.shape[0] // heads // 2, 2).transpose(1, 2).reshape(-1)
    return t[rows]


def _rows(t) -> tuple[int, int]:
    """(rows, input features) of a tensor as stored: ggml's shape is innermost first."""
    shape = [int(n) for n in t.shape]
    return int(np.prod(shape[1:], dtype=np.int64)), shape[0]


def _float(t, dtype: torch.dtype, file: str) -> torch.Tensor:
    """A float tensor of the file, or one of another type widened, in `dtype`: [rows, in] (or [in])."""
    from gguf.quants import dequantize

    rows, cols = _rows(t)
    name = t.tensor_type.name
    if name == "BF16":
        out = torch.from_numpy(np.array(t.data).view(np.int16)).view(torch.bfloat16)
    elif name in ("F32", "F16"):
        out = torch.from_numpy(np.array(t.data))
    else:
        try:
            out = torch.from_numpy(dequantize(t.data, t.tensor_type))
        except (NotImplementedError, ValueError) as e:
            raise ValueError(f"{file}: tensor {t.name!r} is of type {name}, which pagoda cannot read "
                             f"({' '.join(str(e).split()) or type(e).__name__})") from None
    out = out.reshape(rows, cols).to(dtype)
    return out[0] if len(t.shape) == 1 else out


def load_weights(model: torch.nn.Module, path: str, optional: tuple[str, ...] = ()) -> None:
    """The file's (or its split pieces') tensors into the model. Linear weights of a type the CPU kernels
    compute on (GGUF_KERNEL_TYPES) stay blocks where those run; every other non-float type is widened to
    the model's dtype, in one log line naming the tensors. Under tensor parallelism each rank keeps its rows,
    or its columns in whole blocks (a split inside a block widens that tensor)."""
    files = split_files(path)
    readers = [open_reader(f) for f in files]
    arch = architecture(readers[0], path)
    log.info("reading the weights: %d GGUF file%s, %.2f GiB", len(files), "s" * (len(files) > 1),
             sum(os.path.getsize(f) for f in files) / 2**30)
    heads = {"q_proj": _field(readers[0], f"{arch}.attention.head_count"),  # the rows llama.cpp permuted
             "k_proj": _field(readers[0], f"{arch}.attention.head_count_kv")} if arch in _PERMUTED else {}
    dims = _hybrid_dims(readers[0], arch) if arch in _HYBRID else None
    params = dict(model.named_parameters())
    dtype, device = next(iter(params.values())).dtype, next(iter(params.values())).device
    native, why = cpu_ops.is_available(device)
    missing, widened = set(params), {}
    blocks: dict[torch.nn.Module, dict] = {}  # linear layer or embedding -> {shard: (ggml type, blocks)}
    expert_types = _expert_types(readers)
    perms: dict[torch.nn.Module, torch.Tensor] = {}  # layer -> GGUFWeight.perm (_tiled_columns)
    for reader, file in zip(readers, files):
        for t in reader.tensors:
            if _EXPERTS.match(t.name):
                missing.discard(_load_experts(model, params, t, file, native, dtype, widened, expert_types))
                continue
            name = hf_name(t.name, arch)
            target = None if name is None else param_of(model, params, name, f"{file} (as {t.name!r})")
            if target is None:
                continue
            owner, pname, shard = target
            kind = t.tensor_type.name
            rows, cols = _rows(t)
            keep = (native and kind in GGUF_KERNEL_TYPES and owner.weight is params[pname]
                    and isinstance(owner, (torch.nn.Linear, torch.nn.Embedding))
                    and _whole_blocks(owner, cols, GGUF_KERNEL_TYPES[kind][1]))
            tiled = keep and _tiled_columns(t.name, dims, GGUF_KERNEL_TYPES[kind][1])
            if tiled and owner.tp.size > 1:  # a rank's value heads would cut blocks
                keep = tiled = False
            if keep:
                tensor = torch.from_numpy(t.data).view(torch.uint8).reshape(rows, -1)  # the file's: to_blocks copies
            else:
                tensor = _float(t, dtype, file)
                if kind not in _FLOATS:
                    widened.setdefault(kind, []).append(t.name)
                if tensor.dim() == 1 and params[pname].dim() == 2:  # Qwen2-MoE's shared expert gate: [hidden]
                    tensor = tensor.view(1, -1)
            proj = name.rsplit(".", 2)[-2]
            if proj in heads:
                tensor = _unpermute(tensor, heads[proj])
            if tiled:  # the blocks stay in the file's column order, the activations are gathered to it per call
                perms[owner] = torch.argsort(_untiled(dims[0], dims[1] // dims[0], dims[3]))
            elif dims is not None:
                tensor = _undo_hybrid(t.name, tensor, dims, keep)
            tensor = _rank_part(tensor, owner, pname, shard, GGUF_KERNEL_TYPES[kind][1:] if keep else (1, 1))
            if t.name.endswith("ssm_ba.weight"):  # Qwen3-Next's b|a grouped per key head: this rank's heads'
                from pagoda.engine.models.qwen3_5 import _per_key_head_to_blocks

                tensor = _per_key_head_to_blocks(model.get_submodule(pname.rsplit(".", 2)[0]), pname, tensor)
            if tensor.dim() == 2 and params[pname].dim() == 3:  # the conv1d: [channels, kernel] in the file
                tensor = tensor.unsqueeze(1)
            if keep:
                blocks.setdefault(owner, {})[shard] = (kind, tensor)
                _check_shape(owner, pname, shard, tensor, GGUF_KERNEL_TYPES[kind][1:], params[pname], file, t.name)
            else:
                copy_into(owner, pname, params[pname], shard, tensor, file, t.name)
            missing.discard(pname)
    for mname, m in model.named_modules():  # experts kept as blocks: gate and up of different types widened
        for piece in m.finish_gguf_() if getattr(m, "gguf_pieces", None) else ():
            widened.setdefault("gate and up in different types", []).append(
                f"blk.{mname.split('.')[1]}.ffn_{piece}_exps.weight")
    missing = {n for n in missing if not n.startswith(optional)} if optional else missing
    if missing:
        raise ValueError(f"{path} lacks weights for: {', '.join(sorted(missing)[:8])}")
    for layer in list(blocks):
        shards = blocks.pop(layer)  # freed once joined into the layer's parts, not at the end
        tied = [m for m in model.modules() if m is not layer and getattr(m, "weight", None) is layer.weight]
        weight = to_blocks(layer, shards, dtype)
        weight.perm = perms.get(layer)
        for m in tied:  # a tied LM head: the embedding's blocks
            m.qweight, m.weight = weight, None
    if widened:
        why = ("no CPU kernel for the type, an embedding split over ranks, or blocks a rank's columns would split"
               if native else f"not on pagoda's CPU ops: {why}")
        log.info("GGUF %s: widened to %s (%s): %s", os.path.basename(path), str(dtype).removeprefix("torch."), why,
                 "; ".join(f"{k}: {', '.join(v)}" for k, v in widened.items()))


def _expert_types(readers) -> dict[str, dict[str, str]]:
    """layer -> {gate / up / down: the ggml type name of its experts' weight}"""
    out: dict[str, dict[str, str]] = {}
    for t in (t for r in readers for t in r.tensors):
        if (m := _EXPERTS.match(t.name)) and m[3] == "weight":
            out.setdefault(m[1], {})[m[2]] = t.tensor_type.name
    return out


def _expert_split(owner, types: dict[str, str], native: bool) -> tuple[int, int]:
    """This rank's (start, size) of the experts' intermediate size: the even split; or, where that would cut the
    down projection's blocks (Qwen3-30B-A3B's 768 over 2 ranks: 384, a super-block and a half) and every piece stays
    blocks, whole blocks dealt out, the first ranks one more (512 and 256), rather than widening down."""
    n = owner.intermediate_size
    a, block = owner.tp.rank * n, EXPERT_TYPES.get(types.get("down"), (1,))[0]
    count, size = owner.full_intermediate // block, owner.tp.size
    if (a % block == 0 and n % block == 0) or not native or count < size or types.get("gate") != types.get("up") \
            or not set(types.values()) <= EXPERT_TYPES.keys() or owner.gate_up_proj_bias is not None:
        return a, n
    counts = [count // size + (r < count % size) for r in range(size)]
    return sum(counts[:owner.tp.rank]) * block, counts[owner.tp.rank] * block


@torch.no_grad()
def _load_experts(model, params: dict, t, file: str, native: bool, dtype: torch.dtype, widened: dict,
                  expert_types: dict) -> str:
    """An experts' tensor (ggml [in, out, E]: every expert's gate, up or down projection; or [out, E] their
    biases) into the layer's Experts (engine/layers/moe.py): this rank's rows of gate / up, its columns of down
    (in whole blocks: _expert_split). Blocks of a type the CPU op computes on (GGUF_KERNEL_TYPES, MXFP4) stay
    blocks where it runs; other types are widened. Returns the parameter filled."""
    layer, piece, kind = _EXPERTS.match(t.name).groups()
    hf = f"{_LAYER_PREFIX}.{layer}.mlp.experts.{'down_proj' if piece == 'down' else 'gate_up_proj'}"
    owner, pname, _ = param_of(model, params, hf + ("_bias" if kind == "bias" else ""), f"{file} (as {t.name!r})")
    if owner.gguf_split is None:
        owner.gguf_split = _expert_split(owner, expert_types.get(layer, {}), native)
        owner.intermediate_size = owner.gguf_split[1]
    (a, n), E, hidden = owner.gguf_split, owner.num_experts, owner.hidden_size
    full = (hidden, owner.full_intermediate) if piece == "down" else (owner.full_intermediate, hidden)
    shape = [int(x) for x in reversed(t.shape)]  # [E, out, in] (bias: [E, out])
    want = [E, full[0]] if kind == "bias" else [E, *full]
    if shape != want:
        raise ValueError(f"{file}: tensor {t.name!r} holds {shape} ([experts, out, in]), the model's {pname} wants "
                         f"{want}")
    type_name = t.tensor_type.name
    up = (piece == "up") * n  # where up's rows start in gate_up_proj
    if kind == "bias":
        b = _float(t, dtype, file)  # [E, out]
        if piece == "down":  # added to the partial sums once: rank 0's
            params[pname].copy_(b if owner.tp.rank == 0 else torch.zeros_like(b))
        else:
            params[pname][:, up:up + n].copy_(b[:, a:a + n])
        return pname
    block = EXPERT_TYPES.get(type_name)
    whole = block is not None and (piece != "down" or (a % block[0] == 0 and n % block[0] == 0))
    if native and whole:
        raw = torch.from_numpy(t.data).view(torch.uint8).reshape(E, shape[1], -1)
        raw = raw[:, :, a // block[0] * block[1]:(a + n) // block[0] * block[1]] if piece == "down" else raw[:, a:a + n]
        w, s = _repack_mxfp4(raw) if type_name == "MXFP4" else (raw.clone(), None)
        owner.load_gguf_(piece, type_name, w, s, n if piece == "down" else hidden)
        return pname
    w = _float(t, dtype, file).view(*shape)
    if type_name not in _FLOATS:
        widened.setdefault(type_name, []).append(t.name)
    if piece == "down":
        params[pname].copy_(w[:, :, a:a + n])
    else:
        params[pname][:, up:up + n].copy_(w[:, a:a + n])
    return pname


def _repack_mxfp4(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF MXFP4 blocks [..., K / 32 * 17] (an exponent byte, then 16 bytes: value j in the low nibble of byte j,
    j + 16 in the high one) -> (blocks [..., K / 32, 16], exponents [..., K / 32]) as engine/layers/moe.py's MXFP4
    (value 2j in the low nibble of byte j, 2j + 1 in the high one; same codes and exponents: gguf.quants' halved
    scale and doubled codes cancel)."""
    b = raw.unflatten(-1, (-1, 17))
    q = b[..., 1:]
    v = torch.cat([q & 15, q >> 4], dim=-1)  # [..., 32] codes in order
    return (v[..., 0::2] | (v[..., 1::2] << 4)).contiguous(), b[..., 0].contiguous()


def _whole_blocks(owner, cols: int, block: int) -> bool:
    """Whether this rank's columns of a weight `cols` wide are whole blocks of `block` (and the layer computes on
    blocks on this rank: a vocabulary split over ranks masks its lookups, which the float embedding does)."""
    if cols % block:
        return False
    if isinstance(owner, torch.nn.Embedding):
        return getattr(owner, "tp", None) is None or owner.tp.size == 1
    ranges = [r for pieces in getattr(owner, "tp_parts", {}).values() for r in pieces]
    return getattr(owner, "tp_dim", 0) == 0 or all(a % block == 0 and n % block == 0 for a, n in ranges)


def _rank_part(t: torch.Tensor, owner, pname: str, shard: int | None, block: tuple[int, int]) -> torch.Tensor:
    """The part of a tensor this rank's parameter holds (all of it on one rank), as loader._read reads a
    safetensors one: rows, or columns (of blocks: `block` is (weights, bytes) a block; (1, 1) for floats); a
    row-parallel layer's bias on rank 0 only."""
    parts = getattr(owner, "tp_parts", None)
    if parts is None:
        return t
    is_bias = pname.endswith(".bias")
    if is_bias and owner.tp_dim == 1:
        return t if owner.tp.rank == 0 else torch.zeros_like(t)
    n, size = block
    if is_bias or owner.tp_dim == 0:
        pieces = [t[a:a + k] for a, k in parts[shard]]
    else:
        pieces = [t[:, a // n * size:(a + k) // n * size] for a, k in parts[shard]]
    out = torch.cat(pieces, dim=0 if is_bias or owner.tp_dim == 0 else 1) if len(pieces) > 1 else pieces[0]
    return out if out.numel() == t.numel() else out.clone(memory_format=torch.contiguous_format)  # not a view of t


def _target(owner, param: torch.Tensor, shard: int | None, rows: int) -> torch.Tensor:
    if shard is not None:
        return param.narrow(0, owner.shard_offsets[shard], rows)
    return param.narrow(0, 0, rows) if getattr(owner, "tp_dim", None) == 0 and rows < param.shape[0] else param


def _check_shape(owner, pname, shard, blocks: torch.Tensor, block: tuple[int, int], param, file, name) -> None:
    rows, cols = blocks.shape[0], blocks.shape[1] // block[1] * block[0]
    if tuple(_target(owner, param, shard, rows).shape) != (rows, cols):
        raise ValueError(f"{file}: tensor {name!r} holds [{rows}, {cols}] here, {pname} {tuple(param.shape)}")


def param_of(model, params: dict, name: str, where: str):
    """The parameter a checkpoint tensor fills: (owning module, parameter name, shard), or None for a tensor the
    model skips; ValueError for one it has no place for."""
    mapped = model.checkpoint_name(name)
    if mapped is None:
        return None
    pname, shard = mapped
    if pname not in params:
        raise ValueError(f"unexpected tensor {name!r} in {where}")
    return model.get_submodule(pname.rsplit(".", 1)[0]), pname, shard


@torch.no_grad()
def copy_into(owner, pname, param, shard, tensor, file, name) -> None:
    target = _target(owner, param, shard, tensor.shape[0])
    if target.shape != tensor.shape:
        raise ValueError(f"{file}: tensor {name!r} is {tuple(tensor.shape)}, {pname} {tuple(target.shape)}")
    if target is not param and shard is None:
        param.zero_()  # the vocabulary's last rank: its padding rows stay zero
    target.copy_(tensor)


def to_blocks(layer, shards: dict, dtype: torch.dtype) -> GGUFWeight:
    """The layer's weight as GGUFWeight parts in output order: its shards' blocks, float shards as floats,
    neighbours of one type joined. The float weight is dropped."""
    offsets = getattr(layer, "shard_offsets", None)
    order = [None] if None in shards or offsets is None else list(range(len(offsets)))
    ends = [] if offsets is None else list(offsets[1:]) + [layer.out_features]
    groups = []  # (kind, shards' tensors)
    for s in order:
        kind, t = shards[s] if s in shards else (None, layer.weight.detach()[offsets[s]:ends[s]])
        if s is None and t.shape[0] < layer.weight.shape[0]:  # the vocabulary's last rank: zero blocks pad it
            t = torch.cat([t, t.new_zeros(layer.weight.shape[0] - t.shape[0], t.shape[1])])
        if groups and groups[-1][0] == kind:
            groups[-1][1].append(t)
        else:
            groups.append((kind, [t]))
    # one copy a part, a single shard too: the loaders' blocks may be views of a file's mapping
    parts = [(kind, torch.cat(ts)) for kind, ts in groups]
    layer.qweight = GGUFWeight(parts, layer.weight.shape[1], dtype)
    layer.weight = None
    return layer.qweight

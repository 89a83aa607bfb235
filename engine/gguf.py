"""GGUF checkpoints (llama.cpp's files, Ollama's blobs): where one is (a file, a directory holding one, split
files, `ollama:NAME[:TAG]` in the local Ollama store), its config and tokenizer from its metadata (transformers'
GGUF readers), and its tensors into a model (this rank's rows, or columns in whole blocks): floats as floats,
the block types pagoda's CPU kernels compute on kept as blocks (GGUFWeight, computed on by
engine/layers/quantization.py), other types widened to the model's dtype.

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
                 "qwen3": "Qwen3ForCausalLM", "gpt2": "GPT2LMHeadModel"}
# llama.cpp's tensor names -> the Hugging Face checkpoint's (a layer's: under model.layers.N.)
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_PREFIX = "model.layers"
_LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# GPT-2's (its linear weights stored [out, in] as pagoda's layers hold them, not as its Conv1D checkpoints)
_GPT2_NAMES = ({"token_embd": "transformer.wte", "position_embd": "transformer.wpe", "output_norm": "transformer.ln_f",
                "output": "lm_head"}, "transformer.h",
               {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
                "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"})
_FLOATS = ("F32", "F16", "BF16")
# the block types pagoda's CPU kernels compute on (csrc/gguf_cpu.cpp), by ggml type id: (weights, bytes) a block
GGUF_KERNEL_TYPES = {"Q8_0": (8, 32, 34), "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22),
                     "Q5_1": (7, 32, 24), "IQ4_NL": (20, 32, 18), "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176),
                     "Q6_K": (14, 256, 210)}


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
    firsts = sorted(f for f in glob.glob(os.path.join(path, "*.gguf"))
                    if not _SPLIT.match(os.path.basename(f)) or _SPLIT.match(os.path.basename(f))["index"] == "00001")
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


def split_files(path: str) -> list[str]:
    """Every piece of a split GGUF (NAME-00001-of-0000N.gguf, ...) given its first, else [path]."""
    m = _SPLIT.match(os.path.basename(path))
    if m is None:
        return [path]
    count = int(m["count"])
    files = [os.path.join(os.path.dirname(path), f"{m['stem']}-{i:05d}-of-{count:05d}.gguf")
             for i in range(1, count + 1)]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise ValueError(f"{path}: split GGUF lacks {os.path.basename(missing[0])} ({count} pieces)")
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
    """The transformers config the file's metadata describes (AutoConfig's GGUF reader), with what it leaves
    out: the architecture class, head_dim (attention.key_length) and the special token ids."""
    from transformers import AutoConfig

    reader = open_reader(path)
    arch = architecture(reader, path)
    try:
        config = AutoConfig.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    except Exception as e:  # noqa: BLE001 - a field missing or of the wrong type
        raise ValueError(f"{path}: cannot build a config from its metadata ({' '.join(str(e).split())})") from None
    config.architectures = [ARCHITECTURES[config.model_type if config.model_type in ARCHITECTURES else arch]]
    head_dim = _field(reader, f"{arch}.attention.key_length")
    if head_dim is not None and arch != "gpt2":
        config.head_dim = int(head_dim)
    if arch == "gpt2":  # transformers reads the context into n_ctx and the MLP size into no field GPT-2 has
        config.n_positions = config.n_ctx
        inner = _field(reader, "gpt2.feed_forward_length")
        config.n_inner = None if inner is None else int(inner)
    for key in ("bos", "eos", "padding"):
        token = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if token is not None:
            setattr(config, f"{'pad' if key == 'padding' else key}_token_id", int(token))
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:  # Llama 3.1+: the scaling is in this tensor, not in the metadata
        config.rope_parameters = _llama3_rope(np.array(freqs.data, dtype=np.float32).reshape(-1), reader, arch, path)
    types = sorted({t.tensor_type.name for t in reader.tensors})
    config.gguf = {"file": path, "types": types}  # what the weights are stored in, for the log and refusals
    return config


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
    """The tokenizer (and chat template) the file's metadata describes (transformers' GGUF converter)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    except Exception as e:  # noqa: BLE001 - tokenizer.ggml.* fields missing or of a model it cannot rebuild
        raise ValueError(f"{path}: cannot rebuild the tokenizer from its tokenizer.ggml.* metadata "
                         f"({' '.join(str(e).split())}); pass a tokenizer directory") from None


def hf_name(name: str, arch: str = "llama") -> str | None:
    """A llama.cpp tensor name as the Hugging Face checkpoint names it (None: nothing pagoda loads)."""
    names, prefix, layer = _GPT2_NAMES if arch == "gpt2" else (_GLOBAL_NAMES, _LAYER_PREFIX, _LAYER_NAMES)
    base, _, kind = name.rpartition(".")
    if base in names:
        return f"{names[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer:
        return f"{prefix}.{parts[1]}.{layer[parts[2]]}.{kind}"
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
    heads = {"q_proj": _field(readers[0], "llama.attention.head_count"),  # the rows llama.cpp permuted
             "k_proj": _field(readers[0], "llama.attention.head_count_kv")} if arch == "llama" else {}
    params = dict(model.named_parameters())
    dtype, device = next(iter(params.values())).dtype, next(iter(params.values())).device
    native, why = cpu_ops.is_available(device)
    missing, widened = set(params), {}
    blocks: dict[torch.nn.Module, dict] = {}  # linear layer or embedding -> {shard: (ggml type, blocks)}
    for reader, file in zip(readers, files):
        for t in reader.tensors:
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
            if keep:
                tensor = torch.from_numpy(t.data).view(torch.uint8).reshape(rows, -1)  # the file's: to_blocks copies
            else:
                tensor = _float(t, dtype, file)
                if kind not in _FLOATS:
                    widened.setdefault(kind, []).append(t.name)
            proj = name.rsplit(".", 2)[-2]
            if proj in heads:
                tensor = _unpermute(tensor, heads[proj])
            tensor = _rank_part(tensor, owner, pname, shard, GGUF_KERNEL_TYPES[kind][1:] if keep else (1, 1))
            if keep:
                blocks.setdefault(owner, {})[shard] = (kind, tensor)
                _check_shape(owner, pname, shard, tensor, GGUF_KERNEL_TYPES[kind][1:], params[pname], file, t.name)
            else:
                copy_into(owner, pname, params[pname], shard, tensor, file, t.name)
            missing.discard(pname)
    missing = {n for n in missing if not n.startswith(optional)} if optional else missing
    if missing:
        raise ValueError(f"{path} lacks weights for: {', '.join(sorted(missing)[:8])}")
    for layer in list(blocks):
        shards = blocks.pop(layer)  # freed once joined into the layer's parts, not at the end
        tied = [m for m in model.modules() if m is not layer and getattr(m, "weight", None) is layer.weight]
        weight = to_blocks(layer, shards, dtype)
        for m in tied:  # a tied LM head: the embedding's blocks
            m.qweight, m.weight = weight, None
    if widened:
        why = ("no CPU kernel for the type, an embedding split over ranks, or blocks a rank's columns would split"
               if native else f"not on pagoda's CPU ops: {why}")
        log.info("GGUF %s: widened to %s (%s): %s", os.path.basename(path), str(dtype).removeprefix("torch."), why,
                 "; ".join(f"{k}: {', '.join(v)}" for k, v in widened.items()))


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

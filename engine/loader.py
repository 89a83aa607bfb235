"""Checkpoints in Hugging Face format: config and tokenizer through transformers, weights from
safetensors (sharded or not). Pickle checkpoints are refused and no remote code runs. Under tensor
parallelism each rank reads only the rows or columns its layers hold (engine/executor/parallel.py)."""
import ctypes
import glob
import json
import logging
import math
import os
import re
import sys

import torch
from safetensors import safe_open

from pagoda.engine import gguf, int4

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "*.tiktoken")  # one is enough
_TOKENIZER_HUB_FILES = ["*.json", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]  # no weights
log = logging.getLogger("pagoda.engine")
PROGRESS_BYTES = 1 << 30  # one weight file read: a progress line per GiB (several: a line per file)
CHECKPOINT_FILES = ("a checkpoint directory holds config.json, the tokenizer files and *.safetensors weights "
                    "(e.g. `hf download Qwen/Qwen3-0.6B --local-dir DIR`)")


def resolve_model_path(model: str) -> str:
    """A local checkpoint directory, a hub id downloaded (safetensors only) once, or a GGUF file (engine/gguf.py
    find_gguf: a file, a directory holding one, ollama:NAME; hub_gguf: REPO:QUANT, REPO/FILE.gguf); ValueError
    naming `model` and what is missing."""
    found = gguf.find_gguf(model)  # a GGUF file, a directory holding one, ollama:NAME
    if found is not None:
        return found
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        return check_checkpoint(model, path)
    if os.path.exists(path):
        raise ValueError(f"model must be a checkpoint directory or a hub id, got the file {model!r}: "
                         f"{CHECKPOINT_FILES}")
    found = hub_gguf(model)
    if found is not None:
        return found
    if not _is_hub_id(model):
        raise ValueError(f"model {model!r}: no such directory (a local checkpoint directory, or a Hugging Face "
                         f"hub id such as Qwen/Qwen3-0.6B)")
    log.info("model %s: from the Hugging Face hub (or its local cache)", model)
    snapshot = _download(model)
    if not os.path.isfile(os.path.join(snapshot, "config.json")):
        found = _default_quant(model)  # a repo of GGUF files
        if found is not None:
            return found
    return check_checkpoint(model, snapshot)


def resolve_tokenizer_path(tokenizer: str) -> str:
    """--tokenizer: a local directory holding tokenizer files, or a hub id whose tokenizer files (no weights) are
    downloaded once; ValueError naming `tokenizer`."""
    path = os.path.expanduser(tokenizer)
    if os.path.isdir(path):
        if not any(glob.glob(os.path.join(path, name)) for name in _TOKENIZER_FILES):
            raise ValueError(f"tokenizer {tokenizer!r} has no tokenizer files ({', '.join(_TOKENIZER_FILES)})")
        return path
    if os.path.exists(path) or not _is_hub_id(tokenizer):
        raise ValueError(f"tokenizer {tokenizer!r}: no such directory (a directory holding the tokenizer files, "
                         f"or a Hugging Face hub id)")
    return _download(tokenizer, _TOKENIZER_HUB_FILES, "tokenizer")


def _is_hub_id(model: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError:
        return False
    return True


def _download(model: str, patterns: list[str] = _HUB_FILES, what: str = "model") -> str:
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(model, allow_patterns=patterns)
    except Exception as e:  # noqa: BLE001 - said in one line
        raise _hub_error(f"{what} {model!r} is not a local directory", e, f"hf download {model}") from None


def _hub_error(what: str, e: BaseException, download: str) -> ValueError:
    """The hub's failure in one line: `what`, then why, with the `hf` command that would fetch the files."""
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RemoteEntryNotFoundError,
                                        RepositoryNotFoundError)

    if isinstance(e, GatedRepoError):
        why = "is gated: accept its terms on huggingface.co, then log in (`hf auth login`)"
    elif isinstance(e, RepositoryNotFoundError):
        why = "has no such repository (or it is private: log in with `hf auth login`)"
    elif isinstance(e, RemoteEntryNotFoundError):
        why = "has no such file in that repository"
    elif isinstance(e, LocalEntryNotFoundError):  # offline (HF_HUB_OFFLINE=1), or the hub unreachable, not cached
        why = (f"cannot be reached and the model is not in the local cache: download it where there is network "
               f"(`{download}`, into the same HF_HOME) or pass a local path")
    else:  # the hub's own words
        why = f"failed: {_one_line(e)}"
    return ValueError(f"{what}, and the Hugging Face hub {why}")


# a GGUF named on the hub as llama.cpp's -hf takes it: REPO:QUANT (Q4_K_M, q8_0, ...), or REPO/PATH/FILE.gguf
_HUB_GGUF = re.compile(r"^(?P<repo>[^/:]+/[^/:]+)(?::(?P<quant>[\w.-]+)|/(?P<file>[^:]+\.gguf))$", re.IGNORECASE)


def hub_gguf(model: str) -> str | None:
    """The local path of the GGUF file (its first piece when split; every piece fetched) that `model` names on the
    Hugging Face hub: REPO:QUANT, the repo's one file of that quant (its name's last part, or its folder, as
    llama.cpp matches it), or REPO/FILE.gguf. Downloaded once into the hub cache, read from it offline
    (HF_HUB_OFFLINE=1). None where `model` is not such a name; ValueError naming it where none or several match."""
    from huggingface_hub import hf_hub_download

    m = _HUB_GGUF.match(model)
    if m is None or not _is_hub_id(m["repo"]):
        return None
    repo, file = m["repo"], m["file"] or _quant_file(model, m["repo"], m["quant"])
    pieces = gguf.split_names(file)
    log.info("model %s: %s from the Hugging Face hub (or its local cache)", model, file)
    try:
        paths = [hf_hub_download(repo, piece) for piece in pieces]
    except Exception as e:  # noqa: BLE001 - said in one line
        raise _hub_error(f"model {model!r} ({repo}: {file}) is not a local file", e,
                         f"hf download {repo} {' '.join(pieces)}") from None
    return paths[0]


def _default_quant(repo: str) -> str | None:
    """A bare hub id whose repo holds GGUF files and no checkpoint: its Q4_K_M file, as llama.cpp's -hf picks
    without a quant, else its only one (logged); None where it holds none; ValueError listing them otherwise."""
    names = _gguf_names(repo, repo)
    if not names:
        return None
    if any(re.search(r"q4_k_m", n, re.IGNORECASE) for n in names):
        log.info("model %s: a repo of GGUF files; serving its Q4_K_M (name another as %s:QUANT)", repo, repo)
        return hub_gguf(f"{repo}:Q4_K_M")
    if len(names) == 1:
        return hub_gguf(f"{repo}/{names[0]}")
    raise ValueError(f"model {repo!r} is a Hugging Face repo of GGUF files, not a checkpoint, and has no Q4_K_M: "
                     f"name one as {repo}:QUANT or {repo}/FILE.gguf (its GGUF files: {', '.join(sorted(names)[:12])})")


def _gguf_names(model: str, repo: str) -> list[str]:
    """The repo's GGUF files (first pieces of split ones), not multimodal projectors (mmproj-*)."""
    return [n for n in _repo_files(model, repo) if n.lower().endswith(".gguf")
            and "mmproj" not in os.path.basename(n).lower() and gguf.split_names(n)[0] == n]


def _quant_file(model: str, repo: str, quant: str) -> str:
    """The repo's GGUF file (first piece) whose name ends in the quant, or that lies in a folder named so; not
    a multimodal projector (mmproj-*)."""
    names = _gguf_names(model, repo)
    tag = re.compile(rf"(^|[-._/]){re.escape(quant)}($|[-./])", re.IGNORECASE)
    found = [n for n in names if tag.search(re.sub(r"(-\d{5}-of-\d{5})?\.gguf$", "", n, flags=re.IGNORECASE))]
    if len(found) != 1:
        held = ", ".join(sorted(names)[:12]) or "none"
        which = f"several match ({', '.join(sorted(found))}): name one as {repo}/FILE.gguf" if found else \
            f"none is of quant {quant} (its GGUF files: {held})"
        raise ValueError(f"model {model!r}: of the GGUF files in the Hugging Face repo {repo}, {which}")
    return found[0]


def _repo_files(model: str, repo: str) -> list[str]:
    """The repo's files: the hub's list, or offline (or the hub unreachable) its cached snapshot's (refs/main)."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import RepositoryNotFoundError
    from huggingface_hub.file_download import repo_folder_name

    if not constants.HF_HUB_OFFLINE:
        try:
            return HfApi().list_repo_files(repo)
        except RepositoryNotFoundError as e:  # gated too
            raise _hub_error(f"model {model!r} is not a local file", e, f"hf download {repo}") from None
        except Exception:  # noqa: BLE001 - unreachable: the cache's copy, as hf_hub_download falls back to it
            pass
    root = os.path.join(constants.HF_HUB_CACHE, repo_folder_name(repo_id=repo, repo_type="model"))
    try:
        with open(os.path.join(root, "refs", "main")) as f:
            snapshot = os.path.join(root, "snapshots", f.read().strip())
    except OSError:
        from huggingface_hub.errors import LocalEntryNotFoundError

        raise _hub_error(f"model {model!r} is not a local file", LocalEntryNotFoundError(repo),
                         f"hf download {repo} --include '*{model.rpartition(':')[2]}*'") from None
    return [os.path.relpath(os.path.join(d, f), snapshot).replace(os.sep, "/")
            for d, _, files in os.walk(snapshot) for f in files]


def check_checkpoint(model: str, path: str) -> str:
    """The directory, if it holds what loading needs (before anything is loaded from it)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model {model!r} has no config.json: {CHECKPOINT_FILES}")
    if not any(glob.glob(os.path.join(path, name)) for name in _TOKENIZER_FILES):
        raise ValueError(f"model {model!r} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}): "
                         f"{CHECKPOINT_FILES}")
    if not glob.glob(os.path.join(path, "*.safetensors")):
        pickles = glob.glob(os.path.join(path, "*.bin")) + glob.glob(os.path.join(path, "*.pt"))
        hint = " (only pickle files found: convert them to safetensors)" if pickles else ""
        raise ValueError(f"model {model!r} has no *.safetensors weights{hint}: {CHECKPOINT_FILES}")
    return path


def _one_line(e: BaseException) -> str:
    """An exception's message on one line (transformers' and the hub's span several)."""
    return " ".join(str(e).split()) or type(e).__name__


# multimodal checkpoints whose language model is served alone (text in, text out), as this text architecture
LANGUAGE_MODEL_OF = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
                     "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
                     "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM"}


def load_hf_config(path: str):
    """The checkpoint's config; a multimodal one's (LANGUAGE_MODEL_OF) is its text model's."""
    from transformers import AutoConfig

    if gguf.is_gguf(path):
        return gguf.load_config(path)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as e:  # config.json that is not JSON, or has no model_type
        raise ValueError(f"cannot load {os.path.join(path, 'config.json')}: {_one_line(e)}") from e
    text = next((LANGUAGE_MODEL_OF[a] for a in getattr(config, "architectures", None) or () if a in LANGUAGE_MODEL_OF),
                None)
    if text is None:
        return config
    config.text_config.architectures = [text]
    return config.text_config


def load_tokenizer(path: str, chat_template: str | None = None):
    """The checkpoint's tokenizer; chat_template (text) replaces its own, so that every door renders with it."""
    from transformers import AutoTokenizer

    try:
        tokenizer = gguf.load_tokenizer(path) if gguf.is_gguf(path) else AutoTokenizer.from_pretrained(
            path, trust_remote_code=False)
    except ValueError:  # a GGUF's, naming the file
        raise
    except Exception as e:  # noqa: BLE001 - no tokenizer files, a library it needs missing, ...
        raise ValueError(f"cannot load the tokenizer in {path} ({_one_line(e)}): {CHECKPOINT_FILES}") from e
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def checkpoint_weights(path: str) -> dict:
    """What a checkpoint's weights are as stored (engine/outputs.py ModelInfo's fields): format "gguf" or
    "safetensors", path, bytes on disk, parameters (as stored: a 4-bit checkpoint's packed words count as
    elements), and quantization: a GGUF's file type as llama.cpp names it where quantized (Q4_K_M, Q8_0, ...),
    a 4-bit checkpoint's method and bits (gptq-int4, awq-int4, compressed-tensors-int4), else ""."""
    if gguf.is_gguf(path):
        files = gguf.split_files(path)
        readers = [gguf.open_reader(f) for f in files]
        kind = gguf.file_type(readers[0])
        return {"weights_format": "gguf", "weights_path": path, "weights_bytes": sum(map(os.path.getsize, files)),
                "num_parameters": sum(int(t.n_elements) for r in readers for t in r.tensors),
                "quantization": "" if kind in ("F32", "F16", "BF16") else kind}
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    count = 0
    for file in files:
        with safe_open(file, framework="pt") as f:
            count += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    qc = int4.quantization_config(path)
    kind = "" if qc is None else f"{qc['quant_method']}-int{qc.get('bits', qc.get('w_bit', 4))}"
    if qc is None and _quant_method(path) == "mxfp4":  # gpt-oss's experts (engine/layers/moe.py GptOssExperts)
        kind = "mxfp4"
    return {"weights_format": "safetensors", "weights_path": path, "weights_bytes": sum(map(os.path.getsize, files)),
            "num_parameters": count, "quantization": kind}


def _quant_method(path: str) -> str | None:
    try:
        with open(os.path.join(path, "config.json")) as f:
            return (json.load(f).get("quantization_config") or {}).get("quant_method")
    except (OSError, ValueError, AttributeError):
        return None


class _Progress:
    """Log lines while the weights are read: what is read, then a line per file when there are several, else
    per PROGRESS_BYTES of the one file's tensors."""

    def __init__(self, files: list[str]):
        self.files, self.total = len(files), sum(os.path.getsize(f) for f in files)
        self.read = self.shown = 0
        log.info("reading the weights: %d safetensors file%s, %.2f GiB", self.files, "s" * (self.files > 1),
                 self.total / 2**30)

    def tensor(self, t: torch.Tensor) -> None:
        self.read += t.numel() * t.element_size()
        if self.files == 1 and self.read - self.shown >= PROGRESS_BYTES:
            self.shown = self.read
            log.info("weights: %.1f of %.1f GiB read", self.read / 2**30, self.total / 2**30)

    def file(self, i: int, file: str) -> None:
        if self.files > 1:
            log.info("weights: file %d of %d read (%s)", i + 1, self.files, os.path.basename(file))


def load_weights(model: torch.nn.Module, path: str, optional: tuple[str, ...] = ()) -> None:
    """The checkpoint's tensors into the model's parameters; only those named with an `optional` prefix may be
    missing."""
    if gguf.is_gguf(path):
        gguf.load_weights(model, path, optional)
    elif (qc := int4.quantization_config(path)) is not None:  # GPTQ / AWQ: 4-bit blocks
        int4.load_weights(model, path, qc, optional)
    else:
        _load_safetensors(model, path, optional)
    trim_heap()


def trim_heap() -> None:
    """Hand the heap's free pages back to the system: glibc keeps what the load's temporary copies freed
    (~160 MiB after a 0.5B Q4_K_M file, resident memory 1.5x the file before, 1.1x after). Linux only."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).malloc_trim(0)
        except AttributeError:  # a libc without it (musl)
            pass


def _load_safetensors(model: torch.nn.Module, path: str, optional: tuple[str, ...]) -> None:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        pickles = glob.glob(os.path.join(path, "*.bin")) + glob.glob(os.path.join(path, "*.pt"))
        hint = " (only pickle files found: convert them to safetensors)" if pickles else ""
        raise ValueError(f"no *.safetensors weights in {path}{hint}")
    params = dict(model.named_parameters())
    missing = set(params)
    transform = getattr(model, "transform", lambda name, t: t)
    progress = _Progress(files)
    for i, file in enumerate(files):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                target = gguf.param_of(model, params, name, os.path.basename(file))
                if target is None:
                    continue
                owner, pname, shard = target
                if hasattr(owner, "load_weight"):  # a layer that places its own pieces (layers/moe.py Experts)
                    progress.tensor(owner.load_weight(f.get_slice(name), pname, shard))
                else:
                    tensor = _read(f, name, model, owner, pname, shard)
                    progress.tensor(tensor)
                    _copy(owner, pname, params[pname], shard, transform(pname, tensor))
                missing.discard(pname)
        progress.file(i, file)
    missing = {name for name in missing if not name.startswith(optional)} if optional else missing
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights for: {', '.join(sorted(missing)[:8])}")


def _read(f, name: str, model, owner, pname: str, shard: int | None) -> torch.Tensor:
    """The part of a checkpoint tensor this rank's parameter holds (all of it without tensor
    parallelism), read alone."""
    parts = getattr(owner, "tp_parts", None)
    if parts is None:
        return f.get_tensor(name)
    is_bias = pname.endswith(".bias")
    if is_bias and owner.tp_dim == 1:  # a row-parallel layer's bias is added once, on rank 0, after the sum
        bias = f.get_tensor(name)
        return bias if owner.tp.rank == 0 else torch.zeros_like(bias)
    dim = 0 if is_bias else owner.tp_dim
    if getattr(model, "stored_transposed", lambda n: False)(pname):  # GPT-2's Conv1D: [in, out]
        dim = 1 - dim
    whole = f.get_slice(name)
    pieces = [whole[a:a + n] if dim == 0 else whole[:, a:a + n] for a, n in parts[shard]]
    return torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0]


@torch.no_grad()
def _copy(owner, pname: str, param: torch.Tensor, shard: int | None, tensor: torch.Tensor) -> None:
    target = param
    if shard is not None:
        target = param.narrow(0, owner.shard_offsets[shard], tensor.shape[0])
    elif getattr(owner, "tp_dim", None) == 0 and tensor.shape[0] < param.shape[0]:
        param.zero_()  # the vocabulary's last rank: its padding rows stay zero
        target = param.narrow(0, 0, tensor.shape[0])
    if target.shape != tensor.shape:
        raise ValueError(f"shape mismatch for {pname}: checkpoint {tuple(tensor.shape)}, model {tuple(target.shape)}")
    target.copy_(tensor)


def free_memory(device: torch.device, meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> int:
    """Bytes free now: a CUDA device's free memory; on CPU the RAM available (MemAvailable), within a
    container's cgroup v2 memory limit."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")  # without /proc/meminfo: MemFree
    try:
        with open(meminfo) as f:
            free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    try:
        with open(f"{cgroup}/memory.max") as m, open(f"{cgroup}/memory.current") as c:
            limit, used = m.read().strip(), int(c.read())
        if limit != "max":
            free = min(free, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return free


def device_of(name: str) -> torch.device:
    """The configured device ("auto": CUDA when torch sees one)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
    return torch.device(name)


def native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX tiles), as torch's own CPU probe
    (cpuinfo) reports it; elsewhere oneDNN would emulate bf16, slower than float32."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def dtype_of(name: str, hf_config, device: torch.device, deterministic: bool = False) -> torch.dtype:
    """The configured dtype. "auto": on CPU bfloat16 where the CPU has native bf16 (native_bf16),
    else float32, and float32 in deterministic mode (the same output on every machine); on CUDA the
    checkpoint's bf16/fp16."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.bfloat16 if native_bf16() and not deterministic else torch.float32
    ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    ckpt = _DTYPES.get(str(ckpt).removeprefix("torch."), None) if ckpt is not None else None
    return ckpt if ckpt in (torch.bfloat16, torch.float16) else torch.bfloat16

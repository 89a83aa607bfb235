"""The served models as Ollama describes them (/api/tags, /api/show, /api/ps): each served name and
LoRA adapter as NAME:latest, its size and parameter count (the base model's weights as the engine read
them, GGUF or safetensors; an adapter's from its safetensors files), its details (a GGUF's file type as
the quantization level) and capabilities."""
from __future__ import annotations

import functools
import glob
import hashlib
import json
import math
import os
import struct
import time
from datetime import datetime, timezone

from pagoda.server.chat.reasoning import reasoning_for
from pagoda.server.chat.tools import tool_format
from pagoda.server.ollama.protocol import template_text

_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}  # as Ollama names unquantized weights
FAR_FUTURE = "2318-01-01T00:00:00Z"  # when a model loaded here expires: never (it stays while the server runs)


def tagged(name: str) -> str:
    """A served name as Ollama lists it: with a tag (":latest" when it has none)."""
    return name if ":" in name.rsplit("/", 1)[-1] else name + ":latest"


def resolve(name: str, names: list[str]) -> str:
    """The served name (or adapter) a request means: NAME:latest is NAME."""
    if name in names or not name.endswith(":latest"):
        return name
    base = name.removesuffix(":latest")
    return base if base in names else name


def served(state, engine) -> list[tuple[str, str | None]]:
    """(name, the base model's name for a LoRA adapter, else None) of every model a request may name."""
    names = state.served_model_names()
    return [(n, None) for n in names] + [(a, names[0]) for a in sorted(engine.adapters)]


def entry(engine, name: str, parent: str | None) -> dict:
    """A model as /api/tags lists it."""
    size, _ = _stored(engine, name)
    return {"name": tagged(name), "model": tagged(name), "modified_at": _loaded_at(engine), "size": size,
            "digest": _digest(engine, name), "details": details(engine, name, parent)}


def running(engine, name: str, parent: str | None) -> dict:
    """A model as /api/ps lists it: loaded, for as long as the server runs."""
    item = entry(engine, name, parent)
    item.pop("modified_at")
    return {**item, "expires_at": FAR_FUTURE, "size_vram": item["size"],
            "context_length": engine.model_info.max_model_len}


def show(engine, state, name: str, parent: str | None) -> dict:
    """/api/show's answer."""
    info = engine.model_info
    arch = family(info.architecture)
    modelfile = f"# served by pagoda\nFROM {info.model_id}\n"
    if parent is not None:
        modelfile += f"ADAPTER {engine.adapters[name].path}\n"
    return {"license": "", "modelfile": modelfile + f"PARAMETER num_ctx {info.max_model_len}\n",
            "parameters": f"num_ctx {info.max_model_len}", "template": template_text(engine.tokenizer),
            "details": details(engine, name, parent),
            "model_info": {"general.architecture": arch, "general.parameter_count": info.num_parameters,
                           f"{arch}.context_length": info.max_model_len, f"{arch}.vocab_size": info.vocab_size},
            "capabilities": capabilities(engine, state), "modified_at": _loaded_at(engine)}


def capabilities(engine, state) -> list[str]:
    """What the chat template can do: tools when it renders them, thinking when it writes <think>."""
    caps = ["completion"]
    try:
        tool_format(engine.tokenizer, state.options.tool_call_parser)
        caps.append("tools")
    except ValueError:  # InvalidRequestError: the template renders no tools
        pass
    if reasoning_for(engine.tokenizer, [], state.options.reasoning_parser) is not None:
        caps.append("thinking")
    return caps


def details(engine, name: str, parent: str | None) -> dict:
    info = engine.model_info
    arch = family(info.architecture)
    return {"parent_model": parent or "", "format": info.weights_format, "family": arch, "families": [arch],
            "parameter_size": _human(info.num_parameters),
            "quantization_level": info.quantization.upper() or _DTYPES.get(info.dtype, info.dtype.upper())}


def family(architecture: str) -> str:
    """Ollama's architecture name from Hugging Face's class name: Qwen3ForCausalLM -> qwen3."""
    return architecture.removesuffix("ForCausalLM").lower() or "unknown"


def _stored(engine, name: str) -> tuple[int, int]:
    """(bytes, parameters) of an adapter's safetensors files, else of the base model's weights."""
    adapter = engine.adapters.get(name)
    if adapter is not None:
        return _weights(adapter.path)
    return engine.model_info.weights_bytes, engine.model_info.num_parameters


@functools.lru_cache(maxsize=32)
def _weights(model: str) -> tuple[int, int]:
    """(bytes, parameters) of a checkpoint's safetensors files; (0, 0) where they cannot be found."""
    path = _local(model)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors"))) if path else []
    try:
        return sum(os.path.getsize(f) for f in files), sum(_num_parameters(f) for f in files)
    except (OSError, ValueError, KeyError):
        return 0, 0


def _local(model: str) -> str | None:
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        return path
    try:  # a hub id: its snapshot in the local cache, never downloaded here
        from huggingface_hub import snapshot_download
        return snapshot_download(model, local_files_only=True)
    except Exception:  # noqa: BLE001 - not there: no size to report
        return None


def _num_parameters(file: str) -> int:
    """The parameters a safetensors file holds, from its header (the tensors are not read)."""
    with open(file, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    return sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")


def _human(count: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f}{unit}"
    return str(count)


def _digest(engine, name: str) -> str:
    adapter = engine.adapters.get(name)
    key = f"{engine.model_info.model_id}\0{name}\0{adapter.path if adapter else ''}\0{adapter.uid if adapter else 0}"
    return hashlib.sha256(key.encode()).hexdigest()


def _loaded_at(engine) -> str:
    loaded = time.time() - engine.stats().uptime_s
    return datetime.fromtimestamp(loaded, timezone.utc).isoformat().replace("+00:00", "Z")

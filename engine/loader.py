"""Checkpoints in Hugging Face format: config and tokenizer through transformers, weights from
safetensors (sharded or not). Pickle checkpoints are refused and no remote code runs. Under tensor
parallelism each rank reads only the rows or columns its layers hold (engine/parallel.py)."""
import glob
import os

import torch
from safetensors import safe_open

_HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]


def resolve_model_path(model: str) -> str:
    """A local directory as is; anything else is a hub id, downloaded (safetensors only) once."""
    if os.path.isdir(model):
        return model
    if os.path.exists(model):
        raise ValueError(f"model must be a checkpoint directory or a hub id, got the file {model!r}")
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(model, allow_patterns=_HUB_FILES)
    except Exception as e:
        raise ValueError(f"model {model!r} is neither a local directory nor a reachable hub id: {e}") from e


def load_hf_config(path: str):
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(path, trust_remote_code=False)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path, trust_remote_code=False)


def load_weights(model: torch.nn.Module, path: str) -> None:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        pickles = glob.glob(os.path.join(path, "*.bin")) + glob.glob(os.path.join(path, "*.pt"))
        hint = " (only pickle files found: convert them to safetensors)" if pickles else ""
        raise ValueError(f"no *.safetensors weights in {path}{hint}")
    params = dict(model.named_parameters())
    missing = set(params)
    transform = getattr(model, "transform", lambda name, t: t)
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                mapped = model.checkpoint_name(name)
                if mapped is None:
                    continue
                pname, shard = mapped
                if pname not in params:
                    raise ValueError(f"unexpected tensor {name!r} in {os.path.basename(file)}")
                owner = model.get_submodule(pname.rsplit(".", 1)[0])
                _copy(owner, pname, params[pname], shard, transform(pname, _read(f, name, model, owner, pname, shard)))
                missing.discard(pname)
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

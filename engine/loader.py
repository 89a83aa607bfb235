"""Checkpoints in Hugging Face format: config and tokenizer through transformers, weights from
safetensors (sharded or not). Pickle checkpoints are refused and no remote code runs."""
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
                _copy(model, pname, params[pname], shard, transform(pname, f.get_tensor(name)))
                missing.discard(pname)
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights for: {', '.join(sorted(missing)[:8])}")


@torch.no_grad()
def _copy(model, pname: str, param: torch.Tensor, shard: int | None, tensor: torch.Tensor) -> None:
    target = param
    if shard is not None:
        offset = model.get_submodule(pname.rsplit(".", 1)[0]).shard_offsets[shard]
        target = param.narrow(0, offset, tensor.shape[0])
    if target.shape != tensor.shape:
        raise ValueError(f"shape mismatch for {pname}: checkpoint {tuple(tensor.shape)}, model {tuple(target.shape)}")
    target.copy_(tensor)

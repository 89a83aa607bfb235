"""Rotary position embeddings, with inverse frequencies computed the way transformers does."""
from dataclasses import dataclass

import torch
from torch import nn


def rope_parameters(hf_config) -> dict:
    """The checkpoint's RoPE settings, from transformers 5's rope_parameters or 4.x's fields."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        return dict(params)
    scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    scaling["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    return scaling


def inverse_frequencies(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = rope_parameters(hf_config)
    rope_type = params.get("rope_type", "default")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("rope_parameters.partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    if rope_type == "dynamic":
        raise ValueError("rope_scaling type 'dynamic' is not supported (its frequencies change with length)")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


@dataclass
class RopeInputs:
    """What apply_rotary needs for one step's positions, computed once and shared by all layers."""
    cos: torch.Tensor  # [num_tokens, 1, head_dim] in the model's dtype; fused: the [max_position, head_dim] table
    sin: torch.Tensor
    positions: torch.Tensor | None = None  # fused only: [num_tokens] int64, the op indexes the tables
    fused_ops: object = None  # pagoda's CPU ops module, when bound


class RotaryEmbedding(nn.Module):
    """Neox-style rotation (first half with second half), cos/sin tabled for every position."""
    fused_ops = None  # pagoda's CPU ops, bound by the model runner (float32 and bfloat16 models on CPU)

    def __init__(self, hf_config, head_dim: int, max_position: int):
        super().__init__()
        inv_freq, scaling = inverse_frequencies(hf_config, head_dim)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, head_dim]
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(self, positions, dtype) -> RopeInputs:
        # positions: [num_tokens]
        if self.fused_ops is not None:
            return RopeInputs(self.cos, self.sin, positions, self.fused_ops)
        return RopeInputs(self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :])


def apply_rotary(q, k, rope: RopeInputs):
    # q: [num_tokens, num_heads, head_dim]; k: [num_tokens, num_kv_heads, head_dim]
    if rope.fused_ops is not None:
        rope.fused_ops.rotary_(q, k, rope.positions, rope.cos, rope.sin)  # in place
        return q, k
    return q * rope.cos + _rotate_half(q) * rope.sin, k * rope.cos + _rotate_half(k) * rope.sin


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)

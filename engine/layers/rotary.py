"""Rotary position embeddings, with inverse frequencies computed the way transformers does."""
from dataclasses import dataclass

import torch
from torch import nn


def rope_parameters(hf_config, layer_type: str | None = None) -> dict:
    """The checkpoint's RoPE settings, from transformers 5's rope_parameters (per layer type where the config
    gives one set a type: Gemma 3's local and global) or 4.x's fields."""
    params = getattr(hf_config, "rope_parameters", None)
    layer_type = _per_type(hf_config, layer_type)
    if layer_type is not None:
        return dict(params[layer_type])
    if params:
        return dict(params)
    scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    scaling["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    return scaling


def _per_type(hf_config, layer_type: str | None) -> str | None:
    """The layer type whose RoPE settings apply where the config gives one set a type (full layers' by
    default); None where it gives one for all."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return (layer_type or "full_attention") if isinstance(params.get(layer_type or "full_attention"), dict) else None


def rotary_dim(hf_config, head_dim: int, layer_type: str | None = None) -> int:
    """The dimensions of each head that rotate (the first ones): all, or partial_rotary_factor of them (Phi-4-mini)."""
    factor = rope_parameters(hf_config, layer_type).get("partial_rotary_factor")
    if factor is None:
        factor = getattr(hf_config, "partial_rotary_factor", None) or 1.0
    if not 0 < factor <= 1:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {factor!r}")
    return int(head_dim * factor)


def inverse_frequencies(hf_config, head_dim: int, layer_type: str | None = None,
                        seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    params = rope_parameters(hf_config, layer_type)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        dim = rotary_dim(hf_config, head_dim, layer_type)
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    # dynamic NTK's frequencies change only past max_position_embeddings, which the context never is
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    layer_type = _per_type(hf_config, layer_type)
    if rope_type not in ROPE_INIT_FUNCTIONS:
        field = "rope_parameters" + (f".{layer_type}" if layer_type else "") + ".rope_type"
        raise ValueError(f"{field} {rope_type!r} is not a RoPE type this server runs (one of "
                         f"default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))})")
    kw = {} if layer_type is None else {"layer_type": layer_type}
    if seq_len is not None:
        kw["seq_len"] = seq_len
    here = torch.empty(0).device  # the default device: meta where a model is only being checked (LoRA targets)
    with torch.device("cpu"):  # transformers makes its arange on the default device, then moves it
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **kw)
    return inv_freq.float().to(here), float(scaling)


@dataclass
class RopeInputs:
    """What apply_rotary needs for one step's positions, computed once and shared by all layers."""
    cos: torch.Tensor  # [num_tokens, 1, head_dim] in the model's dtype; fused: the [max_position, head_dim] table
    sin: torch.Tensor
    positions: torch.Tensor | None = None  # fused only: [num_tokens] int64, the op indexes the tables
    fused_ops: object = None  # pagoda's CPU ops module, when bound


def long_rope_from(hf_config, max_position: int) -> int | None:
    """LongRoPE (Phi-3.5, Phi-4-mini): the length past which a sequence's tokens rotate by the long factors,
    or None (another RoPE type, or a context that never gets there)."""
    params = rope_parameters(hf_config)
    original = params.get("original_max_position_embeddings") or getattr(
        hf_config, "original_max_position_embeddings", None)
    if params.get("rope_type") != "longrope" or not original or original >= max_position:
        return None
    return original


class RotaryEmbedding(nn.Module):
    """Neox-style rotation (first half with second half) of each head's first rotary_dim dimensions,
    cos/sin tabled for every position. LongRoPE tables the long factors' rotations after the short ones'
    (a position p + max_position reads them): the model runner offsets the tokens of a sequence longer
    than long_from, as transformers rotates a forward pass whose positions reach past it."""
    fused_ops = None  # pagoda's CPU ops, bound by the model runner (float32 and bfloat16 models on CPU)

    def __init__(self, hf_config, head_dim: int, max_position: int, layer_type: str | None = None):
        super().__init__()
        self.rotary_dim, self.head_dim = rotary_dim(hf_config, head_dim, layer_type), head_dim
        self.long_from = None if layer_type is not None else long_rope_from(hf_config, max_position)
        self._table_args = (hf_config, head_dim, max_position, layer_type)
        # built on the meta device, the model is tabled once given memory (reset_tables; arange on meta imports sympy)
        if torch.empty(0).device.type == "meta":
            cos = sin = torch.empty(max_position * (1 if self.long_from is None else 2), self.rotary_dim)
        else:
            cos, sin = self._tables(*self._table_args)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, hf_config, head_dim: int, max_position: int, layer_type: str | None):
        inv_freq, scaling = inverse_frequencies(hf_config, head_dim, layer_type)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        if self.long_from is not None:
            long_freq, _ = inverse_frequencies(hf_config, head_dim, seq_len=self.long_from + 1)
            freqs = torch.cat((freqs, torch.arange(max_position, dtype=torch.float32)[:, None] * long_freq[None, :]))
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_position (x2 with LongRoPE), rotary_dim]
        return emb.cos() * scaling, emb.sin() * scaling

    @torch.no_grad()
    def reset_tables(self) -> None:
        """The tables computed where they are, in their dtype: a model built on the meta device has none until
        given memory (engine/executor/model_runner.py _load_model)."""
        with torch.device(self.cos.device):
            cos, sin = self._tables(*self._table_args)
        self.cos, self.sin = cos.to(self.cos.dtype), sin.to(self.sin.dtype)

    def forward(self, positions, dtype) -> RopeInputs:
        # positions: [num_tokens]
        if self.fused_ops is not None and self.rotary_dim == self.head_dim:  # the op rotates whole heads
            return RopeInputs(self.cos, self.sin, positions, self.fused_ops)
        return RopeInputs(self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :])


def apply_rotary(q, k, rope: RopeInputs):
    # q: [num_tokens, num_heads, head_dim]; k: [num_tokens, num_kv_heads, head_dim]
    if rope.fused_ops is not None:
        rope.fused_ops.rotary_(q, k, rope.positions, rope.cos, rope.sin)  # in place
        return q, k
    n = rope.cos.shape[-1]
    if n < q.shape[-1]:  # partial: the rest of each head passes unrotated
        return (torch.cat((_rotate(q[..., :n], rope), q[..., n:]), dim=-1),
                torch.cat((_rotate(k[..., :n], rope), k[..., n:]), dim=-1))
    return _rotate(q, rope), _rotate(k, rope)


def _rotate(x, rope: RopeInputs):
    return x * rope.cos + _rotate_half(x) * rope.sin


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)

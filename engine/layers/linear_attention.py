"""The gated DeltaNet layer ("linear attention": Qwen3.5, Qwen3-Next) and its state.

Each sequence's state lives in a slot (engine/core/block_manager.py gives a running sequence one): per layer
the conv1d's last kernel - 1 inputs [conv_dim, kernel - 1] in the model's dtype, and the recurrent state
[num_v_heads, head_k_dim, head_v_dim] in float32 (as transformers keeps it). The model runner allocates
them (StateCache); a layer clears a slot when its sequence starts (or restarts after a preemption)."""
from math import prod

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.engine.executor import parallel
from pagoda.engine.layers.delta_rule import causal_conv1d, gated_delta_rule


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's output, then times SiLU of the gate z."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, z):
        # x, z: [num_tokens, heads, dim]
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x.to(dtype) * F.silu(z.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """q/k/v/z/b/a projections (q, k, v and z in one GEMM, b and a in another), a causal depthwise conv1d over
    q, k and v, the gated delta rule (decay g from A_log and dt_bias, strength beta), the gated RMSNorm."""

    def __init__(self, cfg):
        super().__init__()
        # this rank's share of the heads (all of them without tensor parallelism), each value head with its key head
        g = parallel.group()
        hidden, self.kernel = cfg.hidden_size, cfg.linear_conv_kernel_dim
        self.num_k_heads = parallel.split(cfg.linear_num_key_heads, "linear_num_key_heads")
        self.num_v_heads = hv = parallel.split(cfg.linear_num_value_heads, "linear_num_value_heads")
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        key, value = self.num_k_heads * self.head_k_dim, hv * self.head_v_dim
        self.sizes = (key, key, value)
        self.conv_dim = 2 * key + value
        # q, k and v rows of this rank's heads, in the checkpoint's q | k | v layout
        qkv = [(g.rank * key, key), (g.size * key + g.rank * key, key), (2 * g.size * key + g.rank * value, value)]
        # checkpoints store q/k/v and z as two tensors (Qwen3.5) or one grouped per key head (Qwen3-Next: this
        # rank's key heads read whole, reordered at load by the model's transform)
        per_head = self.conv_dim // self.num_k_heads + value // self.num_k_heads
        self.in_proj_qkvz = parallel.column_parallel(hidden, self.conv_dim + value, False,
                                                     pieces={0: qkv, 1: [(g.rank * value, value)]})
        self.in_proj_qkvz.shard_offsets = (0, self.conv_dim)
        self.in_proj_qkvz.tp_parts[None] = [(g.rank * self.num_k_heads * per_head, self.num_k_heads * per_head)]
        heads = (g.rank * hv, hv)
        self.in_proj_ba = parallel.column_parallel(hidden, 2 * hv, False, pieces={0: [heads], 1: [heads]})
        self.in_proj_ba.shard_offsets = (0, hv)
        self.in_proj_ba.tp_parts[None] = [(g.rank * 2 * hv, 2 * hv)]
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.conv1d.tp_dim, self.conv1d.tp_parts = 0, {None: qkv}
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.tp_dim, self.tp_parts = 0, {None: [heads]}  # dt_bias and A_log
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = parallel.RowParallelLinear(cfg.linear_num_value_heads * self.head_v_dim, hidden, bias=False)
        self.conv_state = self.ssm_state = torch.empty(0)  # bound by the model runner (StateCache)

    def forward(self, x, meta):
        # x: [num_tokens, hidden]; meta: AttentionMetadata with the step's state_slots and query_start_loc
        if meta.state_resets is not None:  # the slots of sequences starting from their first token
            self.conv_state.index_fill_(0, meta.state_resets, 0)
            self.ssm_state.index_fill_(0, meta.state_resets, 0)
        qkv, z = self.in_proj_qkvz(x).split([self.conv_dim, self.num_v_heads * self.head_v_dim], dim=-1)
        b, a = self.in_proj_ba(x).split(self.num_v_heads, dim=-1)
        qkv = causal_conv1d(qkv, self.conv1d.weight[:, 0], self.conv_state, meta.query_start_loc, meta.state_slots)
        q, k, v = qkv.split(self.sizes, dim=-1)
        q = q.reshape(-1, self.num_k_heads, self.head_k_dim)  # [num_tokens, num_k_heads, head_k_dim]
        k = k.reshape(-1, self.num_k_heads, self.head_k_dim)
        v = v.reshape(-1, self.num_v_heads, self.head_v_dim)  # [num_tokens, num_v_heads, head_v_dim]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [num_tokens, num_v_heads]
        out = gated_delta_rule(q, k, v, g, b.sigmoid(), self.ssm_state, meta.query_start_loc, meta.state_slots)
        out = self.norm(out, z.reshape(-1, self.num_v_heads, self.head_v_dim))
        return self.out_proj(out.flatten(1))

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One slot's conv state and recurrent state."""
        return (self.conv_dim, self.kernel - 1), (self.num_v_heads, self.head_k_dim, self.head_v_dim)


class StateCache:
    """Every linear-attention layer's states for num_slots sequences: conv states in the model's dtype,
    recurrent states in float32."""

    def __init__(self, layers: list[GatedDeltaNet], num_slots: int, dtype: torch.dtype, device: torch.device):
        for m in layers:
            conv, ssm = m.state_shapes()
            m.conv_state = torch.zeros(num_slots, *conv, dtype=dtype, device=device)
            m.ssm_state = torch.zeros(num_slots, *ssm, dtype=torch.float32, device=device)

    @staticmethod
    def bytes_per_slot(layers: list[GatedDeltaNet], dtype: torch.dtype) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        return sum(size * prod(conv) + 4 * prod(ssm) for conv, ssm in (m.state_shapes() for m in layers))

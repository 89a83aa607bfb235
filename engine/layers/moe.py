"""Mixture-of-experts layers (Mixtral, Qwen2-MoE, Qwen3-MoE; gpt-oss's variants): the router, the experts and
the sparse block.

The router is transformers' own: softmax over every expert in float32, then torch.topk on those
probabilities (so ties fall as they do there), renormalised where the config says. The experts hold
every expert's fused gate/up weight [E, 2I, H] and down weight [E, H, I], stored k-major (each expert's
W^T contiguous: the CPU op's layout, and a plain GEMM for torch). On CPU with pagoda's ops bound the
experts run as one op (csrc/moe_cpu.cpp: tokens grouped by expert, each expert's weights read once a
step; each row's result its own, so deterministic mode runs them); elsewhere a loop over the experts that
got tokens, which is also the op's reference.
Under tensor parallelism each expert's intermediate size is split like a dense MLP's (the router is
replicated) and the partial outputs are summed once.
Each block counts the tokens it routes to each expert into a row of the model's ExpertLoad (on the driver
rank), on the device and in place: operators read it to size the model."""
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagoda.engine.executor import parallel
from pagoda.engine.layers.activation import activation


def num_experts(cfg) -> int:
    return getattr(cfg, "num_experts", None) or cfg.num_local_experts


def expert_intermediate_size(cfg) -> int:
    return getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size


class ReplicatedLinear(nn.Module):
    """A small linear layer every rank holds whole and no quantization, packing or adapter touches (a router,
    a shared expert's gate). Its weight is stored k-major: with pagoda's CPU ops bound, the few-row op takes
    every call, whose rows are each computed alone (deterministic mode needs that of the routing)."""
    fused_ops = None  # pagoda's CPU ops, bound by the model runner where they are built

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features).t())
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x):
        # x: [num_tokens, in] -> [num_tokens, out]
        if self.fused_ops is not None:
            return self.fused_ops.ops().linear_few_rows(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class Router(ReplicatedLinear):
    """Top-k routing as transformers' TopKRouter (Mixtral, Qwen2-MoE, Qwen3-MoE)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool, round_weights: bool):
        super().__init__(hidden, num_experts)
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.round_weights = round_weights  # Qwen rounds the weights to the model's dtype; Mixtral keeps float32

    def forward(self, x):
        # x: [num_tokens, hidden] -> weights [num_tokens, top_k] float32, ids [num_tokens, top_k] int64
        logits = super().forward(x)  # [num_tokens, num_experts]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        if self.round_weights:
            weights = weights.to(x.dtype).float()
        return weights, ids


def _k_major(*shape: int) -> torch.Tensor:
    """An [E, out, in] tensor with each expert's [in, out] transpose contiguous."""
    e, out, inp = shape
    return torch.empty(e, inp, out).transpose(1, 2)


class Experts(nn.Module):
    """Every expert's SwiGLU MLP; this rank's share of each expert's intermediate size."""
    fused_ops = None  # pagoda's CPU ops, bound by the model runner where they are built

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str | None):
        super().__init__()
        self.num_experts, self.full_intermediate = num_experts, intermediate
        self.intermediate_size = n = parallel.split(intermediate, "the experts' intermediate size")
        self.gate_up_proj = nn.Parameter(_k_major(num_experts, 2 * n, hidden))  # [E, 2I, H]
        self.down_proj = nn.Parameter(_k_major(num_experts, hidden, n))  # [E, H, I]
        self.act, self.is_silu = activation(act) if act else None, act == "silu"  # None: the subclass's act_mul
        self.gate_up_proj_bias = self.down_proj_bias = None  # gpt-oss has them
        self.tp = parallel.group()

    def act_mul(self, gate, up):
        return self.act(gate) * up

    def forward(self, x, weights, ids):
        # x: [num_tokens, hidden]; weights, ids: [num_tokens, top_k] -> [num_tokens, hidden]
        out = torch.zeros_like(x)
        if self.fused_ops is not None and self.is_silu:
            self.fused_ops.moe_experts_(out, x, self.gate_up_proj, self.down_proj, weights, ids)
        else:
            self.loop_(out, x, weights, ids)
        return parallel.all_reduce(out, self.tp)

    def loop_(self, out, x, weights, ids, ops=None):
        """out += each token's routing-weighted expert outputs, expert by expert (ascending): the torch path,
        and with `ops` (engine/layers/cpu_ops.py: its linear and SiLU-and-mul) the CPU op's exact reference."""
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        w = weights.flatten()
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            pairs = order[start:start + c]
            start += c
            tokens = pairs // ids.shape[1]
            if ops is None:
                gate_up = x[tokens] @ self.gate_up_proj[e].t()  # [c, 2I]
                if self.gate_up_proj_bias is not None:
                    gate_up = gate_up + self.gate_up_proj_bias[e]
                h = self.act_mul(*gate_up.chunk(2, dim=-1)) @ self.down_proj[e].t()  # [c, hidden]
                if self.down_proj_bias is not None:
                    h = h + self.down_proj_bias[e]
            else:
                h = ops.linear(ops.silu_and_mul(ops.linear(x[tokens], self.gate_up_proj[e], None)), self.down_proj[e],
                               None)
            out.index_add_(0, tokens, (h * w[pairs, None]).to(out.dtype))
        return out

    @torch.no_grad()
    def load_weight(self, whole, pname: str, shard) -> torch.Tensor:
        """Place a checkpoint tensor (a safetensors slice): one expert's gate, up or down projection (shard:
        (expert, 0 gate / 1 up / 2 down)), or every expert's fused [E, 2I, H] / [E, H, I] (shard None);
        this rank's rows or columns of it. Returns what was read."""
        n, full = self.intermediate_size, self.full_intermediate
        a = self.tp.rank * n
        if shard is None and pname.endswith("gate_up_proj"):
            t, target = torch.cat([whole[:, a:a + n], whole[:, full + a:full + a + n]], dim=1), self.gate_up_proj
        elif shard is None:
            t, target = whole[:, :, a:a + n], self.down_proj
        elif shard[1] == 2:
            t, target = whole[:, a:a + n], self.down_proj[shard[0]]
        else:
            e, piece = shard
            t, target = whole[a:a + n], self.gate_up_proj[e, piece * n:(piece + 1) * n]
        if target.shape != t.shape:
            raise ValueError(f"shape mismatch for {pname}{'' if shard is None else f' (expert {shard[0]})'}: "
                             f"checkpoint {tuple(t.shape)}, model {tuple(target.shape)}")
        target.copy_(t)
        return t


class GptOssRouter(ReplicatedLinear):
    """gpt-oss: top-k of the logits (router bias included), softmax over those k only."""

    def __init__(self, hidden: int, num_experts: int, top_k: int):
        super().__init__(hidden, num_experts, bias=True)
        self.top_k = top_k

    def forward(self, x):
        # x: [num_tokens, hidden] -> weights [num_tokens, top_k] float32, ids [num_tokens, top_k] int64
        top, ids = torch.topk(super().forward(x), self.top_k, dim=-1)
        return torch.softmax(top, dim=1, dtype=top.dtype).float(), ids


class GptOssExperts(Experts):
    """gpt-oss's experts: biases on both projections and the clamped SwiGLU ((up + 1) * gate * sigmoid(alpha *
    gate), gate clamped above and up on both sides at swiglu_limit). Stored gate | up like Experts (the
    checkpoint interleaves them: [E, H, 2I], gate in the even columns); the torch loop computes them (the CPU
    op has no biases or clamps yet)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, limit: float, alpha: float):
        super().__init__(num_experts, hidden, intermediate, None)
        n = self.intermediate_size
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * n))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))  # rank 0's; zeros elsewhere
        self.limit, self.alpha = limit, alpha

    def act_mul(self, gate, up):
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, x, weights, ids):
        return parallel.all_reduce(self.loop_(torch.zeros_like(x), x, weights, ids), self.tp)

    @torch.no_grad()
    def load_weight(self, whole, pname: str, shard) -> torch.Tensor:
        """The checkpoint's fused tensors: gate_up_proj [E, H, 2I] and its bias [E, 2I] (gate | up
        interleaved), down_proj [E, I, H] and its bias [E, H]; this rank's share."""
        n = self.intermediate_size
        a = self.tp.rank * n
        if pname.endswith(("gate_up_proj", "gate_up_proj_bias")):
            t = whole[..., 2 * a:2 * (a + n)]
            t = torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)  # [..., 2n]: gate | up
            target = self.gate_up_proj.transpose(1, 2) if pname.endswith("proj") else self.gate_up_proj_bias
        elif pname.endswith("down_proj"):
            t, target = whole[:, a:a + n], self.down_proj.transpose(1, 2)
        else:
            t, target = whole[:], self.down_proj_bias
            if self.tp.rank:
                t = torch.zeros_like(t)
        if target.shape != t.shape:
            raise ValueError(f"shape mismatch for {pname}: checkpoint {tuple(t.shape)}, model {tuple(target.shape)}")
        target.copy_(t)
        return t


def sigmoid_rows(g):
    # g: [n, 1] -> sigmoid(g), each row's value whatever n: padded to a multiple of 64 elements, every element
    # takes torch's vector code (it computes a tensor's last few elements in scalar code, which rounds otherwise;
    # one thread below torch's grain of 32768 elements, more than a step's rows)
    n = g.shape[0]
    return torch.sigmoid(F.pad(g.reshape(-1), (0, -n % 64)))[:n].view(n, 1)


class MoeBlock(nn.Module):
    """A mixture-of-experts MLP (a router and its experts), which counts what it routes where ExpertLoad gave it
    a counter."""
    expert_load: torch.Tensor | None = None  # [num_experts] int64, this layer's row of ExpertLoad.counts

    def count_(self, ids, meta) -> None:
        # ids: [num_tokens, top_k] -> expert_load += tokens per expert. On CUDA a graph's padding rows (slot -1)
        # add 0; CPU batches have no padding rows, and a block called without meta counts every row.
        if self.expert_load is None:
            return
        flat = ids.flatten()
        if meta is not None and ids.is_cuda:
            ones = (meta.slot_mapping >= 0)[:, None].expand_as(ids).flatten().long()
        else:
            ones = torch.ones_like(flat)
        self.expert_load.index_add_(0, flat, ones)


class ExpertLoad:
    """Tokens each MoE layer routed to each expert since start (a token counts once for each of its top_k
    experts; recomputed tokens of a preempted sequence and rejected speculative rows count too): counts
    [num_moe_layers, num_experts] int64 on the model's device, added to by the blocks in the step, with no sync.
    read() gives them to the host between steps: on CPU a copy; on CUDA the copy that copy_to_host enqueued
    after the latest step, once it has landed (until then the one before: never waiting on the device)."""

    def __init__(self, model: nn.Module, device: torch.device):
        blocks = [(i, layer.mlp) for i, layer in enumerate(getattr(model, "layers", ()))
                  if isinstance(getattr(layer, "mlp", None), MoeBlock)]
        self.layers = tuple(i for i, _ in blocks)  # their indices among the decoder layers
        e = max((b.experts.num_experts for _, b in blocks), default=0)
        self.counts = torch.zeros(len(blocks), e, dtype=torch.int64, device=device)
        for row, (_, block) in zip(self.counts, blocks):
            block.expert_load = row[:block.experts.num_experts]
        self.on_cuda = device.type == "cuda"
        self.host = torch.zeros_like(self.counts, device="cpu").pin_memory() if self.on_cuda else self.counts
        self.copied = None  # CUDA: the event after the latest copy into `host`
        self.snapshot = np.zeros(tuple(self.counts.shape), dtype=np.int64)

    @torch.inference_mode()  # whichever mode made the counts, a change in this one is allowed
    def reset(self) -> None:
        """Forget what warm-up (and graph capture) routed."""
        self.counts.zero_()

    def copy_to_host(self) -> None:
        if self.on_cuda:
            self.host.copy_(self.counts, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()

    def read(self) -> np.ndarray:
        # -> [num_moe_layers, num_experts] int64, a copy the engine never writes again
        if not self.on_cuda:
            return self.counts.numpy().copy()
        if self.copied is not None and self.copied.query():
            self.snapshot, self.copied = self.host.numpy().copy(), None
        return self.snapshot


class SparseMoeBlock(MoeBlock):
    """The router and the experts; Qwen2-MoE's shared expert beside them behind a sigmoid gate."""

    def __init__(self, cfg, norm_topk_prob: bool, round_weights: bool, shared_expert: nn.Module | None = None):
        super().__init__()
        e = num_experts(cfg)
        self.gate = Router(cfg.hidden_size, e, cfg.num_experts_per_tok, norm_topk_prob, round_weights)
        self.experts = Experts(e, cfg.hidden_size, expert_intermediate_size(cfg), cfg.hidden_act)
        self.shared_expert = shared_expert
        if shared_expert is not None:
            self.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1)

    def forward(self, x, meta=None):
        # x: [num_tokens, hidden] -> [num_tokens, hidden]; meta: the step's AttentionMetadata (its padding rows)
        weights, ids = self.gate(x)
        self.count_(ids, meta)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + sigmoid_rows(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

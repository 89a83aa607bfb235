"""Mixture-of-experts layers (Mixtral, Qwen2-MoE, Qwen3-MoE; gpt-oss's variants): the router, the experts and
the sparse block.

The router is transformers' own: softmax over every expert in float32, then torch.topk on those
probabilities (so ties fall as they do there), renormalised where the config says. The experts hold
every expert's fused gate/up weight [E, 2I, H] and down weight [E, H, I], stored k-major (each expert's
W^T contiguous: the CPU op's layout, and a plain GEMM for torch). On CPU with pagoda's ops bound the
experts run as one op (csrc/moe_cpu.cpp: tokens grouped by expert, each expert's weights read once a
step; each row's result its own, so deterministic mode runs them); on CUDA as two Triton grouped GEMMs
(engine/layers/triton_moe.py: gate/up fused with the activation, then down weighted by the router);
elsewhere a loop over the experts that got tokens, which is also the op's and the kernels' reference.
Quantized experts stay quantized in memory, row-major, and the op dequantizes them in registers: int8 with a
scale per output row (`--quantization int8`, quantize_int8_), and gpt-oss's MXFP4 as its checkpoints ship it
(blocks of 32 FP4 e2m1 values, two to a byte, with an 8-bit exponent: dequantize_mxfp4). The torch loop
dequantizes one expert at a time; on GPU, or without pagoda's ops, MXFP4 experts are widened at load. A GGUF
file's experts stay in its blocks (engine/gguf.py: the op computes on every GGUF_KERNEL_TYPES type and MXFP4,
Experts.gguf), a projection whose gate and up come in different types widened.
Under tensor parallelism each expert's intermediate size is split like a dense MLP's (the router is
replicated) and the partial outputs are summed once; a GGUF file's experts in whole blocks, unevenly where an even
split would cut them (engine/gguf.py _expert_split).
Each block counts the tokens it routes to each expert into a row of the model's ExpertLoad (on the driver
rank), on the device and in place: operators read it to size the model."""
import logging

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagoda.engine.executor import parallel
from pagoda.engine.gguf import GGUF_KERNEL_TYPES
from pagoda.engine.layers import cpu_ops
from pagoda.engine.layers.activation import activation

log = logging.getLogger("pagoda.engine")
# FP4 e2m1 codes (transformers' integrations/mxfp4.py FP4_VALUES) and 2^(e - 127) for each exponent byte
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
MXFP4_SCALES = torch.pow(2.0, torch.arange(256, dtype=torch.float64) - 127).float()


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


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks: [..., K / 32, 16] uint8 (value 2j in the low nibble of byte j, 2j + 1 in the high one), scales:
    [..., K / 32] uint8 exponents -> [..., K] in dtype: fp4 * 2^(scale - 127), as transformers dequantizes."""
    lut, s = FP4_VALUES.to(blocks.device), MXFP4_SCALES.to(blocks.device)[scales.long()]
    w = torch.stack([lut[(blocks & 15).long()], lut[(blocks >> 4).long()]], dim=-1).flatten(-2)  # [..., K/32, 32]
    return (w * s[..., None]).flatten(-2).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [..., K] float (K a multiple of 32) -> (blocks [..., K / 32, 16] uint8, scales [..., K / 32] uint8),
    round to nearest FP4 code under each block's power-of-two scale (its largest magnitude at most 6)."""
    w = w.float().unflatten(-1, (-1, 32))
    amax = w.abs().amax(-1).clamp(min=2.0 ** -126)
    e = (torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127) + 127).to(torch.uint8)
    scaled = w / MXFP4_SCALES[e.long()][..., None]
    codes = (scaled.abs()[..., None] - FP4_VALUES[:8]).abs().argmin(-1).to(torch.uint8)  # magnitudes' codes
    codes |= (scaled < 0).to(torch.uint8) << 3
    return codes[..., 0::2] | (codes[..., 1::2] << 4), e


def _dequantize_gguf(kind: str, blocks: torch.Tensor, s: torch.Tensor, k: int, e: int) -> torch.Tensor:
    """Expert e's rows of GGUF experts (Experts.gguf) in float32: [rows, k]."""
    if kind == "MXFP4":
        return dequantize_mxfp4(blocks[e], s[e])
    return cpu_ops.ops().gguf_dequantize(blocks[e], GGUF_KERNEL_TYPES[kind][0], k)


def _k_major(*shape: int) -> torch.Tensor:
    """An [E, out, in] tensor with each expert's [in, out] transpose contiguous."""
    e, out, inp = shape
    return torch.empty(e, inp, out).transpose(1, 2)


def _triton_moe(w13, w2):
    """engine/layers/triton_moe.py (the experts' CUDA kernels) where triton imports and they take these weights
    (not a GGUF file's blocks, say), else None."""
    from pagoda.engine.layers import triton_moe
    ok = triton_moe.is_available() and {w13.dtype, w2.dtype} <= triton_moe.WEIGHT_DTYPES
    return triton_moe if ok else None


class Experts(nn.Module):
    """Every expert's SwiGLU MLP; this rank's share of each expert's intermediate size."""
    fused_ops = None  # pagoda's CPU ops, bound by the model runner where they are built

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str | None):
        super().__init__()
        self.num_experts, self.full_intermediate, self.hidden_size = num_experts, intermediate, hidden
        self.intermediate_size = n = parallel.split(intermediate, "the experts' intermediate size")
        self.gate_up_proj = nn.Parameter(_k_major(num_experts, 2 * n, hidden))  # [E, 2I, H]
        self.down_proj = nn.Parameter(_k_major(num_experts, hidden, n))  # [E, H, I]
        self.act, self.is_silu = activation(act) if act else None, act == "silu"  # None: the subclass's act_mul
        self.gate_up_proj_bias = self.down_proj_bias = None  # gpt-oss has them
        self.int8 = None  # quantize_int8_: (gate_up [E, 2I, H], its scales [E, 2I], down [E, H, I], its scales [E, H])
        # a GGUF file's experts kept in its blocks (load_gguf_, finish_gguf_): projection -> (ggml type name, blocks
        # [E, rows, row_bytes] uint8 and the type id [1] int64, or MXFP4 blocks [E, rows, K / 32, 16] and exponents
        # [E, rows, K / 32], K); gguf_pieces: gate / up / down as read, until finish_gguf_
        self.gguf, self.gguf_pieces = {}, {}
        self.gguf_split = None  # (start, size) of the intermediate size this rank holds of a GGUF file's experts
        self.tp = parallel.group()

    def act_mul(self, gate, up):
        return self.act(gate) * up

    def swiglu(self) -> dict:
        """The op's activation arguments (none: SiLU-and-mul)."""
        return {}

    def operands(self) -> tuple:
        """(w13, w2, s13, s2): the weights the op computes on, as they are stored, and their scales (GGUF blocks:
        their ggml type id)."""
        if self.int8 is not None:
            return self.int8[0], self.int8[2], self.int8[1], self.int8[3]
        if self.gguf:
            (w13, s13), (w2, s2) = [self.gguf[p][1:3] if p in self.gguf else (getattr(self, p), None)
                                    for p in ("gate_up_proj", "down_proj")]
            return w13, w2, s13, s2
        return self.gate_up_proj, self.down_proj, None, None

    def expert(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's weights in dtype: gate_up [2I, H], down [H, I] (dequantized where stored quantized)."""
        if self.int8 is not None:
            q13, s13, q2, s2 = self.int8
            return (q13[e].to(dtype) * s13[e, :, None].to(dtype)), (q2[e].to(dtype) * s2[e, :, None].to(dtype))
        if self.gguf:
            return tuple(_dequantize_gguf(*self.gguf[p], e).to(dtype) if p in self.gguf else getattr(self, p)[e]
                         for p in ("gate_up_proj", "down_proj"))
        return self.gate_up_proj[e], self.down_proj[e]

    def load_gguf_(self, piece: str, kind: str, blocks: torch.Tensor, s: torch.Tensor | None, k: int) -> None:
        """Keep a GGUF file's expert tensor in its blocks (engine/gguf.py): piece gate, up or down, this rank's
        [E, rows, ...] of type `kind` (s: MXFP4's exponents, repacked as dequantize_mxfp4 reads them)."""
        self.gguf_pieces[piece] = (kind, blocks, s, k)

    @torch.no_grad()
    def finish_gguf_(self) -> list[str]:
        """Once the file is read: projections whose pieces are all blocks of one type computed on as such (their
        float weights dropped); the pieces of a projection that mixes types widened into its float weight.
        Returns the pieces widened."""
        pieces, self.gguf_pieces, widened = self.gguf_pieces, {}, []
        n = self.intermediate_size
        for proj, names in (("gate_up_proj", ("gate", "up")), ("down_proj", ("down",))):
            got = [pieces[p] for p in names if p in pieces]
            if not got:
                continue
            kinds = {g[0] for g in got}
            if len(got) == len(names) and len(kinds) == 1:
                kind, k = got[0][0], got[0][3]
                w = torch.cat([g[1] for g in got], dim=1) if len(got) > 1 else got[0][1]
                s = (torch.cat([g[2] for g in got], dim=1) if len(got) > 1 else got[0][2]) if kind == "MXFP4" \
                    else torch.tensor([GGUF_KERNEL_TYPES[kind][0]])
                self.gguf[proj] = (kind, w, s, k)
                setattr(self, proj, None)
                continue
            for p in names:  # gate and up of different types: both widened into gate_up_proj
                if p in pieces:
                    rows = slice(None) if p == "down" else slice(n * names.index(p), n * (names.index(p) + 1))
                    target = getattr(self, proj)[:, rows]
                    for e in range(target.shape[0]):
                        target[e] = _dequantize_gguf(*pieces[p], e).to(target.dtype)
                    widened.append(p)
        return widened

    def forward(self, x, weights, ids):
        # x: [num_tokens, hidden]; weights, ids: [num_tokens, top_k] -> [num_tokens, hidden]
        fused = self.is_silu or bool(self.swiglu())  # the activations the op and the kernels have
        w13, w2, s13, s2 = self.operands()
        if fused and x.is_cuda and (triton_moe := _triton_moe(w13, w2)) is not None:
            out = triton_moe.fused_experts(x, w13, w2, weights, ids, s13, s2, self.gate_up_proj_bias,
                                           self.down_proj_bias, **self.swiglu())
        elif fused and self.fused_ops is not None:
            out = torch.zeros_like(x)
            self.fused_ops.ops().moe_experts_(out, x, w13, w2, weights, ids, s13, s2, self.gate_up_proj_bias,
                                              self.down_proj_bias, **self.swiglu())
        else:
            out = self.loop_(torch.zeros_like(x), x, weights, ids)
        return parallel.all_reduce(out, self.tp)

    @torch.no_grad()
    def quantize_int8_(self) -> bool:
        """Float experts to int8 with a scale per output row (engine/layers/quantization.py quantize_int8), row-major
        for the op; False where they stay as they are (quantized already, or a size not a multiple of 16)."""
        from pagoda.engine.layers.quantization import quantize_int8

        if self.gate_up_proj is None or self.int8 is not None or self.gate_up_proj.shape[2] % 16 \
                or self.intermediate_size % 16:
            return False
        parts = []
        for w in (self.gate_up_proj, self.down_proj):  # an expert at a time: no second copy of the int8 weights
            q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
            s = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
            for e in range(self.num_experts):
                q[e], s[e] = quantize_int8(w[e])
            parts += [q, s]
        self.int8 = tuple(parts)
        self.gate_up_proj = self.down_proj = None
        return True

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
                w13, w2 = self.expert(e, x.dtype)
                gate_up = x[tokens] @ w13.t()  # [c, 2I]
                if self.gate_up_proj_bias is not None:
                    gate_up = gate_up + self.gate_up_proj_bias[e]
                h = self.act_mul(*gate_up.chunk(2, dim=-1)) @ w2.t()  # [c, hidden]
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
    checkpoint interleaves them: [E, H, 2I], gate in the even columns). With mxfp4 (the checkpoint's
    quantization_config) the experts are its `*_blocks` [E, rows, K / 32, 16] and `*_scales` [E, rows, K / 32]
    uint8 as shipped (gate | up rows de-interleaved), never widened on CPU with pagoda's ops; elsewhere each
    projection is widened to the model's dtype as soon as its blocks and scales are both read."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, limit: float, alpha: float,
                 mxfp4: bool = False):
        super().__init__(num_experts, hidden, intermediate, None)
        n = self.intermediate_size
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * n))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))  # rank 0's; zeros elsewhere
        self.limit, self.alpha = limit, alpha
        if mxfp4:
            if hidden % 32 or n % 32:
                raise ValueError(f"gpt-oss MXFP4 experts: hidden size {hidden} and the intermediate size per rank {n} "
                                 f"must be multiples of 32 (the format's blocks)")
            u8 = lambda *shape: nn.Parameter(torch.empty(*shape, dtype=torch.uint8), requires_grad=False)  # noqa
            self.gate_up_proj_blocks, self.gate_up_proj_scales = u8(num_experts, 2 * n, hidden // 32, 16), \
                u8(num_experts, 2 * n, hidden // 32)
            self.down_proj_blocks, self.down_proj_scales = u8(num_experts, hidden, n // 32, 16), \
                u8(num_experts, hidden, n // 32)
            self.gate_up_proj = self.down_proj = None
            self.read = set()  # the MXFP4 tensors read, while widening waits for a projection's pair

    def act_mul(self, gate, up):
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def swiglu(self) -> dict:
        return {"swiglu_alpha": self.alpha, "swiglu_limit": self.limit}

    def operands(self) -> tuple:
        if self.gate_up_proj is None and self.int8 is None and not self.gguf:
            return self.gate_up_proj_blocks, self.down_proj_blocks, self.gate_up_proj_scales, self.down_proj_scales
        return super().operands()

    def expert(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.gate_up_proj is None and self.int8 is None and not self.gguf:
            return (dequantize_mxfp4(self.gate_up_proj_blocks[e], self.gate_up_proj_scales[e], dtype),
                    dequantize_mxfp4(self.down_proj_blocks[e], self.down_proj_scales[e], dtype))
        return super().expert(e, dtype)

    @torch.no_grad()
    def load_weight(self, whole, pname: str, shard) -> torch.Tensor:
        """The checkpoint's fused tensors: gate_up_proj [E, H, 2I] and its bias [E, 2I] (gate | up
        interleaved), down_proj [E, I, H] and its bias [E, H]; with MXFP4 the projections' blocks and scales
        (their rows the outputs, gate | up rows interleaved; down's inputs in blocks of 32); this rank's share."""
        n = self.intermediate_size
        a = self.tp.rank * n
        if pname.endswith(("_blocks", "_scales")):  # MXFP4 (the model has these only with mxfp4)
            if pname.endswith(("gate_up_proj_blocks", "gate_up_proj_scales")):
                t = whole[:, 2 * a:2 * (a + n)]
                t = torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)  # rows gate | up
            else:
                t = whole[:, :, a // 32:(a + n) // 32]
            target = getattr(self, pname.rsplit(".", 1)[-1])
        elif pname.endswith(("gate_up_proj", "gate_up_proj_bias")):
            t = whole[..., 2 * a:2 * (a + n)]
            t = torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)  # [..., 2n]: gate | up
            target = self.gate_up_proj.transpose(1, 2) if pname.endswith("proj") else self.gate_up_proj_bias
        elif pname.endswith("down_proj"):
            t, target = whole[:, a:a + n], self.down_proj.transpose(1, 2)
        else:
            t, target = whole[:], self.down_proj_bias
            if self.tp.rank:
                t = torch.zeros_like(t)
        if target is None or target.shape != t.shape:
            raise ValueError(f"shape mismatch for {pname}: checkpoint {tuple(t.shape)}, model "
                             f"{None if target is None else tuple(target.shape)}")
        target.copy_(t)
        if pname.endswith(("_blocks", "_scales")):
            self._widen_where_needed(pname.rsplit(".", 1)[-1])
        return t

    def _widen_where_needed(self, name: str) -> None:
        """On GPU, or on CPU without pagoda's ops: once a projection's blocks and scales are both read, the
        projection in the model's dtype (k-major, as Experts holds it) in place of its MXFP4 tensors."""
        device = self.down_proj_bias.device
        if device.type == "cpu" and cpu_ops.is_available(device)[0]:
            return
        proj = name.rsplit("_", 1)[0]  # gate_up_proj or down_proj
        self.read.add(name)
        if not {f"{proj}_blocks", f"{proj}_scales"} <= self.read:
            return
        dtype = self.down_proj_bias.dtype
        blocks, scales = getattr(self, f"{proj}_blocks"), getattr(self, f"{proj}_scales")
        w = torch.empty(blocks.shape[0], blocks.shape[2] * 32, blocks.shape[1], dtype=dtype, device=device)
        for e in range(w.shape[0]):  # an expert at a time: its float32 temporaries only
            w[e] = dequantize_mxfp4(blocks[e], scales[e], dtype).t()
        setattr(self, proj, nn.Parameter(w.transpose(1, 2), requires_grad=False))  # [E, rows, K], k-major
        setattr(self, f"{proj}_blocks", None)
        setattr(self, f"{proj}_scales", None)
        _log_widening(device, dtype)


_WIDENED: set = set()  # (device type, dtype) logged once a process


def _log_widening(device: torch.device, dtype: torch.dtype) -> None:
    if (device.type, dtype) not in _WIDENED:
        _WIDENED.add((device.type, dtype))
        why = "pagoda's MXFP4 kernel runs on CPU" if device.type != "cpu" else "pagoda's C++ ops are not built"
        log.info("gpt-oss MXFP4 experts widened to %s at load on %s (%s)", str(dtype).removeprefix("torch."),
                 device.type, why)


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

"""The experts of a mixture-of-experts layer for CUDA (engine/layers/moe.py Experts, whose loop_ is the reference) as
two Triton grouped GEMMs over the step's (token, slot) pairs grouped by expert, each group padded to the kernels'
row block (vLLM's moe_align_block_size, here in torch ops): a program takes one block of one expert's rows, so each
expert's weights are read by its own blocks only and experts no token chose are never read.

gate_up: h = act(x W13^T + b13) per pair, the activation SiLU-and-mul or gpt-oss's clamped SwiGLU (as
GptOssExperts.act_mul). down: (h W2^T + b2) * the pair's routing weight, into [T, top_k, H], summed over the slots
in torch. Weights float32, bfloat16 or float16 (or int8 with a float32 scale per output row, applied to the
accumulator); products accumulate in float32 (float32 operands in full precision, not tf32). Nothing waits for the
device (CUDA graphs can capture it): the grid is sized for the most blocks any routing needs, and the blocks past
the last group return at once. Launch shapes are untuned (picked without a GPU so that sm_90 builds do not spill
registers: benchmarks/kernels.py --compile-only). Runs on CPU in Triton's interpreter with TRITON_INTERPRET=1 set
before this module is imported (tests only: slow)."""
# Lazy annotations: `tl.constexpr` below is then a string, so this module imports without triton.
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # keep the module importable; is_available() says why not
    tl = None

    class triton:  # noqa: N801 - stand-in so the @triton.jit decorators below still apply
        jit = staticmethod(lambda fn: fn)

from pagoda.engine.layers.triton_attention import _dot, _dot_args  # tl.dot, and its interpreter's bfloat16 fix

WEIGHT_DTYPES = {torch.float32, torch.bfloat16, torch.float16, torch.int8}  # int8: with its scales
BLOCK_N = 64
BLOCK_K = {torch.float32: 32}  # float32 operands: half the 16-bit types' 64, for registers and shared memory
NUM_WARPS = {torch.float32: 8}  # float32 products are FMAs (no tf32): their operand tiles in registers too
NUM_STAGES = 3


def is_available() -> bool:
    return tl is not None


@triton.jit
def _widen(w, like, HAS_SCALE: tl.constexpr):
    # weights in x's dtype; int8 (exact) through float32: Triton's interpreter (3.9) casts int8 to bfloat16 as bits
    if HAS_SCALE:
        w = w.to(tl.float32)
    return w.to(like.dtype)


@triton.jit
def _gate_up_kernel(x, w, scale, bias, h, sorted_pairs, block_experts, num_pairs, num_experts, I, H,
                    sxt, swe, swn, swk, alpha, limit,
                    TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    DOT_UPCAST: tl.constexpr):
    # program (block of pairs, block of BN of the I gate columns and their up columns)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_experts + pid_m).to(tl.int64)
    if e >= num_experts:  # past the last group
        return
    pairs = tl.load(sorted_pairs + pid_m * BM + tl.arange(0, BM))
    mm = pairs < num_pairs  # past the group's pairs: its padding (num_pairs)
    tokens = (pairs // TOP_K).to(tl.int64)
    rn = pid_n * BN + tl.arange(0, BN)
    mn = rn < I
    rk = tl.arange(0, BK)
    x_ptrs = x + tokens[:, None] * sxt + rk[None, :]  # [BM, BK]
    g_ptrs = w + e * swe + rn[None, :] * swn + rk[:, None] * swk  # [BK, BN]: W13's gate rows, transposed
    u_ptrs = g_ptrs + I * swn  # its up rows
    gate = tl.zeros([BM, BN], tl.float32)
    up = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, H, BK):
        mk = rk < H - k0
        a = tl.load(x_ptrs, mask=mm[:, None] & mk[None, :], other=0.0)
        wg = _widen(tl.load(g_ptrs, mask=mk[:, None] & mn[None, :], other=0.0), a, HAS_SCALE)
        wu = _widen(tl.load(u_ptrs, mask=mk[:, None] & mn[None, :], other=0.0), a, HAS_SCALE)
        gate += _dot(a, wg, DOT_PRECISION, DOT_UPCAST)
        up += _dot(a, wu, DOT_PRECISION, DOT_UPCAST)
        x_ptrs += BK
        g_ptrs += BK * swk
        u_ptrs += BK * swk
    if HAS_SCALE:
        gate *= tl.load(scale + e * 2 * I + rn, mask=mn, other=0.0)[None, :]
        up *= tl.load(scale + e * 2 * I + I + rn, mask=mn, other=0.0)[None, :]
    if HAS_BIAS:
        gate += tl.load(bias + e * 2 * I + rn, mask=mn, other=0.0).to(tl.float32)[None, :]
        up += tl.load(bias + e * 2 * I + I + rn, mask=mn, other=0.0).to(tl.float32)[None, :]
    if SWIGLU:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    else:
        act = gate * tl.sigmoid(gate) * up
    tl.store(h + pairs[:, None].to(tl.int64) * I + rn[None, :], act.to(h.dtype.element_ty),
             mask=mm[:, None] & mn[None, :])


@triton.jit
def _down_kernel(h, w, scale, bias, routing, out, sorted_pairs, block_experts, num_pairs, num_experts, H, I,
                 swe, swn, swk,
                 HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 DOT_UPCAST: tl.constexpr):
    # program (block of pairs, block of BN output columns): out[pair] = (h[pair] W2^T + b2) * routing[pair]
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_experts + pid_m).to(tl.int64)
    if e >= num_experts:
        return
    pairs = tl.load(sorted_pairs + pid_m * BM + tl.arange(0, BM))
    mm = pairs < num_pairs
    rows = pairs.to(tl.int64)
    rn = pid_n * BN + tl.arange(0, BN)
    mn = rn < H
    rk = tl.arange(0, BK)
    h_ptrs = h + rows[:, None] * I + rk[None, :]  # [BM, BK]
    w_ptrs = w + e * swe + rn[None, :] * swn + rk[:, None] * swk  # [BK, BN]
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, I, BK):
        mk = rk < I - k0
        a = tl.load(h_ptrs, mask=mm[:, None] & mk[None, :], other=0.0)
        b = _widen(tl.load(w_ptrs, mask=mk[:, None] & mn[None, :], other=0.0), a, HAS_SCALE)
        acc += _dot(a, b, DOT_PRECISION, DOT_UPCAST)
        h_ptrs += BK
        w_ptrs += BK * swk
    if HAS_SCALE:
        acc *= tl.load(scale + e * H + rn, mask=mn, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + e * H + rn, mask=mn, other=0.0).to(tl.float32)[None, :]
    acc *= tl.load(routing + rows, mask=mm, other=0.0)[:, None]
    tl.store(out + rows[:, None] * H + rn[None, :], acc.to(out.dtype.element_ty), mask=mm[:, None] & mn[None, :])


def block_m_for(num_pairs: int, num_experts: int) -> int:
    # few pairs an expert (decode): small blocks waste fewer padding rows
    return 16 if num_pairs <= 4 * num_experts else 64


def align(ids, num_experts: int, block_m: int):
    """ids: [T, top_k] -> sorted_pairs [num_blocks * block_m] int32: the (token, slot) pairs (t * top_k + slot)
    grouped by expert, ascending, each group padded to a multiple of block_m with T * top_k (no pair);
    block_experts [num_blocks] int32: each block's expert, num_experts past the last group. num_blocks bounds
    the blocks of any routing of T * top_k pairs (each group adds at most one partial block)."""
    flat = ids.flatten()
    num_pairs, device = flat.numel(), flat.device
    num_blocks = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    experts, order = torch.sort(flat, stable=True)
    ends = torch.searchsorted(experts, torch.arange(num_experts, device=device), right=True)  # [E]
    counts = ends - torch.cat([ends.new_zeros(1), ends[:-1]])
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    # sorted position i of expert g: its group's padded start + (i - the group's start)
    shift = (padded_ends - padded - (ends - counts))[experts]
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[torch.arange(num_pairs, device=device) + shift] = order.to(torch.int32)
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True).to(torch.int32)
    return sorted_pairs, block_experts


def fused_experts(x, w13, w2, weights, ids, s13=None, s2=None, b13=None, b2=None, swiglu_alpha=None,
                  swiglu_limit=None, block_m=None):
    """As Experts.loop_ into zeros (the arguments of the CPU op moe_experts_). x: [T, H]; w13: [E, 2I, H] (gate
    rows then up rows), w2: [E, H, I], any strides, in x's dtype or int8 with s13 [E, 2I] / s2 [E, H] scales;
    b13: [E, 2I], b2: [E, H] or None; weights, ids: [T, top_k] float32 / int64; swiglu_alpha and swiglu_limit
    both or neither (SiLU-and-mul) -> [T, H] in x's dtype."""
    num_tokens, top_k = ids.shape
    num_experts, hidden, inter = w2.shape
    x = x.contiguous()
    if num_tokens == 0:
        return torch.zeros_like(x)
    num_pairs = num_tokens * top_k
    block_m = block_m or block_m_for(num_pairs, num_experts)
    sorted_pairs, block_experts = align(ids, num_experts, block_m)
    common = dict(BM=block_m, BN=BLOCK_N, BK=BLOCK_K.get(x.dtype, 64), HAS_SCALE=s13 is not None,
                  **_dot_args(x.dtype), num_warps=NUM_WARPS.get(x.dtype, 4), num_stages=NUM_STAGES)
    scales = [x.new_empty(0, dtype=torch.float32) if s is None else s.float().contiguous() for s in (s13, s2)]
    biases = [x.new_empty(0) if b is None else b.contiguous() for b in (b13, b2)]
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    swiglu = swiglu_alpha is not None
    grid = (block_experts.shape[0], triton.cdiv(inter, BLOCK_N))
    _gate_up_kernel[grid](x, w13, scales[0], biases[0], h, sorted_pairs, block_experts, num_pairs, num_experts,
                          inter, hidden, x.stride(0), *w13.stride(),
                          float(swiglu_alpha) if swiglu else 0.0, float(swiglu_limit) if swiglu else 0.0,
                          TOP_K=top_k, HAS_BIAS=b13 is not None, SWIGLU=swiglu, **common)
    out = torch.empty(num_tokens, top_k, hidden, dtype=x.dtype, device=x.device)
    grid = (block_experts.shape[0], triton.cdiv(hidden, BLOCK_N))
    _down_kernel[grid](h, w2, scales[1], biases[1], weights.float().contiguous(), out, sorted_pairs, block_experts,
                       num_pairs, num_experts, hidden, inter, *w2.stride(), HAS_BIAS=b2 is not None, **common)
    return out[:, 0] if top_k == 1 else out.sum(dim=1)  # [T, H]

"""Triton kernels of linear-attention layers for CUDA: the causal conv1d with SiLU and the gated delta rule, over
a step's flat batch of sequences, each reading and updating its state slot in place (engine/layers/delta_rule.py
holds the torch reference and the shapes). The wrappers never sync with the host (CUDA graphs can capture them).

conv1d: one program per (sequence, block of channels), along the sequence's tokens. Delta rule: one program per
(sequence, value head, block of BV state columns), in two kernels launched over the whole batch, each taking its
own sequences: one-token sequences the recurrent step (the [head_k_dim, BV] block of state in registers), longer
ones the chunked form (a triangular solve within chunks of CHUNK_T tokens, the recurrence between them, products
on tensor cores in bfloat16 models). Launch shapes are untuned (picked without a GPU so that sm_90 builds do not
spill registers: benchmarks/kernels.py --compile-only). Runs on CPU in Triton's interpreter with TRITON_INTERPRET=1
set before this module is imported (tests only: slow)."""
# Lazy annotations: `tl.constexpr` below is then a string, so this module imports without triton.
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # keep the module importable; the wrappers then fail on use
    tl = InterpretedFunction = None

    class triton:  # noqa: N801 - stand-in so the @triton.jit decorators below still apply
        jit = staticmethod(lambda fn: fn)

CONV_BLOCK = 128  # channels per program
RULE_BLOCK_V = 32  # state columns per program: a [128, 32] float32 block is 32 registers a thread at 4 warps
CHUNK_BLOCK_V = 32  # the chunked kernel's
CHUNK_BLOCK_K = 16  # head_k_dim per step of its products (32 spills at 4 or 8 warps)
CHUNK_T, CHUNK_WARPS = 32, 8  # tokens per chunk (the reference's CHUNK is 64: the math is the same)


@triton.jit
def _conv_window(x, sx0, state_base, start, src, rc, mc, rj, taps, K):
    # [BC, KP] float32: inputs src (relative to the sequence's start) of channels rc, the first `taps`; src < 0
    # from the slot's state (its K - 1 last inputs)
    from_x = (src >= 0) & (rj < taps)
    from_s = (src < 0) & (rj < taps)
    xv = tl.load(x + (start + src)[None, :] * sx0 + rc[:, None], mask=mc[:, None] & from_x[None, :],
                 other=0.0)
    sv = tl.load(state_base + (K - 1 + src)[None, :], mask=mc[:, None] & from_s[None, :], other=0.0)
    return tl.where(from_x[None, :], xv.to(tl.float32), sv.to(tl.float32))


@triton.jit
def _conv_kernel(x, w, state, out, query_start_loc, state_slots, sx0, C,
                 K: tl.constexpr, KP: tl.constexpr, BC: tl.constexpr):
    seq, cb = tl.program_id(0), tl.program_id(1)
    start = tl.load(query_start_loc + seq).to(tl.int64)
    n = tl.load(query_start_loc + seq + 1) - start
    slot = tl.load(state_slots + seq).to(tl.int64)
    rc = cb * BC + tl.arange(0, BC)
    mc = rc < C
    rj = tl.arange(0, KP)  # taps
    weight = tl.load(w + rc[:, None] * K + rj[None, :], mask=mc[:, None] & (rj < K)[None, :], other=0.0)
    weight = weight.to(tl.float32)
    state_base = state + slot * C * (K - 1) + rc[:, None] * (K - 1)  # [BC, 1]: the slot's [C, K - 1]
    for t in range(n):
        window = _conv_window(x, sx0, state_base, start, t - (K - 1) + rj, rc, mc, rj, K, K)
        y = tl.sum(weight * window, 1).to(out.dtype.element_ty).to(tl.float32)  # rounded as F.conv1d's output
        y = y / (1.0 + tl.exp(-y))
        tl.store(out + (start + t) * C + rc, y.to(out.dtype.element_ty), mask=mc)
    last = _conv_window(x, sx0, state_base, start, n - (K - 1) + rj, rc, mc, rj, K - 1, K)
    tl.debug_barrier()  # every thread's reads of the old state before any write of the new
    tl.store(state_base + rj[None, :], last.to(state.dtype.element_ty), mask=mc[:, None] & (rj < K - 1)[None, :])


@triton.jit
def _l2norm(x, scale):
    return x * (tl.rsqrt(tl.sum(x * x, 0) + 1e-6) * scale)


@triton.jit
def _recurrent_kernel(q, k, v, g, beta, state, out, query_start_loc, state_slots,
                      sq0, sq1, sk0, sk1, sv0, sv1, scale,
                      HV: tl.constexpr, REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr):
    seq, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(query_start_loc + seq).to(tl.int64)  # int64: token offsets times strides
    end = tl.load(query_start_loc + seq + 1).to(tl.int64)
    mine = end - start == 1  # longer sequences are _chunked_kernel's
    slot = tl.load(state_slots + seq).to(tl.int64)
    hk = h // REP
    rk = tl.arange(0, BK)
    rv = vb * BV + tl.arange(0, BV)
    mk, mv = rk < DK, rv < DV
    state_ptrs = state + (slot * HV + h) * DK * DV + rk[:, None] * DV + rv[None, :]
    mine_s = (rk < tl.where(mine, DK, 0))[:, None] & mv[None, :]  # the state block, if the sequence is ours
    s = tl.load(state_ptrs, mask=mine_s, other=0.0)  # [BK, BV] float32
    for t in range(start, tl.where(mine, end, start)):
        qt = _l2norm(tl.load(q + t * sq0 + hk * sq1 + rk, mask=mk, other=0.0).to(tl.float32), scale)
        kt = _l2norm(tl.load(k + t * sk0 + hk * sk1 + rk, mask=mk, other=0.0).to(tl.float32), 1.0)
        vt = tl.load(v + t * sv0 + h * sv1 + rv, mask=mv, other=0.0).to(tl.float32)
        s = s * tl.exp(tl.load(g + t * HV + h))
        delta = (vt - tl.sum(s * kt[:, None], 0)) * tl.load(beta + t * HV + h)  # [BV]
        s = s + kt[:, None] * delta[None, :]
        o = tl.sum(s * qt[:, None], 0)
        tl.store(out + (t * HV + h) * DV + rv, o.to(out.dtype.element_ty), mask=mv)
    tl.store(state_ptrs, s, mask=mine_s)


@triton.jit
def _rows(ptrs, col0, mt, DK, BKB):
    # [BT, BKB] float32: columns [col0, col0 + BKB) of the rows at ptrs ([BT] pointers), the tokens mt
    rc = col0 + tl.arange(0, BKB)
    return tl.load(ptrs[:, None] + rc[None, :], mask=mt[:, None] & (rc < DK)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _chunked_kernel(q, k, v, g, beta, state, out, query_start_loc, state_slots,
                    sq0, sq1, sk0, sk1, sv0, sv1, scale,
                    HV: tl.constexpr, REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                    BKB: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # sequences of more than one token, BT tokens at a time, from state S to the next (d: cumulative log decay in
    # the chunk; delta_rule._chunked with chunks of BT):
    #   A = strict_lower(beta_i k_i.k_j e^(d_i - d_j)), T = (I + A)^-1 (forward substitution, a row at a time)
    #   W = T (beta e^d k), U = T (beta v), V' = U - W S
    #   out = (q e^d) S + lower(q_i.k_j e^(d_i - d_j)) V';  S = S e^(d_last) + (k e^(d_last - d))^T V'
    # head_k_dim in blocks of BKB (q, k reread from L2), the program's [DK, BV] block of S in its slot (the
    # program's alone; barriers order its threads' reads and writes): whole tiles spill registers
    seq, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(query_start_loc + seq).to(tl.int64)
    end = tl.load(query_start_loc + seq + 1).to(tl.int64)
    mine = end - start > 1  # one-token sequences are _recurrent_kernel's
    slot = tl.load(state_slots + seq).to(tl.int64)
    hk = h // REP
    rv = vb * BV + tl.arange(0, BV)
    rt = tl.arange(0, BT)
    mv = rv < DV
    state_cols = state + (slot * HV + h) * DK * DV + rv[None, :]  # [1, BV]
    lower = rt[:, None] >= rt[None, :]
    eye = (rt[:, None] == rt[None, :]).to(tl.float32)
    for c0 in range(start, tl.where(mine, end, start), BT):
        t = c0 + rt
        mt = t < end
        q_rows, k_rows = q + t * sq0 + hk * sq1, k + t * sk0 + hk * sk1
        qq = tl.zeros([BT], tl.float32)
        kk = tl.zeros([BT], tl.float32)
        qk = tl.zeros([BT, BT], tl.float32)
        kk_t = tl.zeros([BT, BT], tl.float32)
        for c in range(0, DK, BKB):
            qb, kb = _rows(q_rows, c, mt, DK, BKB), _rows(k_rows, c, mt, DK, BKB)
            qq += tl.sum(qb * qb, 1)
            kk += tl.sum(kb * kb, 1)
            qk = tl.dot(qb, tl.trans(kb), qk, input_precision=DOT_PRECISION)
            kk_t = tl.dot(kb, tl.trans(kb), kk_t, input_precision=DOT_PRECISION)
        rq = tl.rsqrt(qq + 1e-6) * scale  # the L2 norms, applied to the products
        rk = tl.rsqrt(kk + 1e-6)
        b = tl.load(beta + t * HV + h, mask=mt, other=0.0)
        d = tl.cumsum(tl.load(g + t * HV + h, mask=mt, other=0.0), 0)  # [BT]; past the end, the last's
        pair = tl.where(lower, tl.exp(d[:, None] - d[None, :]), 0.0)  # [BT, BT]
        a = tl.where(rt[:, None] > rt[None, :], kk_t * (b * rk)[:, None] * rk[None, :] * pair, 0.0)
        p = qk * rq[:, None] * rk[None, :] * pair
        tri = eye
        for i in range(1, BT):  # row i of T = e_i - A_i T, rows below i still those of I
            row = rt[:, None] == i
            a_i = tl.sum(tl.where(row, a, 0.0), 0)  # [BT]
            tri = tl.where(row, eye - tl.sum(a_i[:, None] * tri, 0)[None, :], tri)
        vc = tl.load(v + t[:, None] * sv0 + h * sv1 + rv[None, :], mask=mt[:, None] & mv[None, :], other=0.0)
        u = tl.dot(tri, vc.to(tl.float32) * b[:, None], input_precision=DOT_PRECISION)  # [BT, BV]
        o = tl.zeros([BT, BV], tl.float32)
        fq, fw = rq * tl.exp(d), rk * b * tl.exp(d)
        for c in range(0, DK, BKB):  # V' = U - W S, out = (q e^d) S, by blocks of S's rows
            rc = c + tl.arange(0, BKB)
            sb = tl.load(state_cols + rc[:, None] * DV, mask=(rc < DK)[:, None] & mv[None, :], other=0.0)
            w = tl.dot(tri, _rows(k_rows, c, mt, DK, BKB) * fw[:, None], input_precision=DOT_PRECISION)
            u -= tl.dot(w, sb, input_precision=DOT_PRECISION)
            o = tl.dot(_rows(q_rows, c, mt, DK, BKB) * fq[:, None], sb, o, input_precision=DOT_PRECISION)
        o = tl.dot(p, u, o, input_precision=DOT_PRECISION)
        tl.store(out + (t[:, None] * HV + h) * DV + rv[None, :], o.to(out.dtype.element_ty),
                 mask=mt[:, None] & mv[None, :])
        d_last = tl.sum(tl.where(rt == BT - 1, d, 0.0), 0)
        fk = rk * tl.exp(d_last - d)
        tl.debug_barrier()  # the reads of S above before its writes
        for c in range(0, DK, BKB):  # S = S e^(d_last) + (k e^(d_last - d))^T V'
            rc = c + tl.arange(0, BKB)
            ms = (rc < DK)[:, None] & mv[None, :]
            sb = tl.load(state_cols + rc[:, None] * DV, mask=ms, other=0.0)
            kb = _rows(k_rows, c, mt, DK, BKB) * fk[:, None]
            sb = tl.dot(tl.trans(kb), u, sb * tl.exp(d_last), input_precision=DOT_PRECISION)
            tl.debug_barrier()
            tl.store(state_cols + rc[:, None] * DV, sb, mask=ms)
        tl.debug_barrier()  # the next chunk reads S


def interpreted() -> bool:
    return InterpretedFunction is not None and isinstance(_recurrent_kernel, InterpretedFunction)


def causal_conv1d(x, weight, conv_state, query_start_loc, state_slots):
    """As delta_rule.causal_conv1d_reference. x: [num_tokens, C] (rows may be strided); weight: [C, K];
    conv_state: [num_slots, C, K - 1] contiguous, in x's dtype, updated in place -> [num_tokens, C]."""
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    channels, kernel = weight.shape
    assert conv_state.is_contiguous() and conv_state.shape[1:] == (channels, kernel - 1)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    grid = (state_slots.shape[0], triton.cdiv(channels, CONV_BLOCK))
    _conv_kernel[grid](x, weight, conv_state, out, query_start_loc, state_slots, x.stride(0), channels,
                       K=kernel, KP=triton.next_power_of_2(kernel), BC=CONV_BLOCK, num_warps=4)
    return out


def gated_delta_rule(q, k, v, g, beta, state, query_start_loc, state_slots):
    """As delta_rule.gated_delta_rule_reference. q, k: [num_tokens, Hk, Dk]; v: [num_tokens, Hv, Dv] (the last
    dimension contiguous); g, beta: [num_tokens, Hv]; state: [num_slots, Hv, Dk, Dv] float32, contiguous, updated
    in place -> [num_tokens, Hv, Dv] in v's dtype."""
    q, k, v = (t if t.stride(2) == 1 else t.contiguous() for t in (q, k, v))
    g, beta = g.float().contiguous(), beta.float().contiguous()
    hk, dk = q.shape[1:]
    hv, dv = v.shape[1:]
    assert state.is_contiguous() and state.dtype == torch.float32 and state.shape[1:] == (hv, dk, dv)
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    # both kernels over every sequence: each takes its own (one token, or more), so the host need not know which
    args = (q, k, v, g, beta, state, out, query_start_loc, state_slots,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), dk ** -0.5)
    shape = {"HV": hv, "REP": hv // hk, "DK": dk, "DV": dv}
    bk = max(16, triton.next_power_of_2(dk))
    block_v = max(16, min(RULE_BLOCK_V, triton.next_power_of_2(dv)))
    grid = (state_slots.shape[0], hv, triton.cdiv(dv, block_v))
    _recurrent_kernel[grid](*args, **shape, BK=bk, BV=block_v, num_warps=4)
    block_v = max(16, min(CHUNK_BLOCK_V, triton.next_power_of_2(dv)))
    grid = (state_slots.shape[0], hv, triton.cdiv(dv, block_v))
    # float32 models: products in float32 (ieee), as the reference; bfloat16: tf32x3 on tensor cores
    _chunked_kernel[grid](*args, **shape, BKB=min(bk, CHUNK_BLOCK_K), BV=block_v, BT=CHUNK_T,
                          DOT_PRECISION="ieee" if v.dtype == torch.float32 else "tf32x3", num_warps=CHUNK_WARPS)
    return out

"""Triton PagedAttention kernels: KV cache write, decode (flash decoding) and prefill, each with the
attention variants (engine/layers/attention.py Variant): a sliding window (the blocks before it are
never read), soft-capped scores and sinks.

KV cache, per layer: k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous.
Token `pos` of a sequence lives in slot block_table[pos // block_size] * block_size + pos % block_size.
An 8-bit cache (int8 or fp8 e4m3, engine/layers/attention.py quantize_kv) has k_scale, v_scale:
[num_blocks, block_size, num_kv_heads] float32 beside it; the kernels widen a K/V tile in registers.
fp8 goes through the kernels as its bytes (typed int8), written and widened by integer arithmetic: the
same code in the interpreter and on any GPU.

The wrappers check metadata only and never synchronize with the host, so they can be captured in a
CUDA graph (after one warm-up call has compiled the kernels). On CPU the kernels run in Triton's
interpreter, which needs TRITON_INTERPRET=1 in the environment before this module is imported.
"""

# Lazy annotations: `tl.constexpr` below is then a string, so this module imports without triton.
from __future__ import annotations

import functools
import math

import torch

from pagoda.engine.layers.attention import PLAIN, Variant

try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    _TRITON_ERROR = None
except ImportError as e:  # e.g. macOS: keep is_available() usable
    _TRITON_ERROR = e
    tl = InterpretedFunction = None

    class triton:  # noqa: N801 - stand-in so the @triton.jit decorators below still apply
        jit = staticmethod(lambda fn: fn)


_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_KV8 = {torch.int8: 1, torch.float8_e4m3fn: 2}  # an 8-bit cache's kernel code (KV8; 0: 16/32-bit)
_LOG2E = 1.4426950408889634

# Launch configuration: picked for Hopper without a GPU at hand, so untuned (notes/kernels.md);
# benchmarks/kernels.py --sweep overrides these to try others. tile_n: KV tokens per loop step.
DECODE_CONFIG = dict(tile_n=64, num_warps=4, num_stages=2)
PREFILL_CONFIG = dict(block_m=64, tile_n=64, num_warps=4, num_stages=2)
_MIN_PARTITION = 256  # decode: fewest tokens worth giving a split of its own
_MAX_SPLITS = 64
_PROGRAMS_PER_SM = 8  # decode: split until about this many programs per SM (several waves: small tail)


# --------------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _rint(x):
    # x rounded to an integer, ties to even (|x| < 2^22): adding 1.5 * 2^23 leaves no fraction bits
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _fp8_bits(y):
    # y (|y| <= 448) -> its fp8 e4m3 byte (as int8), rounded to nearest even, by integer arithmetic: Triton's
    # interpreter (3.9) drops the carry when rounding a mantissa up (124.3 -> 64)
    a = tl.abs(y)
    bits = a.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)  # 23 -> 3 mantissa bits; bias 127 -> 7
    em = tl.where(a < 0.015625, _rint(a * 512.0).to(tl.int32), normal)  # below 2^-6: subnormal, m * 2^-9
    return (em | tl.where(y < 0.0, 0x80, 0)).to(tl.int8)  # the byte as int8 (wraps), as an int8 cache's type


@triton.jit
def _quantize(x, KV8: tl.constexpr):
    # x: [BLOCK_H, BLOCK_D] (zeros past HEAD_DIM) -> (x / scale in the cache's format, scale: [BLOCK_H]),
    # scale = each row's absolute max / the format's largest value (attention.py quantize_kv)
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    if KV8 == 1:
        scale = tl.where(amax > 0.0, amax / 127.0, 1.0)
        y = tl.minimum(tl.maximum(x / scale[:, None], -127.0), 127.0)
        return _rint(y).to(tl.int8), scale
    scale = tl.where(amax > 0.0, amax / 448.0, 1.0)
    y = tl.minimum(tl.maximum(x / scale[:, None], -448.0), 448.0)
    return _fp8_bits(y), scale


@triton.jit
def _widen(x, KV8: tl.constexpr):
    # an 8-bit cache's values as float32: int8 as they are; fp8 e4m3 (its bytes, as int8) by moving exponent and
    # mantissa into a float's and re-biasing (7 -> 127); subnormals (exponent 0) are m * 2^-9
    if KV8 == 1:
        return x.to(tl.float32)
    b = x.to(tl.int32)
    em = b & 0x7F
    normal = ((em << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    mag = tl.where(em >= 8, normal, em.to(tl.float32) * 0.001953125)
    return tl.where((b & 0x80) != 0, -mag, mag)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    KV8: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    num_heads = tl.where(slot >= 0, NUM_KV_HEADS, 0)  # slot < 0: padding, write nothing
    mask = (h[:, None] < num_heads) & (d[None, :] < HEAD_DIM)
    # k, v: [BLOCK_H, BLOCK_D] (all kv heads of token t)
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + h[:, None] * HEAD_DIM + d[None, :]
    if KV8:  # 8 bits and a scale per (token, kv head)
        k, k_scale = _quantize(k, KV8)
        v, v_scale = _quantize(v, KV8)
        tl.store(k_scale_ptr + slot * NUM_KV_HEADS + h, k_scale, mask=h < num_heads)
        tl.store(v_scale_ptr + slot * NUM_KV_HEADS + h, v_scale, mask=h < num_heads)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # Triton's interpreter multiplies bfloat16 as raw uint16 bits (triton 3.9)
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _load_kv_tile(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, bt_row_ptr, tok, tok_mask, kv_head, d, d_mask,
                  like, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  KV8: tl.constexpr):
    # tok: [TILE_N] logical positions -> physical rows through the block table (masked: never reads
    # the -1 padding of a block table row)
    blk = tl.load(bt_row_ptr + tok // BLOCK_SIZE, mask=tok_mask, other=0).to(tl.int64)
    row = blk * BLOCK_SIZE + tok % BLOCK_SIZE
    off = row[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + d[None, :]
    mask = tok_mask[:, None] & d_mask[None, :]
    # k, v: [TILE_N, BLOCK_D]
    k = tl.load(k_cache_ptr + off, mask=mask, other=0.0)
    v = tl.load(v_cache_ptr + off, mask=mask, other=0.0)
    if KV8:  # an 8-bit cache: widened and scaled here, in q's (`like`'s) dtype
        ks = tl.load(k_scale_ptr + row * NUM_KV_HEADS + kv_head, mask=tok_mask, other=0.0)
        vs = tl.load(v_scale_ptr + row * NUM_KV_HEADS + kv_head, mask=tok_mask, other=0.0)
        k = (_widen(k, KV8) * ks[:, None]).to(like.dtype)
        v = (_widen(v, KV8) * vs[:, None]).to(like.dtype)
    return k, v


@triton.jit
def _softcapped(s, softcap):
    # softcap * tanh(s / softcap), tanh(x) = 1 - 2 / (exp(2x) + 1): Triton has no portable tanh
    return softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))


@triton.jit
def _scores(s, scale, softcap, SOFTCAP: tl.constexpr):
    # raw q.k -> base-2 logits: scaled, then soft-capped where the layer caps them
    if SOFTCAP:
        return _softcapped(s * scale, softcap) * 1.4426950408889634
    return s * (scale * 1.4426950408889634)


@triton.jit
def _sink_start(sinks_ptr, head, mask, HAS_SINKS: tl.constexpr, ROWS: tl.constexpr):
    # the running (max, sum) a softmax starts from: a sink is a key of weight exp(sink) and value zero
    if HAS_SINKS:
        m = tl.load(sinks_ptr + head, mask=mask, other=-1.0e30).to(tl.float32) * 1.4426950408889634
        return m, tl.where(mask, 1.0, 0.0)
    return tl.full([ROWS], -1.0e30, tl.float32), tl.zeros([ROWS], tl.float32)


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, sinks_ptr, k_scale_ptr, v_scale_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    scale, softcap, window, partition_size, num_splits,
    stride_qs, stride_qh, stride_os, stride_oh, stride_bt,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    SPLIT: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, KV8: tl.constexpr,
):
    # one program: one sequence, one kv head (its GROUP query heads), one slice of the context
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq)
    start = split * partition_size
    # the last split runs to the end, so a max_context_len hint that was too small costs speed only
    end = tl.where(split == num_splits - 1, ctx, tl.minimum(ctx, start + partition_size))
    if HAS_WINDOW:  # keys before the window are never read
        start = tl.maximum(start, ctx - window)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    head = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    # q: [BLOCK_G, BLOCK_D] (rows >= GROUP are zero padding for tl.dot)
    q = tl.load(q_ptr + seq * stride_qs + head[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    # running max starts at a finite "-inf": exp2(m - m_new) then never computes inf - inf; the first
    # split starts from the sinks
    m, l = _sink_start(sinks_ptr, head, g_mask, HAS_SINKS, BLOCK_G)
    if HAS_SINKS:
        m = tl.where(split == 0, m, -1.0e30)
        l = tl.where(split == 0, l, 0.0)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row_ptr = block_tables_ptr + seq * stride_bt
    for tile in range(start, end, TILE_N):
        tok = tile + tl.arange(0, TILE_N)
        tok_mask = tok < end
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, bt_row_ptr, tok, tok_mask, kv_head,
                             d, d_mask, q, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, KV8)
        # s: [BLOCK_G, TILE_N]
        if USE_DOT:
            s = _dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST)
        else:
            s = tl.sum(q[:, None, :].to(tl.float32) * k[None, :, :].to(tl.float32), axis=2)
        s = tl.where(tok_mask[None, :], _scores(s, scale, softcap, SOFTCAP), float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        if USE_DOT:
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
        else:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :].to(tl.float32), axis=1)
        m = m_new

    l_safe = tl.where(l > 0.0, l, 1.0)  # l == 0: empty split (or context_len 0) -> zeros
    o = acc / l_safe[:, None]
    mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        # part_out: [num_seqs, num_heads, num_splits, HEAD_DIM] fp32; part_lse: [num_seqs, num_heads, num_splits]
        row = (seq * NUM_KV_HEADS * GROUP + head) * num_splits + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], o, mask=mask)
        lse = tl.where(l > 0.0, m + tl.log2(l_safe), float("-inf"))  # base-2 log-sum-exp
        tl.store(part_lse_ptr + row, lse, mask=g_mask)
    else:
        tl.store(out_ptr + seq * stride_os + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_splits, stride_os, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
):
    # merge the splits of one (sequence, head) by their log-sum-exp
    seq = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, BLOCK_SPLITS)
    d = tl.arange(0, BLOCK_D)
    sp_mask = sp < num_splits
    row = (seq * NUM_HEADS + head) * num_splits + sp
    # lse: [BLOCK_SPLITS]; o: [BLOCK_SPLITS, BLOCK_D]
    lse = tl.load(part_lse_ptr + row, mask=sp_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp2(lse - lse_max)
    o = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :],
                mask=sp_mask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    w_sum = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(w_sum > 0.0, w_sum, 1.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, context_lens_ptr, sinks_ptr,
    k_scale_ptr, v_scale_ptr, out_ptr, scale, softcap, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr, KV8: tl.constexpr,
):
    # one program: BLOCK_Q query tokens of one sequence x the GROUP query heads of one kv head,
    # packed as the BLOCK_M rows of the tile (row r: token r // GROUP, head r % GROUP)
    q_tile = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first = q_tile * BLOCK_Q
    if first >= q_len:  # grid is sized by max_query_len
        return
    ctx = tl.load(context_lens_ptr + seq)

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    qi = first + r // GROUP
    head = kv_head * GROUP + r % GROUP
    row_mask = (r < BLOCK_Q * GROUP) & (qi < q_len)
    d_mask = d < HEAD_DIM
    q_pos = ctx - q_len + qi  # the query tokens are the last q_len of the context
    tok_row = (q_start + qi).to(tl.int64)
    # q: [BLOCK_M, BLOCK_D]
    q = tl.load(q_ptr + tok_row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)

    m, l = _sink_start(sinks_ptr, head, row_mask, HAS_SINKS, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row_ptr = block_tables_ptr + seq * stride_bt
    kv_end = ctx - q_len + tl.minimum(first + BLOCK_Q, q_len)  # causal: nothing past the tile's last query
    kv_start = 0
    if HAS_WINDOW:  # nothing before the tile's first query's window
        kv_start = tl.maximum(ctx - q_len + first - window + 1, 0)
    for tile in range(kv_start, kv_end, TILE_N):
        tok = tile + tl.arange(0, TILE_N)
        tok_mask = tok < kv_end
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, bt_row_ptr, tok, tok_mask, kv_head,
                             d, d_mask, q, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, KV8)
        # s: [BLOCK_M, TILE_N]
        s = _dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST)
        visible = tok_mask[None, :] & (tok[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (tok[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, _scores(s, scale, softcap, SOFTCAP), float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
        m = m_new

    o = acc / tl.where(l > 0.0, l, 1.0)[:, None]
    tl.store(out_ptr + tok_row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


# --------------------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------------------


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_tensor(name: str, t, ndim: int, dtypes, device: torch.device) -> None:
    _check(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _check(t.dim() == ndim, f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    _check(t.dtype in dtypes, f"{name} must have dtype in {[str(x) for x in dtypes]}, got {t.dtype}")
    _check(t.device == device, f"{name} is on {t.device}, expected {device}")


def _check_cache(k_cache, v_cache, device: torch.device) -> tuple[int, int, int, int]:
    _check_tensor("k_cache", k_cache, 4, (*_DTYPES, *_KV8), device)
    _check_tensor("v_cache", v_cache, 4, (*_DTYPES, *_KV8), device)
    _check(k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype,
           f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache {tuple(v_cache.shape)} "
           f"{v_cache.dtype} must match")
    _check(k_cache.is_contiguous() and v_cache.is_contiguous(), "k_cache and v_cache must be contiguous")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    _check(block_size > 0 and block_size & (block_size - 1) == 0,
           f"block_size (k_cache.shape[1]) must be a power of two, got {block_size}")
    _check(unsupported(head_dim) is None, unsupported(head_dim) or "")
    return num_blocks, block_size, num_kv_heads, head_dim


def _kv8_args(k_cache, v_cache, k_scale, v_scale, like: torch.Tensor) -> tuple:
    """(k_cache, v_cache, k_scale, v_scale, KV8) as the kernels take them: fp8 as its bytes (int8), and for a
    16/32-bit cache (no scales) `like`, never read, as the scales."""
    kv8 = _KV8.get(k_cache.dtype, 0)
    _check((k_scale is not None) == (v_scale is not None) == bool(kv8),
           f"k_scale and v_scale go with an 8-bit cache (int8, fp8), and only with one; k_cache is {k_cache.dtype}")
    if not kv8:
        return k_cache, v_cache, like, like, 0
    shape = tuple(k_cache.shape[:3])
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        _check_tensor(name, t, 3, (torch.float32,), k_cache.device)
        _check(tuple(t.shape) == shape and t.is_contiguous(), f"{name} must be contiguous {list(shape)}")
    if kv8 == 2:
        k_cache, v_cache = k_cache.view(torch.int8), v_cache.view(torch.int8)
    return k_cache, v_cache, k_scale, v_scale, kv8


def _check_heads(q, num_kv_heads: int, head_dim: int, kind: str) -> int:
    num_heads = q.shape[1]
    _check(q.shape[2] == head_dim, f"q head_dim {q.shape[2]} != cache head_dim {head_dim}")
    _check(num_heads % num_kv_heads == 0,
           f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    group = num_heads // num_kv_heads
    _check(group <= 16, f"{kind}: at most 16 query heads per kv head are supported, got {group}")
    _check(q.stride(2) == 1, "q must be contiguous in its last dim")
    return group


def _check_out(out, like: torch.Tensor):
    if out is None:
        return torch.empty_like(like, memory_format=torch.contiguous_format)
    _check_tensor("out", out, like.dim(), (like.dtype,), like.device)
    _check(out.shape == like.shape, f"out shape {tuple(out.shape)} must be {tuple(like.shape)}")
    _check(out.stride(-1) == 1, "out must be contiguous in its last dim")
    return out


def _check_int(name: str, x) -> int:
    # a tensor here would need a host sync; sizes come as Python ints
    _check(not isinstance(x, torch.Tensor) and int(x) == x, f"{name} must be a Python int, got {x!r}")
    return int(x)


def _check_block_tables(block_tables, context_lens, num_seqs: int, device: torch.device) -> None:
    _check_tensor("block_tables", block_tables, 2, (torch.int32,), device)
    _check_tensor("context_lens", context_lens, 1, (torch.int32,), device)
    _check(block_tables.shape[0] == num_seqs,
           f"block_tables has {block_tables.shape[0]} rows, expected num_seqs={num_seqs}")
    _check(block_tables.stride(1) == 1, "block_tables must be contiguous in its last dim")
    _check(context_lens.shape[0] == num_seqs and context_lens.is_contiguous(),
           f"context_lens must be contiguous with shape [{num_seqs}], got {tuple(context_lens.shape)}")


def _check_variant(variant: Variant, q: torch.Tensor) -> torch.Tensor:
    """The variant's sinks as the kernels read them (q itself, never read, where there are none)."""
    _check(variant.window >= 0 and variant.softcap >= 0, "window and softcap must be >= 0")
    if variant.sinks is None:
        return q
    _check_tensor("sinks", variant.sinks, 1, (torch.float32,), q.device)
    _check(variant.sinks.shape[0] == q.shape[1] and variant.sinks.is_contiguous(),
           f"sinks must be contiguous with one logit per query head ({q.shape[1]})")
    return variant.sinks


def _dot_args(dtype: torch.dtype) -> dict:
    return dict(
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",  # fp32: no TF32 truncation
        DOT_UPCAST=dtype == torch.bfloat16 and _interpreted(),
    )


def _interpreted() -> bool:
    return InterpretedFunction is not None and isinstance(_decode_kernel, InterpretedFunction)


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def _decode_warps(num_warps: int, dtype: torch.dtype, group: int, variant: Variant) -> int:
    # a variant's bounds and sinks hold registers too: float32 with a wide GQA group spread over more warps
    # (no register spills, checked for sm_90)
    return num_warps * 2 if dtype == torch.float32 and group > 4 and not variant.is_plain else num_warps


def _tile_n(tile_n: int, head_dim: int, dtype: torch.dtype, kv8: int = 0) -> int:
    # smaller [tile_n, head_dim] K/V tiles for wide heads, and for float32 ones widened from an 8-bit cache:
    # no register spills (checked for sm_90)
    if head_dim > 128:
        return tile_n // (4 if dtype == torch.float32 or kv8 else 2)
    if kv8 and dtype == torch.float32 and head_dim > 64:
        return tile_n // 4
    return tile_n


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # interpreter: any small number


# --------------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------------


MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256


def unsupported(head_dim: int) -> str | None:
    """Why these kernels cannot run a model with this head size (None: they can)."""
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        return f"head_dim must be in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {head_dim}"
    return None


def is_available(device: torch.device) -> tuple[bool, str]:
    """Whether these kernels can run on `device`, with the reason."""
    device = torch.device(device)
    if _TRITON_ERROR is not None:
        return False, f"triton is not importable: {_TRITON_ERROR}"
    interpreted = _interpreted()
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False, "CUDA is not available in this torch build or on this machine"
        if interpreted:
            return True, "triton interpreter (TRITON_INTERPRET=1): correct but very slow on CUDA tensors"
        return True, "triton on CUDA"
    if device.type == "cpu":
        if interpreted:
            return True, "triton interpreter on CPU (TRITON_INTERPRET=1), for tests only: slow"
        return False, ("triton kernels need a CUDA GPU; on CPU set TRITON_INTERPRET=1 in the environment "
                       "before importing pagoda.engine.layers.triton_attention to run them in Triton's interpreter")
    return False, f"triton kernels do not support device type {device.type!r}"


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
    """k_cache/v_cache[slot_mapping[t]] = k/v[t]; tokens with slot < 0 are skipped. An 8-bit cache takes
    k/v[t] / their scale per kv head, the scales going into k_scale/v_scale[slot_mapping[t]].

    k, v: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens] int32 or int64.
    Slots must be < num_blocks * block_size (not checked: that would need a host sync).
    """
    device = k_cache.device
    _, _, num_kv_heads, head_dim = _check_cache(k_cache, v_cache, device)
    for name, t in (("k", k), ("v", v)):
        _check_tensor(name, t, 3, _DTYPES if k_cache.dtype in _KV8 else (k_cache.dtype,), device)
        _check(tuple(t.shape[1:]) == (num_kv_heads, head_dim),
               f"{name} shape {tuple(t.shape)} must be [num_tokens, {num_kv_heads}, {head_dim}]")
        _check(t.stride(2) == 1, f"{name} must be contiguous in its last dim")
    num_tokens = k.shape[0]
    _check(v.shape[0] == num_tokens, f"k has {num_tokens} tokens, v has {v.shape[0]}")
    _check_tensor("slot_mapping", slot_mapping, 1, (torch.int32, torch.int64), device)
    _check(slot_mapping.shape[0] == num_tokens and slot_mapping.is_contiguous(),
           f"slot_mapping must be contiguous with shape [{num_tokens}], got {tuple(slot_mapping.shape)}")
    k_cache, v_cache, k_scale, v_scale, kv8 = _kv8_args(k_cache, v_cache, k_scale, v_scale, k)
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=_next_pow2(num_kv_heads), BLOCK_D=_next_pow2(head_dim), KV8=kv8,
    )


def decode_split_plan(num_seqs: int, num_kv_heads: int, max_context_len: int, num_sms: int,
                      num_splits: int | None = None) -> tuple[int, int]:
    """(num_splits, partition_size) for decode_attention: split each context into slices of
    partition_size tokens when there are too few (sequence, kv head) programs to fill the GPU."""
    max_context_len = max(1, max_context_len)
    if num_splits is None:
        want = math.ceil(_PROGRAMS_PER_SM * num_sms / max(1, num_seqs * num_kv_heads))
        num_splits = max(1, min(want, math.ceil(max_context_len / _MIN_PARTITION), _MAX_SPLITS))
        partition = math.ceil(max_context_len / num_splits / 64) * 64  # whole tiles per split
    else:
        partition = math.ceil(max_context_len / max(1, num_splits))
    return math.ceil(max_context_len / partition), partition


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     variant: Variant = PLAIN, max_context_len: int | None = None, out: torch.Tensor | None = None,
                     *, num_splits: int | None = None, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query token per sequence (the last token of its context) over its cache.

    q: [num_seqs, num_heads, head_dim]; block_tables: [num_seqs, max_blocks] int32 (-1 padded);
    context_lens: [num_seqs] int32, >= 1 (0 gives zeros). max_context_len: expected upper bound on
    context_lens (Python int; default block_tables width * block_size); it only sizes the split, a
    wrong value costs speed, not correctness.
    num_splits forces the number of KV splits (tests, tuning). k_scale, v_scale: an 8-bit cache's scales.
    Returns out: [num_seqs, num_heads, head_dim].
    """
    sinks = _check_variant(variant, q)
    device = q.device
    _, block_size, num_kv_heads, head_dim = _check_cache(k_cache, v_cache, device)
    _check_tensor("q", q, 3, _DTYPES if k_cache.dtype in _KV8 else (k_cache.dtype,), device)
    group = _check_heads(q, num_kv_heads, head_dim, "decode_attention")
    k_cache, v_cache, k_scale, v_scale, kv8 = _kv8_args(k_cache, v_cache, k_scale, v_scale, q)
    num_seqs, num_heads, _ = q.shape
    _check_block_tables(block_tables, context_lens, num_seqs, device)
    out = _check_out(out, q)
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * block_size
    max_context_len = _check_int("max_context_len", max_context_len)
    if num_splits is not None:
        num_splits = _check_int("num_splits", num_splits)
    if num_seqs == 0:
        return out

    num_splits, partition = decode_split_plan(num_seqs, num_kv_heads, max_context_len, _num_sms(device),
                                              num_splits)
    use_dot = group > 1  # GQA group as the M of a tl.dot, padded to 16 rows; MHA: a plain dot product
    split = num_splits > 1
    if split:
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=device)
    else:
        part_out = part_lse = out  # unused
    block_d = _next_pow2(head_dim)
    cfg = DECODE_CONFIG
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, sinks, k_scale, v_scale, out, part_out, part_lse,
        scale, variant.softcap, variant.window, partition, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, BLOCK_G=max(16, _next_pow2(group)) if use_dot else 1, NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size,
        TILE_N=_tile_n(cfg["tile_n"], head_dim, q.dtype, kv8),
        SPLIT=split, USE_DOT=use_dot, **_dot_args(q.dtype), HAS_WINDOW=variant.window > 0, SOFTCAP=variant.softcap > 0,
        HAS_SINKS=variant.sinks is not None, KV8=kv8,
        num_warps=_decode_warps(cfg["num_warps"], q.dtype, group, variant),
        num_stages=cfg["num_stages"],
    )
    if split:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, num_splits, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SPLITS=_next_pow2(num_splits),
        )
    return out


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                      context_lens: torch.Tensor, scale: float, max_query_len: int,
                      variant: Variant = PLAIN, out: torch.Tensor | None = None, *,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the last query_len_s tokens of each context over its cache.

    q: [num_tokens, num_heads, head_dim] flat over the batch; query_start_loc: [num_seqs + 1] int32
    (cumulative query lengths); context_lens: [num_seqs] int32 (>= query_len_s); block_tables:
    [num_seqs, max_blocks] int32 (-1 padded); max_query_len: Python int >= every query_len_s.
    Query lengths may be 1 (decode tokens in a mixed batch). k_scale, v_scale: an 8-bit cache's scales.
    Returns out: [num_tokens, num_heads, head_dim].
    """
    sinks = _check_variant(variant, q)
    device = q.device
    _, block_size, num_kv_heads, head_dim = _check_cache(k_cache, v_cache, device)
    _check_tensor("q", q, 3, _DTYPES if k_cache.dtype in _KV8 else (k_cache.dtype,), device)
    group = _check_heads(q, num_kv_heads, head_dim, "prefill_attention")
    k_cache, v_cache, k_scale, v_scale, kv8 = _kv8_args(k_cache, v_cache, k_scale, v_scale, q)
    _check_tensor("context_lens", context_lens, 1, (torch.int32,), device)
    num_seqs = context_lens.shape[0]
    _check_block_tables(block_tables, context_lens, num_seqs, device)
    _check_tensor("query_start_loc", query_start_loc, 1, (torch.int32,), device)
    _check(query_start_loc.shape[0] == num_seqs + 1 and query_start_loc.is_contiguous(),
           f"query_start_loc must be contiguous with shape [{num_seqs + 1}], got {tuple(query_start_loc.shape)}")
    max_query_len = _check_int("max_query_len", max_query_len)
    out = _check_out(out, q)
    if num_seqs == 0 or q.shape[0] == 0 or max_query_len <= 0:
        return out

    cfg = PREFILL_CONFIG
    # fp32 dots run on CUDA cores (no TF32), which need far more registers per row
    block_m = cfg["block_m"] // 4 if q.dtype == torch.float32 else cfg["block_m"]
    _check(block_m >= group, f"prefill block_m {block_m} must be >= the GQA group {group}")
    block_q = block_m // group
    grid = (triton.cdiv(max_query_len, block_q), num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, sinks, k_scale, v_scale, out,
        scale, variant.softcap, variant.window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_D=_next_pow2(head_dim), BLOCK_SIZE=block_size,
        TILE_N=_tile_n(cfg["tile_n"], head_dim, q.dtype, kv8),
        **_dot_args(q.dtype), HAS_WINDOW=variant.window > 0, SOFTCAP=variant.softcap > 0, HAS_SINKS=variant.sinks is not None,
        KV8=kv8, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out

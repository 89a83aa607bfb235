"""PagedAttention for CPU, through pagoda's C++ op (csrc/paged_attention_cpu.cpp): it reads K/V
blocks in place, for decode tokens and prefill chunks alike. The torch backend instead gathers
every sequence's blocks into a padded copy for SDPA, which on CPU costs more than the attention.
"""
import torch

from pagoda.engine.layers import cpu_ops as fused_ops  # norms, activation and rotary, for the model runner
from pagoda.engine.layers.attention import PLAIN, Variant, sdpa
from pagoda.engine.layers.cpu_ops import is_available, ops


def sdpa_min_tokens(head_dim: int) -> int | None:
    """A prompt computed from its first token (no cached prefix) of at least this many tokens goes
    to torch's flash attention for CPU instead of the op; None: never. The op takes a prompt's
    tokens in tiles that share each key and value it loads (4 tokens at head_dim 32, 2 at 64, 1
    at 128): on the tiny model's head_dim 32 it beats flash at every length (1.2-1.8x), at 64 up to
    512 tokens, at 128 (and head sizes it has no compiled-in loops for) only below ~96 tokens.
    Measured on one core against SDPA on the prompt's own contiguous K/V (notes/kernels.md)."""
    if head_dim == 32:
        return None
    return 1024 if head_dim == 64 else 64


def cache_views(k_cache, v_cache):
    """The op's layout of a layer's cache, over the same memory as the standard
    [num_blocks, block_size, num_kv_heads, head_dim]: keys [num_blocks, num_kv_heads, head_dim,
    block_size] (transposed, so a block's scores vectorize over its keys), values [num_blocks,
    num_kv_heads, block_size, head_dim]."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    return (k_cache.view(num_blocks, num_kv_heads, head_dim, block_size),
            v_cache.view(num_blocks, num_kv_heads, block_size, head_dim))


def scale_views(k_scale, v_scale):
    """The op's layout of an 8-bit cache's scales (engine/layers/attention.py quantize_kv), over the same memory
    as the standard [num_blocks, block_size, num_kv_heads]: [num_blocks, num_kv_heads, block_size], a block's
    keys' scales contiguous, as their scores are."""
    num_blocks, block_size, num_kv_heads = k_scale.shape
    return k_scale.view(num_blocks, num_kv_heads, block_size), v_scale.view(num_blocks, num_kv_heads, block_size)


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    # k, v: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens] int64 (< 0: skipped)
    ops().write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, variant: Variant = PLAIN,
                     k_scale=None, v_scale=None):
    # q: [num_seqs, num_heads, head_dim], one token per sequence -> out: same shape
    return ops().paged_attention(q, k_cache, v_cache, block_tables, None, context_lens, scale, False,
                                 *variant.op_args, k_scale, v_scale)


def prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, max_query_len,
                      variant: Variant = PLAIN, k_scale=None, v_scale=None):
    # q: [num_tokens, num_heads, head_dim] flat over sequences -> out: same shape
    least = sdpa_min_tokens(q.shape[2])
    if least is None or max_query_len < least or not variant.is_plain or k_scale is not None:  # 8-bit: the op only
        return ops().paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, False,
                                     *variant.op_args, k_scale, v_scale)
    starts, lens = query_start_loc.tolist(), context_lens.tolist()  # CPU tensors: no sync to pay
    fresh = [i for i, n in enumerate(lens) if starts[i + 1] - starts[i] == n >= least]
    if not fresh:
        return ops().paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale)
    out = torch.empty_like(q)
    rest = sorted(set(range(len(lens))) - set(fresh))
    if rest:
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in rest])
        sub_lens = torch.tensor([starts[i + 1] - starts[i] for i in rest])
        sub_start_loc = torch.cat([sub_lens.new_zeros(1), sub_lens.cumsum(0)]).to(torch.int32)
        out[rows] = ops().paged_attention(q[rows], k_cache, v_cache, block_tables[rest], sub_start_loc,
                                          context_lens[rest], scale)
    for i in fresh:
        a, b = starts[i], starts[i + 1]
        k, v = _sequence_kv(k_cache, v_cache, block_tables[i], b - a)
        o = sdpa(q[a:b].transpose(0, 1)[None], k[None], v[None], is_causal=True, scale=scale, enable_gqa=True)
        out[a:b] = o[0].transpose(0, 1)
    return out


def _sequence_kv(k_cache, v_cache, block_table, n: int):
    """One sequence's first n keys and values, contiguous: [num_kv_heads, n, head_dim] each."""
    _, num_kv_heads, head_dim, block_size = k_cache.shape
    num_blocks = -(-n // block_size)
    blocks = block_table[:num_blocks].long()
    k = k_cache[blocks].permute(1, 0, 3, 2).reshape(num_kv_heads, num_blocks * block_size, head_dim)
    v = v_cache[blocks].permute(1, 0, 2, 3).reshape(num_kv_heads, num_blocks * block_size, head_dim)
    return k[:, :n], v[:, :n]


__all__ = ["is_available", "fused_ops", "cache_views", "scale_views", "write_kv_cache", "decode_attention", "prefill_attention"]

"""PagedAttention for CPU, through pagoda's C++ op (csrc/paged_attention_cpu.cpp): it reads K/V
blocks in place, for decode tokens and prefill chunks alike. The torch backend instead gathers
every sequence's blocks into a padded copy for SDPA, which on CPU costs more than the attention.
The op tiles a prompt's consecutive tokens so that each key and value loaded serves several
queries: on whole prompts of 64-512 tokens it is faster than torch's flash attention for CPU
(measured with head_dim 32, 8 query and 4 KV heads), which would also need each prompt's K/V
copied out of the blocks.
"""
from engine.layers import cpu_ops as fused_ops  # norms, activation and rotary, for the model runner
from engine.layers.cpu_ops import is_available, ops


def cache_views(k_cache, v_cache):
    """The op's layout of a layer's cache, over the same memory as the standard
    [num_blocks, block_size, num_kv_heads, head_dim]: keys [num_blocks, num_kv_heads, head_dim,
    block_size] (transposed, so a block's scores vectorize over its keys), values [num_blocks,
    num_kv_heads, block_size, head_dim]."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    return (k_cache.view(num_blocks, num_kv_heads, head_dim, block_size),
            v_cache.view(num_blocks, num_kv_heads, block_size, head_dim))


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping):
    # k, v: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens] int64 (< 0: skipped)
    ops().write_kv_cache(k, v, k_cache, v_cache, slot_mapping)


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale):
    # q: [num_seqs, num_heads, head_dim], one token per sequence -> out: same shape
    return ops().paged_attention(q, k_cache, v_cache, block_tables, None, context_lens, scale)


def prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, max_query_len):
    # q: [num_tokens, num_heads, head_dim] flat over sequences -> out: same shape
    return ops().paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale)


__all__ = ["is_available", "fused_ops", "cache_views", "write_kv_cache", "decode_attention", "prefill_attention"]

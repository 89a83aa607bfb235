"""Attention over the paged KV cache: one interface, a torch implementation (CPU and CUDA).

The flat batch holds single-token queries first (decode), then multi-token ones (prefill
chunks). Each sequence's new tokens are the last ones of its context, and their K/V are
written into the cache before attention reads it back. A layer's Variant adds a sliding window,
soft-capped scores or sinks; every backend takes one.
"""
import dataclasses
import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Variant:
    """What a layer's attention adds to plain causal softmax attention (each as transformers defines it)."""
    window: int = 0  # a token sees the last `window` keys, its own included (Mistral's, Gemma's sliding window); 0: all
    softcap: float = 0.0  # scores -> softcap * tanh(scores / softcap), after the scale (Gemma 2); 0: none
    sinks: torch.Tensor | None = None  # [num_heads] float32: a learned logit each head's softmax also covers (gpt-oss)

    @property
    def is_plain(self) -> bool:
        return not (self.window or self.softcap or self.sinks is not None)

    @property
    def op_args(self) -> tuple:
        """pagoda's C++ op's window, softcap and sinks arguments."""
        return self.window, self.softcap, self.sinks


PLAIN = Variant()


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, a slot per new token
    num_decode_tokens: int  # the first num_decode_tokens tokens are single-token queries
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32, rows padded with -1
    decode_context_lens: torch.Tensor  # [num_decodes] int32
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] int32, into the prefill tokens
    prefill_context_lens: torch.Tensor  # [num_prefills] int32
    max_query_len: int
    max_context_len: int
    # (start, end, num_blocks): runs of decode sequences of similar length (sorted longest first),
    # so the torch path pads each run to its own longest context rather than the batch's
    decode_groups: tuple[tuple[int, int, int], ...] = ()
    # Models mixing sliding and full layers: every KV group's slots and tables (engine/core/block_manager.py
    # kv_groups; the fields above are the first group's); None with a single group
    group_slot_mapping: torch.Tensor | None = None  # [num_groups, num_tokens]
    group_decode_block_tables: torch.Tensor | None = None  # [num_groups, num_decodes, max_blocks]
    group_prefill_block_tables: torch.Tensor | None = None  # [num_groups, num_prefills, max_blocks]
    # Models with linear-attention layers (engine/layers/linear_attention.py): each sequence's state slot, and
    # where its tokens start (decodes included); None without such layers
    state_slots: torch.Tensor | None = None  # [num_seqs] int64
    query_start_loc: torch.Tensor | None = None  # [num_seqs + 1] int32
    state_resets: torch.Tensor | None = None  # [k] int64: slots of sequences starting now (cleared first)

    def of_group(self, group: int) -> "AttentionMetadata":
        """The step as the layers of KV group `group` see it: their slots and block tables."""
        return dataclasses.replace(self, slot_mapping=self.group_slot_mapping[group],
                                   decode_block_tables=self.group_decode_block_tables[group],
                                   prefill_block_tables=self.group_prefill_block_tables[group])


def flash_packs_without_avx512(capability: str, cpu_flags, dtype: torch.dtype) -> bool:
    """Whether torch's flash attention for CPU fails on inputs of this dtype: on a CPU with AMX for it,
    torch packs the K and V of long enough prompts for AMX with at::vec::pack_vnni2, which only its
    AVX-512 build of the kernel implements; its AVX2 and default builds (which ATEN_CPU_CAPABILITY=avx2
    or =default selects) raise "pack_vnni2 is only supported when avx512 is supported" instead.
    capability: torch.backends.cpu.get_cpu_capability(); cpu_flags: the CPU's, as Linux names them."""
    amx = {torch.bfloat16: "amx_bf16", torch.float16: "amx_fp16"}.get(dtype)
    return amx is not None and amx in cpu_flags and capability != "AVX512"


def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them; none elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), ()))
    except OSError:
        return frozenset()


@functools.cache
def _cpu_sdpa_dtype(dtype: torch.dtype) -> torch.dtype:
    capability = torch.backends.cpu.get_cpu_capability()
    if not flash_packs_without_avx512(capability, _cpu_flags(), dtype):
        return dtype
    log.info("torch runs its %s code on a CPU with AMX, where its %s attention fails: computing it in float32",
             capability, dtype)
    return torch.float32


def sdpa(q, k, v, **kwargs):
    """F.scaled_dot_product_attention; in float32 on a CPU where torch's kernel fails in q's dtype (float32
    never takes the AMX packing, and keeps flash attention's memory use, unlike the math backend)."""
    if q.device.type == "cpu" and _cpu_sdpa_dtype(q.dtype) != q.dtype:
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kwargs).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


# --kv-cache-dtype: the 8-bit caches. Each token's K (and V) of each KV head is stored as 8-bit values and
# one float32 scale, its absolute max / the format's largest value (no calibration; an outlier token or
# head costs only its own precision). auto: the model's dtype, no scales.
KV_CACHE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
_KV_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [num_tokens, num_kv_heads, head_dim] -> (values in dtype, same shape; scales [num_tokens, num_kv_heads]
    float32), x ~ values * scales (the C++ op's write computes the same bits)."""
    x = x.float()
    amax = x.abs().amax(-1)
    scale = torch.where(amax > 0, amax / _KV_MAX[dtype], 1.0)
    y = (x / scale[..., None]).clamp(-_KV_MAX[dtype], _KV_MAX[dtype])
    return (y.round() if dtype == torch.int8 else y).to(dtype), scale


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    # k, v: [num_tokens, num_kv_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim];
    # scales (8-bit caches): [num_blocks, block_size, num_kv_heads] float32
    if slot_mapping.device.type == "cpu":  # skip padding slots (< 0); on CUDA that check would sync
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    slots = slot_mapping.long()
    if k_scale is not None:  # copied as bytes: torch has no index_copy_ for fp8
        (k, ks), (v, vs) = (quantize_kv(x, k_cache.dtype) for x in (k, v))
        k_scale.view(-1, k_scale.shape[2]).index_copy_(0, slots, ks)
        v_scale.view(-1, v_scale.shape[2]).index_copy_(0, slots, vs)
        k, v, k_cache, v_cache = (x.view(torch.int8) for x in (k, v, k_cache, v_cache))
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, scale=None, dtype=None) -> torch.Tensor:
    # -> [num_seqs, max_blocks * block_size, num_kv_heads, head_dim]; padded entries read block 0.
    # An 8-bit cache comes back dequantized to `dtype` (scale: its [num_blocks, block_size, num_kv_heads]).
    num_seqs, index = block_tables.shape[0], block_tables.clamp(min=0).flatten().long()
    if scale is None:
        blocks = cache.index_select(0, index)  # faster than cache[tables]
    else:  # selected as bytes: torch has no index_select for fp8
        blocks = cache.view(torch.int8).index_select(0, index).view(cache.dtype)
        blocks = (blocks.float() * scale.index_select(0, index)[..., None]).to(dtype)
    return blocks.view(num_seqs, -1, *cache.shape[2:])


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, variant: Variant = PLAIN,
                     k_scale=None, v_scale=None):
    # q: [num_seqs, num_heads, head_dim] -> out: same shape
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    k = _gather(k_cache, block_tables, k_scale, q.dtype).transpose(1, 2)  # [S, kvh, L, D]
    v = _gather(v_cache, block_tables, v_scale, q.dtype).transpose(1, 2)
    k_pos = torch.arange(k.shape[2], device=q.device)[None, :]
    mask = k_pos < context_lens[:, None]  # [S, L]
    if variant.window:
        mask &= k_pos >= context_lens[:, None] - variant.window
    # A GQA group's query heads become that KV head's query rows: no K/V repeat needed.
    q = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    sinks = None if variant.sinks is None else variant.sinks.view(num_kv_heads, -1)[None, :, :, None]
    out = _attend(q, k, v, mask[:, None, None, :], scale, variant.softcap, sinks)
    return out.reshape(num_seqs, num_heads, head_dim)


def _attend(q, k, v, mask, scale, softcap: float = 0.0, sinks=None):
    """sdpa, or where a variant needs what it lacks (soft-capped scores, sinks) the same in plain torch,
    in float32. q: [..., Q, D], k, v: [..., L, D], mask: broadcast to [..., Q, L]; sinks: to [..., Q, 1]."""
    if not softcap and sinks is None:
        return sdpa(q, k, v, attn_mask=mask, scale=scale)
    scores = q.float() @ k.float().transpose(-1, -2) * scale  # [..., Q, L]
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks.float().expand(*scores.shape[:-1], 1)), dim=-1)
    p = torch.softmax(scores, dim=-1)[..., :k.shape[-2]]
    return (p @ v.float()).to(q.dtype)


def prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, max_query_len,
                      variant: Variant = PLAIN, k_scale=None, v_scale=None):
    # q: [num_tokens, num_heads, head_dim] flat over sequences -> out: same shape
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = context_lens.shape[0]
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    seq_idx = torch.repeat_interleave(torch.arange(num_seqs, device=q.device), query_lens, output_size=num_tokens)
    local_idx = torch.arange(num_tokens, device=q.device) - query_start_loc[seq_idx]
    q_pad = q.new_zeros(num_seqs, max_query_len, num_heads, head_dim)
    q_pad[seq_idx, local_idx] = q
    k = _gather(k_cache, block_tables, k_scale, q.dtype).transpose(1, 2)  # [S, kvh, L, D]
    v = _gather(v_cache, block_tables, v_scale, q.dtype).transpose(1, 2)
    q_pos = (context_lens - query_lens)[:, None] + torch.arange(max_query_len, device=q.device)  # [S, Q]
    k_pos = torch.arange(k.shape[2], device=q.device)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [S, Q, L]; padded query rows see >= 1 key
    if variant.window:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - variant.window
    if variant.is_plain:
        out = sdpa(q_pad.transpose(1, 2), k, v, attn_mask=mask[:, None], scale=scale,
                   enable_gqa=num_heads != k.shape[1])
    else:  # the GQA group's query heads as rows of their KV head, as in decode
        num_kv_heads, group = k.shape[1], num_heads // k.shape[1]
        qg = q_pad.view(num_seqs, max_query_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        sinks = None if variant.sinks is None else variant.sinks.view(num_kv_heads, group)[None, :, :, None, None]
        out = _attend(qg.reshape(num_seqs, num_kv_heads, group * max_query_len, head_dim), k, v,
                      mask[:, None].repeat(1, 1, group, 1), scale, variant.softcap,
                      None if sinks is None else sinks.expand(-1, -1, -1, max_query_len, -1).reshape(
                          1, num_kv_heads, group * max_query_len, 1))
        out = out.view(num_seqs, num_kv_heads, group, max_query_len, head_dim).permute(0, 3, 1, 2, 4)
        return out.reshape(num_seqs, max_query_len, num_heads, head_dim)[seq_idx, local_idx]
    return out.transpose(1, 2)[seq_idx, local_idx]


class Attention(nn.Module):
    """Writes this step's K/V into the layer's cache, then attends over the cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, variant: Variant = PLAIN):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.variant = variant
        self.k_cache = self.v_cache = torch.empty(0)  # bound by the model runner
        self.k_scale = self.v_scale = None  # an 8-bit cache's scales (KV_CACHE_DTYPES), bound with it
        self.kv_group = 0  # the KV group whose block tables map its cache (set with the cache)
        self.backend = TORCH_BACKEND

    def forward(self, q, k, v, meta: AttentionMetadata):
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        b = self.backend
        if self.kv_group:
            meta = meta.of_group(self.kv_group)
        kv = {} if self.k_scale is None else dict(k_scale=self.k_scale, v_scale=self.v_scale)
        b.write_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping, **kv)
        nd = meta.num_decode_tokens
        groups = meta.decode_groups if b is TORCH_BACKEND and meta.decode_groups else ((0, nd, None),)
        extra = () if self.variant.is_plain else (self.variant,)
        if nd == q.shape[0] and len(groups) == 1:  # decodes only, one call: its output is the layer's
            return b.decode_attention(q, self.k_cache, self.v_cache, meta.decode_block_tables,
                                      meta.decode_context_lens, self.scale, *extra, **kv)
        out = torch.empty_like(q)
        for start, end, width in groups if nd else ():
            out[start:end] = b.decode_attention(q[start:end], self.k_cache, self.v_cache,
                                                meta.decode_block_tables[start:end, :width],
                                                meta.decode_context_lens[start:end], self.scale, *extra, **kv)
        if nd == q.shape[0]:
            return out
        out[nd:] = b.prefill_attention(q[nd:], self.k_cache, self.v_cache, meta.prefill_block_tables,
                                       meta.prefill_query_start_loc, meta.prefill_context_lens, self.scale,
                                       meta.max_query_len, *extra, **kv)
        return out


class _TorchBackend:
    write_kv_cache = staticmethod(write_kv_cache)
    decode_attention = staticmethod(decode_attention)
    prefill_attention = staticmethod(prefill_attention)


TORCH_BACKEND = _TorchBackend()

"""Triton PagedAttention kernels against a float64 dense reference (and the engine's torch version).

Without CUDA the kernels run in Triton's interpreter on CPU: TRITON_INTERPRET must be set before
the kernels module is imported (triton reads it when @triton.jit decorates), so it is set here.
"""
import importlib
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
from grpc_fixtures import REPO  # noqa: E402
from pagoda.engine.layers import triton_attention as ta  # noqa: E402

if not torch.cuda.is_available() and not ta.is_available(torch.device("cpu"))[0]:
    ta = importlib.reload(ta)  # imported earlier in this session without the interpreter

DEVICE = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")
_ok, _why = ta.is_available(DEVICE)
pytestmark = pytest.mark.skipif(not _ok, reason=_why)

try:
    from pagoda.engine.layers import attention as torch_attn
except ImportError:
    torch_attn = None

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
NAN = float("nan")

# (dtype, head_dim, num_kv_heads, group, block_size): every dtype, head_dim, GQA ratio and block size
CASES = [
    (torch.float32, 64, 2, 1, 8),
    (torch.float32, 80, 1, 2, 16),
    (torch.bfloat16, 96, 2, 4, 32),
    (torch.float16, 128, 1, 8, 16),
    (torch.bfloat16, 256, 1, 2, 8),
    (torch.float16, 64, 2, 3, 32),
    (torch.bfloat16, 128, 2, 1, 16),
    (torch.float32, 256, 1, 4, 32),
    (torch.float16, 80, 1, 6, 64),
    (torch.bfloat16, 64, 1, 7, 8),
    (torch.float32, 96, 2, 8, 16),
    (torch.float16, 256, 2, 1, 16),
]
CASE_IDS = [f"{str(c[0])[6:]}-d{c[1]}-kv{c[2]}-g{c[3]}-bs{c[4]}" for c in CASES]


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA device (compiled Triton)")
@pytest.mark.parametrize("num_splits", [1, 4])
def test_gpu_cuda_graph(num_splits):
    # the wrappers never sync with the host, so write + decode can be captured once and replayed
    # with new values in the same tensors
    dtype, num_heads, num_kv_heads, head_dim, block_size = torch.bfloat16, 32, 8, 128, 16
    gen = torch.Generator().manual_seed(10)
    lens = [300, 2000, 17, 1024]
    # blocks for two more tokens each; the slots past each context start as NaN-free random filler
    k_cache, v_cache, bt, _ = make_cache([n + 2 for n in lens], block_size, num_kv_heads, head_dim, dtype, gen)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = make_q(len(lens), num_heads, num_kv_heads, head_dim, dtype, gen)
    k_new = torch.randn(len(lens), num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    v_new = torch.randn_like(k_new)
    slot_mapping = torch.full((len(lens),), -1, dtype=torch.int64, device=DEVICE)
    out = torch.empty(q.shape, dtype=dtype, device=DEVICE)
    max_len = bt.shape[1] * block_size

    def step():
        ta.write_kv_cache(k_new, v_new, k_cache, v_cache, slot_mapping)
        ta.decode_attention(q, k_cache, v_cache, bt, ctx, 0.1, max_context_len=max_len, out=out, num_splits=num_splits)

    step()  # compiles the kernels
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(2):  # new token for every sequence, then replay
        lens = [n + 1 for n in lens]
        pos = torch.tensor(lens) - 1
        slots = bt.cpu()[torch.arange(len(lens)), pos // block_size].long() * block_size + pos % block_size
        slot_mapping.copy_(slots)
        ctx.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn(q.shape, generator=gen).to(dtype))
        k_new.copy_(torch.randn(k_new.shape, generator=gen).to(dtype))
        v_new.copy_(torch.randn(v_new.shape, generator=gen).to(dtype))
        out.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        ref = reference(q, k_cache, v_cache, bt, [1] * len(lens), lens, 0.1)
        assert rel_err(out, ref) < TOL[dtype]


def make_cache(context_lens, block_size, num_kv_heads, head_dim, dtype, gen, spare_blocks=3):
    """Caches filled with random K/V where a sequence owns the slot, NaN everywhere else; block tables
    over a random permutation of the physical blocks, rows padded with -1 (plus one extra -1 column)."""
    blocks_per_seq = [math.ceil(c / block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    bt = torch.full((len(context_lens), max(blocks_per_seq) + 1), -1, dtype=torch.int32)
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    k_flat, v_flat = torch.full(shape, NAN, dtype=dtype), torch.full(shape, NAN, dtype=dtype)
    used = 0
    for s, (ctx, nb) in enumerate(zip(context_lens, blocks_per_seq)):
        bt[s, :nb] = perm[used:used + nb].int()
        used += nb
        pos = torch.arange(ctx)
        slots = bt[s, pos // block_size].long() * block_size + pos % block_size
        k_flat[slots] = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        v_flat[slots] = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
    shape4 = (num_blocks, block_size, num_kv_heads, head_dim)
    ctx_t = torch.tensor(context_lens, dtype=torch.int32)
    return k_flat.view(shape4).to(DEVICE), v_flat.view(shape4).to(DEVICE), bt.to(DEVICE), ctx_t.to(DEVICE)


def make_q(num_tokens, num_heads, num_kv_heads, head_dim, dtype, gen, device=DEVICE):
    # q as the engine gets it: a strided view into a fused qkv projection output
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    return qkv.to(device)[:, :num_heads]


def reference(q, k_cache, v_cache, block_tables, query_lens, context_lens, scale):
    """Dense float64 attention: walk each block table, repeat kv heads, causal softmax.
    q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim] float64"""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    k_flat, v_flat = k_cache.flatten(0, 1).double(), v_cache.flatten(0, 1).double()
    outs, start = [], 0
    for s, (q_len, ctx) in enumerate(zip(query_lens, context_lens)):
        pos = torch.arange(ctx, device=q.device)
        slots = block_tables[s, pos // block_size].long() * block_size + pos % block_size
        k = k_flat[slots].repeat_interleave(group, dim=1)  # [ctx, num_heads, head_dim]
        v = v_flat[slots].repeat_interleave(group, dim=1)
        qs = q[start:start + q_len].double()
        start += q_len
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        q_pos = ctx - q_len + torch.arange(q_len, device=q.device)
        scores = scores.masked_fill(pos[None, :] > q_pos[:, None], float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)


def rel_err(out, ref):
    assert torch.isfinite(out).all(), "output has non-finite values (unwritten element or wrong slot read)"
    return ((out.double() - ref).norm() / ref.norm()).item()


def cu_seqlens(query_lens, device=DEVICE):
    return torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32, device=device)


def run_decode(case, context_lens, num_splits, seed=0):
    dtype, head_dim, num_kv_heads, group, block_size = case
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, bt, ctx = make_cache(context_lens, block_size, num_kv_heads, head_dim, dtype, gen)
    q = make_q(len(context_lens), num_kv_heads * group, num_kv_heads, head_dim, dtype, gen)
    scale = head_dim ** -0.5
    out = torch.full_like(q, NAN, memory_format=torch.contiguous_format)
    ret = ta.decode_attention(q, k_cache, v_cache, bt, ctx, scale, max_context_len=max(context_lens), out=out,
                              num_splits=num_splits)
    assert ret is out
    ref = reference(q, k_cache, v_cache, bt, [1] * len(context_lens), context_lens, scale)
    return out, ref, (q, k_cache, v_cache, bt, ctx, scale)


def run_prefill(case, context_lens, query_lens, seed=0):
    dtype, head_dim, num_kv_heads, group, block_size = case
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, bt, ctx = make_cache(context_lens, block_size, num_kv_heads, head_dim, dtype, gen)
    q = make_q(sum(query_lens), num_kv_heads * group, num_kv_heads, head_dim, dtype, gen)
    qsl = cu_seqlens(query_lens)
    scale = head_dim ** -0.5
    out = torch.full_like(q, NAN, memory_format=torch.contiguous_format)
    ret = ta.prefill_attention(q, k_cache, v_cache, bt, qsl, ctx, scale, max(query_lens), out=out)
    assert ret is out
    ref = reference(q, k_cache, v_cache, bt, query_lens, context_lens, scale)
    return out, ref, (q, k_cache, v_cache, bt, qsl, ctx, scale, max(query_lens))


# --------------------------------------------------------------------------------------------------
# write_kv_cache
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_write_kv_cache(dtype, slot_dtype):
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, num_kv_heads, head_dim = 6, 8, 3, 80
    num_tokens = 11
    kv = torch.randn(num_tokens, 2 * num_kv_heads + 1, head_dim, generator=gen).to(dtype).to(DEVICE)
    k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads:2 * num_kv_heads]  # strided views
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1  # padding tokens
    slot_mapping = slots.to(slot_dtype).to(DEVICE)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    k_want, v_want = k_cache.clone().flatten(0, 1), v_cache.clone().flatten(0, 1)
    keep = slots >= 0
    k_want[slots[keep]] = k[keep.to(DEVICE)]
    v_want[slots[keep]] = v[keep.to(DEVICE)]

    ta.write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache.flatten(0, 1), k_want)
    assert torch.equal(v_cache.flatten(0, 1), v_want)


def test_write_kv_cache_all_skipped_and_empty():
    k_cache = torch.zeros(2, 8, 1, 64, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k = torch.ones(3, 1, 64, device=DEVICE)
    ta.write_kv_cache(k, k, k_cache, v_cache, torch.full((3,), -1, dtype=torch.int64, device=DEVICE))
    ta.write_kv_cache(k[:0], k[:0], k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert not k_cache.any() and not v_cache.any()


# --------------------------------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------------------------------


def boundary_lens(block_size):
    return [1, block_size - 1, block_size, block_size + 1, 70]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_decode(case, num_splits):
    lens = boundary_lens(case[4])
    # the forced plan really splits the 70 tokens that many ways
    assert ta.decode_split_plan(len(lens), case[2], max(lens), 8, num_splits)[0] == num_splits
    out, ref, _ = run_decode(case, lens, num_splits)
    assert rel_err(out, ref) < TOL[case[0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_auto_split(dtype):
    # 1 sequence x 1 kv head and a long block table: the default plan splits
    case = (dtype, 64, 1, 4, 16)
    lens = [700]
    assert ta.decode_split_plan(1, 1, max(lens), ta._num_sms(DEVICE))[0] > 1
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache, bt, ctx = make_cache(lens, 16, 1, 64, dtype, gen)
    q = make_q(1, 4, 1, 64, dtype, gen)
    out = ta.decode_attention(q, k_cache, v_cache, bt, ctx, 0.125)  # max_context_len from bt width
    ref = reference(q, k_cache, v_cache, bt, [1], lens, 0.125)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_decode_low_max_context_hint(num_splits):
    # a max_context_len below the real contexts sizes the splits badly but must not drop tokens
    case = (torch.float32, 64, 2, 2, 8)
    gen = torch.Generator().manual_seed(11)
    lens = [60, 9]
    k_cache, v_cache, bt, ctx = make_cache(lens, 8, 2, 64, torch.float32, gen)
    q = make_q(2, 4, 2, 64, torch.float32, gen)
    out = ta.decode_attention(q, k_cache, v_cache, bt, ctx, 0.1, max_context_len=20, num_splits=num_splits)
    assert rel_err(out, reference(q, k_cache, v_cache, bt, [1, 1], lens, 0.1)) < TOL[case[0]]


def test_decode_split_plan():
    sms = 132
    assert ta.decode_split_plan(256, 8, 4096, sms) == (1, 4096)  # plenty of programs already
    n, part = ta.decode_split_plan(1, 8, 32768, sms)
    assert n > 8 and n * part >= 32768 and (n - 1) * part < 32768
    n, part = ta.decode_split_plan(32, 8, 4096, sms)
    assert n >= 2 and part % 64 == 0
    assert ta.decode_split_plan(1, 1, 100, sms)[0] == 1  # too short to be worth splitting
    assert ta.decode_split_plan(2, 1, 70, sms, num_splits=8) == (8, 9)  # forced


def test_decode_context_zero_gives_zeros():
    # padded batch rows (e.g. for a CUDA graph) may carry context_len 0
    case = (torch.float32, 64, 1, 2, 8)
    gen = torch.Generator().manual_seed(4)
    k_cache, v_cache, bt, _ = make_cache([9, 5], 8, 1, 64, torch.float32, gen)
    ctx = torch.tensor([9, 0], dtype=torch.int32, device=DEVICE)
    q = make_q(2, 2, 1, 64, torch.float32, gen)
    for num_splits in (1, 2):
        out = ta.decode_attention(q, k_cache, v_cache, bt, ctx, 0.1, num_splits=num_splits)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        ref = reference(q[:1], k_cache, v_cache, bt, [1], [9], 0.1)
        assert rel_err(out[:1], ref) < TOL[case[0]]


# --------------------------------------------------------------------------------------------------
# prefill
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_prefill(case):
    bs = case[4]
    # (context_len, query_len): a whole prompt, chunks after a cached prefix (block boundaries
    # included), and single decode tokens mixed into the same batch
    seqs = [(70, 70), (45, 13), (bs + 1, bs), (bs, 1), (1, 1), (2 * bs - 1, bs - 1), (66, 1)]
    lens, qlens = zip(*seqs)
    out, ref, _ = run_prefill(case, list(lens), list(qlens))
    assert rel_err(out, ref) < TOL[case[0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_all_decode_tokens_matches_decode(dtype):
    case = (dtype, 128, 2, 4, 16)
    lens = boundary_lens(16)
    out_p, ref, (q, k_cache, v_cache, bt, qsl, ctx, scale, _) = run_prefill(case, lens, [1] * len(lens))
    out_d = ta.decode_attention(q, k_cache, v_cache, bt, ctx, scale, num_splits=2)
    assert rel_err(out_p, ref) < TOL[dtype]
    assert rel_err(out_d, ref) < TOL[dtype]


def test_write_then_prefill_then_decode():
    # the engine's sequence of calls: write a prompt's K/V, prefill over it, then write + decode one more
    dtype, block_size, num_kv_heads, group, head_dim = torch.float16, 16, 2, 2, 64
    gen = torch.Generator().manual_seed(9)
    prompt_lens = [20, 7]
    k_cache, v_cache, bt, _ = make_cache([n + 1 for n in prompt_lens], block_size, num_kv_heads, head_dim,
                                         dtype, gen)
    k_cache.fill_(NAN)
    v_cache.fill_(NAN)
    slots = torch.cat([bt[s, torch.arange(n + 1) // block_size].long() * block_size + torch.arange(n + 1) % block_size
                       for s, n in enumerate(prompt_lens)])
    prompt_idx = torch.cat([torch.arange(n) + sum(m + 1 for m in prompt_lens[:s]) for s, n in enumerate(prompt_lens)])
    last_idx = torch.tensor([sum(prompt_lens[:s + 1]) + s for s in range(len(prompt_lens))])
    k = make_q(len(slots), num_kv_heads, 0, head_dim, dtype, gen)
    v = make_q(len(slots), num_kv_heads, 0, head_dim, dtype, gen)

    ta.write_kv_cache(k[prompt_idx], v[prompt_idx], k_cache, v_cache, slots[prompt_idx].to(DEVICE))
    q = make_q(sum(prompt_lens), num_kv_heads * group, num_kv_heads, head_dim, dtype, gen)
    ctx = torch.tensor(prompt_lens, dtype=torch.int32, device=DEVICE)
    out = ta.prefill_attention(q, k_cache, v_cache, bt, cu_seqlens(prompt_lens), ctx, 0.125, max(prompt_lens))
    assert rel_err(out, reference(q, k_cache, v_cache, bt, prompt_lens, prompt_lens, 0.125)) < TOL[dtype]

    # next step: one new token each, its slot padded in the middle of the batch with a -1
    step_slots = torch.stack([slots[last_idx[0]], torch.tensor(-1), slots[last_idx[1]]]).to(DEVICE)
    step_k = torch.stack([k[last_idx[0]], k[0], k[last_idx[1]]])
    step_v = torch.stack([v[last_idx[0]], v[0], v[last_idx[1]]])
    ta.write_kv_cache(step_k, step_v, k_cache, v_cache, step_slots)
    lens = [n + 1 for n in prompt_lens]
    q1 = make_q(2, num_kv_heads * group, num_kv_heads, head_dim, dtype, gen)
    ctx1 = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out1 = ta.decode_attention(q1, k_cache, v_cache, bt, ctx1, 0.125, num_splits=2)
    assert rel_err(out1, reference(q1, k_cache, v_cache, bt, [1, 1], lens, 0.125)) < TOL[dtype]


# --------------------------------------------------------------------------------------------------
# the engine's torch implementation (another oracle), on a cache without NaN padding
# --------------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch_attn is None, reason="pagoda.engine.layers.attention not importable")
@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[3]], ids=[CASE_IDS[1], CASE_IDS[2], CASE_IDS[3]])
def test_against_torch_implementation(case):
    dtype = case[0]
    lens = [33, 1, case[4] + 1]
    out, ref, (q, k_cache, v_cache, bt, ctx, scale) = run_decode(case, lens, 2, seed=5)
    # the torch version reads whole blocks (and block 0 for padding), so it needs finite filler
    k_clean, v_clean = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    want = torch_attn.decode_attention(q, k_clean, v_clean, bt, ctx, scale)
    assert rel_err(out, want.double()) < 2 * TOL[dtype]

    seqs = [(40, 17), (9, 1), (case[4], case[4])]
    lens, qlens = map(list, zip(*seqs))
    out, ref, (q, k_cache, v_cache, bt, qsl, ctx, scale, mql) = run_prefill(case, lens, qlens, seed=6)
    want = torch_attn.prefill_attention(q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0), bt, qsl, ctx,
                                        scale, mql)
    assert rel_err(out, want.double()) < 2 * TOL[dtype]


# --------------------------------------------------------------------------------------------------
# argument checks and availability
# --------------------------------------------------------------------------------------------------


def test_argument_checks():
    gen = torch.Generator().manual_seed(7)
    k_cache, v_cache, bt, ctx = make_cache([5, 3], 8, 2, 64, torch.float32, gen)
    q = make_q(2, 4, 2, 64, torch.float32, gen)
    qsl = cu_seqlens([1, 1])
    with pytest.raises(ValueError, match="dtype"):
        ta.decode_attention(q.half(), k_cache, v_cache, bt, ctx, 0.1)
    with pytest.raises(ValueError, match="block_tables"):
        ta.decode_attention(q, k_cache, v_cache, bt.long(), ctx, 0.1)
    with pytest.raises(ValueError, match="context_lens"):
        ta.decode_attention(q, k_cache, v_cache, bt, ctx[:1], 0.1)
    with pytest.raises(ValueError, match="contiguous"):
        ta.decode_attention(q, k_cache.transpose(1, 2), v_cache.transpose(1, 2), bt, ctx, 0.1)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ta.decode_attention(q[:, :3], k_cache, v_cache, bt, ctx, 0.1)
    with pytest.raises(ValueError, match="max_context_len must be a Python int"):
        ta.decode_attention(q, k_cache, v_cache, bt, ctx, 0.1, max_context_len=ctx.max())
    with pytest.raises(ValueError, match="out shape"):
        ta.decode_attention(q, k_cache, v_cache, bt, ctx, 0.1, out=torch.empty(2, 4, 32, device=DEVICE))
    with pytest.raises(ValueError, match="max_query_len must be a Python int"):
        ta.prefill_attention(q, k_cache, v_cache, bt, qsl, ctx, 0.1, torch.tensor(1))
    with pytest.raises(ValueError, match="query_start_loc"):
        ta.prefill_attention(q, k_cache, v_cache, bt, qsl[:2], ctx, 0.1, 1)
    with pytest.raises(ValueError, match="slot_mapping"):
        ta.write_kv_cache(q[:, :2], q[:, :2], k_cache, v_cache, torch.zeros(2, dtype=torch.float32))
    with pytest.raises(ValueError, match="k shape"):
        ta.write_kv_cache(q, q, k_cache, v_cache, torch.zeros(2, dtype=torch.int64, device=DEVICE))
    bad = torch.empty(2, 12, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="power of two"):
        ta.decode_attention(q, bad, bad, bt, ctx, 0.1)


def test_is_available():
    ok, why = ta.is_available(DEVICE)
    assert ok and why
    ok, why = ta.is_available(torch.device("meta"))
    assert not ok and "meta" in why


def test_is_available_cpu_without_interpreter():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import torch; from pagoda.engine.layers.triton_attention import is_available; "
            "print(is_available(torch.device('cpu')))")
    root = REPO
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("(False,") and "TRITON_INTERPRET=1" in res.stdout


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_compiles_for_hopper_without_spills(dtype):
    # the interpreter checks the math, not that the kernels compile for a GPU: compile every variant
    # for sm_90 with triton's bundled ptxas (no GPU needed) and check registers do not spill
    if not (Path(triton.__file__).parent / "backends/nvidia/bin/ptxas").exists():
        pytest.skip("triton's bundled ptxas is missing")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = REPO
    res = subprocess.run([sys.executable, "benchmarks/kernels.py", "--compile-only", "--dtype", dtype],
                         env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "0 failed or spilled" in res.stdout


# --------------------------------------------------------------------------------------------------
# bigger shapes on a GPU
# --------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA device (compiled Triton)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(32, 8, 128), (16, 8, 128), (16, 16, 64), (8, 1, 256)])
def test_gpu_large(dtype, num_heads, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(8)
    block_size = 16
    lens = [1, 15, 16, 17, 1000, 4097, 2500, 300]
    k_cache, v_cache, bt, ctx = make_cache(lens, block_size, num_kv_heads, head_dim, dtype, gen)
    scale = head_dim ** -0.5
    q = make_q(len(lens), num_heads, num_kv_heads, head_dim, dtype, gen)
    ref = reference(q, k_cache, v_cache, bt, [1] * len(lens), lens, scale)
    for num_splits in (None, 1, 7):
        out = ta.decode_attention(q, k_cache, v_cache, bt, ctx, scale, num_splits=num_splits)
        assert rel_err(out, ref) < TOL[dtype]

    qlens = [1, 15, 16, 1, 513, 97, 2500, 1]
    qp = make_q(sum(qlens), num_heads, num_kv_heads, head_dim, dtype, gen)
    qsl = cu_seqlens(qlens)
    out = ta.prefill_attention(qp, k_cache, v_cache, bt, qsl, ctx, scale, max(qlens))
    ref = reference(qp, k_cache, v_cache, bt, qlens, lens, scale)
    assert rel_err(out, ref) < TOL[dtype]


# --------------------------------------------------------------------------------------------------
# attention variants: sliding window, soft-capped scores, sinks (the torch reference is held to their
# definition in tests/engine/layers/test_cpu_ops.py)
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["window", "softcap", "sinks", "all"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_variants_match_the_torch_reference(variant, num_splits):
    g = torch.Generator().manual_seed(5)
    num_kv_heads, group, head_dim, block_size = 2, 2, 64, 16
    window = 19 if variant in ("window", "all") else 0
    softcap = 2.5 if variant in ("softcap", "all") else 0.0
    sinks = torch.randn(num_kv_heads * group, generator=g) * 2 if variant in ("sinks", "all") else None
    var = torch_attn.Variant(window, softcap, None if sinks is None else sinks.to(DEVICE))
    k_cache = torch.randn(48, block_size, num_kv_heads, head_dim, generator=g).to(DEVICE)
    v_cache = torch.randn(48, block_size, num_kv_heads, head_dim, generator=g).to(DEVICE)
    shapes = [(1, 1), (1, 70), (1, 33), (20, 20), (6, 45), (40, 40)]  # (new tokens, context)
    lens = torch.tensor([c for _, c in shapes], dtype=torch.int32, device=DEVICE)
    bt = torch.full((len(shapes), 5), -1, dtype=torch.int32)
    perm, at = torch.randperm(48, generator=g), 0
    for i, (_, c) in enumerate(shapes):
        n = -(-c // block_size)
        bt[i, :n] = perm[at:at + n].to(torch.int32)
        at += n
    bt = bt.to(DEVICE)
    qlens = [n for n, _ in shapes]
    qsl = torch.tensor([0] + qlens, dtype=torch.int64).cumsum(0).to(torch.int32).to(DEVICE)
    q = torch.randn(sum(qlens), num_kv_heads * group, head_dim, generator=g).to(DEVICE)
    want = torch_attn.prefill_attention(q, k_cache, v_cache, bt, qsl, lens, 0.3, max(qlens), var)
    got = ta.prefill_attention(q, k_cache, v_cache, bt, qsl, lens, 0.3, max(qlens), var)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    want_d = torch_attn.decode_attention(q[:3], k_cache, v_cache, bt[:3], lens[:3], 0.3, var)
    got_d = ta.decode_attention(q[:3], k_cache, v_cache, bt[:3], lens[:3], 0.3, var, num_splits=num_splits)
    torch.testing.assert_close(got_d, want_d, atol=1e-4, rtol=1e-4)
    if window:  # the blocks before every window are never read: -1 there changes nothing
        bt[1, :2] = -1
        again = ta.decode_attention(q[:3], k_cache, v_cache, bt[:3], lens[:3], 0.3, var, num_splits=num_splits)
        torch.testing.assert_close(again, got_d, atol=0, rtol=0)

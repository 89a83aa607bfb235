"""pagoda's C++ CPU ops against the plain torch code they replace: paged attention (decode and
prefill over a cached context, ragged lengths, scattered blocks, GQA), the cache write in the ops'
own block layout, and the fused RMSNorm / SiLU-and-mul / rotary layers."""
import random

import pytest
import torch

from grpc_fixtures import REPO
from pagoda.engine.layers import attention as ref
from pagoda.engine.layers import cpu_attention, cpu_ops
from pagoda.engine.layers.rotary import RotaryEmbedding, apply_rotary
from pagoda.engine.models.llama import RMSNorm

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}


@pytest.fixture(scope="module", autouse=True)
def built():
    ok, why = cpu_ops.is_available("cpu")
    assert ok, why  # CI has a compiler: a failed build must fail here, not fall back silently


def _cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, seed=0):
    """Random K/V in the standard layout, copied into the ops' layout through their own write."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    k_ops, v_ops = cpu_attention.cache_views(torch.empty_like(k), torch.empty_like(v))
    slots = torch.arange(num_blocks * block_size)
    cpu_attention.write_kv_cache(k.view(-1, num_kv_heads, head_dim), v.view(-1, num_kv_heads, head_dim),
                                 k_ops, v_ops, slots)
    return (k, v), (k_ops, v_ops)


def _tables(context_lens, block_size, num_blocks, seed=0):
    """Each sequence gets distinct blocks, scattered over the cache; rows padded with -1."""
    rng = random.Random(seed)
    need = [-(-n // block_size) for n in context_lens]
    ids = rng.sample(range(num_blocks), sum(need))
    width = max(need)
    tables = torch.full((len(context_lens), width), -1, dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(ids[at:at + n], dtype=torch.int32)
        at += n
    return tables


CASES = [  # dtype, head_dim, num_heads, num_kv_heads, block_size
    (torch.float32, 32, 8, 4, 16),
    (torch.float32, 64, 8, 8, 16),
    (torch.float32, 128, 16, 2, 16),
    (torch.float32, 64, 6, 2, 16),  # an odd group: its query heads go through one at a time
    (torch.float32, 48, 6, 3, 8),  # a head size with no compiled-in specialisation
    (torch.float32, 80, 4, 1, 32),
    (torch.bfloat16, 64, 8, 2, 16),
    (torch.float16, 128, 4, 4, 16),
]


@pytest.mark.parametrize("dtype,head_dim,num_heads,num_kv_heads,block_size", CASES)
def test_decode_attention_matches_torch(dtype, head_dim, num_heads, num_kv_heads, block_size):
    context_lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 70, 2]
    num_blocks = 64
    (k, v), (k_ops, v_ops) = _cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    tables = _tables(context_lens, block_size, num_blocks)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    q = torch.randn(len(context_lens), num_heads, head_dim).to(dtype)
    got = cpu_attention.decode_attention(q, k_ops, v_ops, tables, lens, head_dim ** -0.5)
    want = ref.decode_attention(q, k, v, tables, lens, head_dim ** -0.5)
    assert got.shape == q.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_peaked_attention_matches_torch():
    """Scores hundreds apart (an attention sink): weights below e^-80 of the row's max are flushed to 0
    (subnormal products cost Intel cores a microcode assist each), which no float32 output can show."""
    context_lens = [40, 70]
    (k, v), (k_ops, v_ops) = _cache(16, 16, 2, 64, torch.float32)
    tables = _tables(context_lens, 16, 16)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(0)) * 100
    got = cpu_attention.decode_attention(q, k_ops, v_ops, tables, lens, 64 ** -0.5)
    want = ref.decode_attention(q, k, v, tables, lens, 64 ** -0.5)
    # scores 100x the usual size carry 100x the rounding (summed in another order than torch's): two keys
    # scoring within a few units of each other split their weight ~1e-4 differently (seen: up to 9e-5 in
    # 300 draws, 2.7% of them past the usual 2e-5); a wrong softmax would be off by O(1)
    torch.testing.assert_close(got, want, atol=5e-4, rtol=5e-4)


@pytest.mark.parametrize("min_work", [0, 1 << 40], ids=["split-over-threads", "one-thread"])
def test_small_calls_run_on_one_thread_with_the_same_result(min_work):
    """Calls below the work threshold run on one thread (a single stream's decode); both ways agree."""
    dtype, head_dim, num_heads, num_kv_heads, block_size = CASES[0]
    context_lens = [5, 40, 17]
    (k, v), (k_ops, v_ops) = _cache(64, block_size, num_kv_heads, head_dim, dtype)
    tables = _tables(context_lens, block_size, 64)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    q = torch.randn(len(context_lens), num_heads, head_dim).to(dtype)
    want = ref.decode_attention(q, k, v, tables, lens, head_dim ** -0.5)
    cpu_ops.ops().set_attention_min_work(min_work)
    try:
        got = cpu_attention.decode_attention(q, k_ops, v_ops, tables, lens, head_dim ** -0.5)
    finally:
        cpu_ops.ops().set_attention_min_work(1 << 18)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype,head_dim,num_heads,num_kv_heads,block_size", CASES)
def test_prefill_attention_over_a_cached_context_matches_torch(dtype, head_dim, num_heads, num_kv_heads,
                                                               block_size):
    # (new tokens, context including them): a fresh prompt, chunks after a cached prefix, single tokens
    # (prompt tokens go through the op in tiles, with remainders; whole prompts of sdpa_min_tokens or
    # more through torch's flash attention: 65 and 80 tokens at head sizes other than 32 and 64)
    shapes = [(20, 20), (5, 37), (80, 80), (1, 9), (block_size, 2 * block_size), (33, 33), (1, 1), (65, 65)]
    num_blocks = 96
    (k, v), (k_ops, v_ops) = _cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, seed=1)
    tables = _tables([c for _, c in shapes], block_size, num_blocks, seed=1)
    lens = torch.tensor([c for _, c in shapes], dtype=torch.int32)
    query_lens = torch.tensor([n for n, _ in shapes])
    start_loc = torch.cat([torch.zeros(1, dtype=torch.int64), query_lens.cumsum(0)]).to(torch.int32)
    q = torch.randn(int(query_lens.sum()), num_heads, head_dim).to(dtype)
    got = cpu_attention.prefill_attention(q, k_ops, v_ops, tables, start_loc, lens, 0.2, int(query_lens.max()))
    want = ref.prefill_attention(q, k, v, tables, start_loc, lens, 0.2, int(query_lens.max()))
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


AMX = {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}


@pytest.mark.parametrize("capability,flags,dtype,fails", [
    ("AVX2", AMX, torch.bfloat16, True),  # ATEN_CPU_CAPABILITY=avx2 on a Xeon with AMX
    ("DEFAULT", AMX, torch.bfloat16, True),
    ("AVX512", AMX, torch.bfloat16, False),  # torch's own choice there: its AVX-512 build packs
    ("AVX2", AMX, torch.float16, False),  # float16 packs only with AMX-FP16
    ("AVX2", AMX | {"amx_fp16"}, torch.float16, True),
    ("AVX2", AMX, torch.float32, False),  # float32 never packs
    ("AVX2", {"avx2", "avx512f", "avx512_bf16"}, torch.bfloat16, False),  # AVX-512 without AMX
    ("AVX2", {"avx2"}, torch.bfloat16, False),
])
def test_torch_flash_attention_fails_only_where_avx2_is_forced_on_amx(capability, flags, dtype, fails):
    assert ref.flash_packs_without_avx512(capability, frozenset(flags), dtype) is fails


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sdpa_in_half_precision_matches_float32(dtype):
    """Shapes torch's flash attention packs for AMX (64 tokens or more, whatever the thread count): with
    ATEN_CPU_CAPABILITY=avx2 on an AMX machine (test_the_avx2_path_on_an_avx512_machine) torch itself
    fails on them, pagoda's sdpa does not."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 128, 64, generator=g) for _ in range(3))
    mask = torch.rand(1, 1, 128, 128, generator=g) < 0.9
    mask[..., 0] = True
    q, k, v = (x.to(dtype) for x in (q, k, v))
    for kwargs in ({"is_causal": True}, {"attn_mask": mask}):
        want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kwargs)
        got = ref.sdpa(q, k, v, **kwargs)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_half_precision_attention_runs_in_float32_where_torch_flash_would_fail(monkeypatch):
    """Where torch's flash attention fails in bf16 (simulated: only an AMX machine with AVX2 forced shows
    the real error), both backends' SDPA calls, prefill and decode, take float32 instead."""
    import torch.nn.functional as F

    real = F.scaled_dot_product_attention

    def torch_on_amx_with_avx2_forced(q, *args, **kwargs):
        if q.dtype == torch.bfloat16:
            raise RuntimeError("pack_vnni2 is only supported when avx512 is supported")
        return real(q, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", torch_on_amx_with_avx2_forced)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(ref, "_cpu_flags", lambda: frozenset(AMX))
    ref._cpu_sdpa_dtype.cache_clear()
    try:
        dtype, head_dim, num_heads, num_kv_heads, block_size = torch.bfloat16, 128, 8, 2, 16
        shapes = [(80, 80), (5, 37), (65, 65), (1, 9)]  # 65 and 80 tokens: whole prompts through torch's flash
        (k, v), (k_ops, v_ops) = _cache(64, block_size, num_kv_heads, head_dim, dtype, seed=2)
        tables = _tables([c for _, c in shapes], block_size, 64, seed=2)
        lens = torch.tensor([c for _, c in shapes], dtype=torch.int32)
        query_lens = torch.tensor([n for n, _ in shapes])
        start_loc = torch.cat([torch.zeros(1, dtype=torch.int64), query_lens.cumsum(0)]).to(torch.int32)
        q = torch.randn(int(query_lens.sum()), num_heads, head_dim).to(dtype)
        got = cpu_attention.prefill_attention(q, k_ops, v_ops, tables, start_loc, lens, 0.1, 80)
        want = ref.prefill_attention(q, k, v, tables, start_loc, lens, 0.1, 80)
        assert got.dtype == want.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
        q = q[:len(shapes)]
        want = ref.decode_attention(q, k, v, tables, lens, 0.1)
        got = cpu_attention.decode_attention(q, k_ops, v_ops, tables, lens, 0.1)
        torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    finally:
        ref._cpu_sdpa_dtype.cache_clear()


def test_decode_padding_rows_give_zeros():
    (_, _), (k_ops, v_ops) = _cache(8, 16, 2, 32, torch.float32)
    q = torch.randn(3, 4, 32)
    tables = torch.tensor([[0, 1], [-1, -1], [2, -1]], dtype=torch.int32)
    out = cpu_attention.decode_attention(q, k_ops, v_ops, tables, torch.tensor([20, 0, 3], dtype=torch.int32), 0.1)
    assert torch.equal(out[1], torch.zeros(4, 32)) and out[[0, 2]].abs().sum() > 0


def test_write_skips_negative_slots_and_lands_where_attention_reads():
    num_blocks, block_size, kvh, d = 4, 16, 2, 32
    k_std, v_std = torch.zeros(num_blocks, block_size, kvh, d), torch.zeros(num_blocks, block_size, kvh, d)
    k_ops, v_ops = cpu_attention.cache_views(torch.zeros_like(k_std), torch.zeros_like(v_std))
    k, v = torch.randn(5, kvh, d), torch.randn(5, kvh, d)
    slots = torch.tensor([3, -1, 17, 63, -1])
    ref.write_kv_cache(k, v, k_std, v_std, slots)
    cpu_attention.write_kv_cache(k, v, k_ops, v_ops, slots)
    # the same memory read in the standard layout: keys transposed per block and head
    assert torch.equal(k_ops.permute(0, 3, 1, 2), k_std) and torch.equal(v_ops.permute(0, 2, 1, 3), v_std)
    assert k_std.view(-1, kvh, d)[[0, 1, 2, 4]].abs().sum() == 0  # nothing written where no slot pointed


def test_bad_inputs_raise_instead_of_reading_out_of_bounds():
    (_, _), (k_ops, v_ops) = _cache(4, 16, 2, 32, torch.float32)
    q = torch.randn(1, 4, 32)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_attention.decode_attention(q, k_ops, v_ops, torch.tensor([[0, 9]], dtype=torch.int32),
                                       torch.tensor([20], dtype=torch.int32), 0.1)
    with pytest.raises(RuntimeError, match="context length"):
        cpu_attention.decode_attention(q, k_ops, v_ops, torch.tensor([[0]], dtype=torch.int32),
                                       torch.tensor([17], dtype=torch.int32), 0.1)
    with pytest.raises(RuntimeError, match="slot"):
        cpu_attention.write_kv_cache(torch.randn(1, 2, 32), torch.randn(1, 2, 32), k_ops, v_ops, torch.tensor([64]))
    with pytest.raises(RuntimeError, match="dtype"):
        cpu_attention.decode_attention(q.double(), k_ops, v_ops, torch.tensor([[0]], dtype=torch.int32),
                                       torch.tensor([3], dtype=torch.int32), 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layers_match_the_torch_modules(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-6).to(dtype)
    norm.weight.data.normal_()
    for x in (torch.randn(37, 96).to(dtype), torch.randn(5, 3, 96).to(dtype)[:, 1]):  # also a strided view
        _assert_equalish(cpu_ops.rms_norm(x, norm.weight, 1e-6), norm(x), dtype)
    gate_up = torch.randn(37, 2 * 120).to(dtype)
    want = torch.nn.functional.silu(gate_up[:, :120]) * gate_up[:, 120:]
    _assert_equalish(cpu_ops.silu_and_mul(gate_up), want, dtype)

    from transformers import LlamaConfig
    rotary = RotaryEmbedding(LlamaConfig(hidden_size=256, num_attention_heads=8), 32, 512)
    positions = torch.randint(0, 512, (37,))
    qkv = torch.randn(37, 8 * 32 + 2 * 4 * 32).to(dtype)
    q, k = qkv[:, :256].view(37, 8, 32), qkv[:, 256:384].view(37, 4, 32)  # strided views, as in the model
    q0, k0 = q.clone(), k.clone()
    want_q, want_k = apply_rotary(q, k, rotary(positions, dtype))
    rotary.fused_ops = cpu_ops
    got_q, got_k = apply_rotary(q, k, rotary(positions, dtype))  # in place
    _assert_equalish(got_q, want_q, dtype)
    _assert_equalish(got_k, want_k, dtype)
    assert got_q.data_ptr() == qkv.data_ptr()
    q2, k2 = q0.clone(), k0.clone()  # the tables in the model's dtype (a bf16 model's buffers): the same
    rotary.to(dtype)
    cpu_ops.rotary_(q2, k2, positions, rotary.cos, rotary.sin)
    _assert_equalish(q2, want_q, dtype)
    _assert_equalish(k2, want_k, dtype)

    # the residual add folded into the norm: residual becomes x + residual, in place
    x, residual = torch.randn(37, 96).to(dtype), torch.randn(37, 96).to(dtype)
    want_sum = x + residual
    kept = residual
    got = cpu_ops.add_rms_norm_(x, residual, norm.weight, 1e-6)
    assert kept.data_ptr() == residual.data_ptr() and torch.equal(residual, want_sum)
    _assert_equalish(got, norm(want_sum), dtype)


def test_argmax_is_torchs_first_maximum():
    torch.manual_seed(0)
    for shape in [(64, 4096), (3, 17), (5, 1), (2, 151936), (7, 100)]:
        x = torch.randn(*shape)
        assert torch.equal(cpu_ops.argmax(x), x.argmax(-1))
    x = torch.zeros(5, 200)
    x[0, 150], x[0, 199] = 3.0, 3.0  # a tie: the first
    x[1, 120], x[1, 7] = float("nan"), 9.0  # a NaN counts as the maximum
    x[2] = float("-inf")
    x[3, 70], x[3, 90] = float("inf"), float("inf")
    x[4, 130] = float("nan")
    x[4, 10] = float("nan")
    assert cpu_ops.argmax(x).tolist() == x.argmax(-1).tolist() == [150, 120, 0, 70, 10]
    assert torch.equal(cpu_ops.argmax(x.t().contiguous().t()), x.argmax(-1))  # a strided view
    with pytest.raises(RuntimeError, match="float32"):
        cpu_ops.argmax(x.double())


@pytest.mark.parametrize("out_features, in_features", [(512, 256), (2048, 64), (100, 37), (7, 16)])
def test_few_row_linear_matches_torch_whatever_the_rows_beside(out_features, in_features):
    """The few-row linear (parallel.Linear on float32 CPU models, up to FEW_ROWS rows): the weight
    column-major (the runner's layout) or row-major (a tied LM head's), with and without a bias, any
    number of rows (blocks of 8 and the rest), odd sizes (vector tails); and a row's result is the same
    bits alone as in a batch (a verification row equals the decode row of the same token)."""
    torch.manual_seed(0)
    w = torch.randn(out_features, in_features)
    bias = torch.randn(out_features)
    for weight in (w, w.t().contiguous().t()):
        for rows in (1, 2, 5, 8, 9, 21):
            x = torch.randn(rows, in_features)
            for b in (None, bias):
                got = cpu_ops.linear(x, weight, b)
                want = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
                torch.testing.assert_close(got, want.float(), atol=1e-4, rtol=1e-5)
                for i in (0, rows - 1):
                    assert torch.equal(cpu_ops.linear(x[i:i + 1], weight, b)[0], got[i])
    x = torch.randn(cpu_ops.ROW_MAJOR_ROWS + 1, in_features)  # a row-major weight: torch's above that
    torch.testing.assert_close(cpu_ops.linear(x, w, bias), torch.nn.functional.linear(x, w, bias))
    with pytest.raises(RuntimeError, match="float32"):
        cpu_ops.linear(torch.randn(2, in_features).double(), w.double(), None)
    with pytest.raises(RuntimeError, match="weight"):
        cpu_ops.linear(torch.randn(2, in_features + 1), w, None)


@pytest.mark.parametrize("out_features, in_features", [(512, 256), (100, 37)])
def test_few_row_linear_in_bfloat16_is_float32_math_rounded_once(out_features, in_features):
    """bfloat16 weights (read as they are, half the bytes) and inputs: the float32 op's result on the same
    values, rounded to bfloat16 once at the end; a row's result the same alone as in a batch."""
    torch.manual_seed(0)
    w = torch.randn(out_features, in_features).bfloat16()
    bias = torch.randn(out_features).bfloat16()
    for weight in (w, w.t().contiguous().t()):
        for rows in (1, 5, 9):
            x = torch.randn(rows, in_features).bfloat16()
            for b in (None, bias):
                got = cpu_ops.linear(x, weight, b)
                assert got.dtype == torch.bfloat16
                wide = cpu_ops.linear(x.float(), weight.float(), None if b is None else b.float())
                assert torch.equal(got, wide.bfloat16())
                assert torch.equal(cpu_ops.linear(x[-1:], weight, b)[0], got[-1])
    with pytest.raises(RuntimeError, match="both bfloat16"):
        cpu_ops.linear(torch.randn(2, in_features), w, None)


@pytest.mark.parametrize("out_features, in_features", [(512, 256), (100, 37), (7, 1100)])
def test_panel_linear_matches_torch_and_the_few_row_op(out_features, in_features):
    """cpu_ops.PanelLinear (float32 layers beside oneDNN's packed weights): any rows (one pass up to its
    `rows`, blocks above), outputs not a multiple of a panel, inputs past a chunk of 1024; a row's
    result the same bits alone as in a batch, and the few-row op's bits on the column-major weight."""
    torch.manual_seed(0)
    w, bias = torch.randn(out_features, in_features), torch.randn(out_features)
    for b in (None, bias):
        lin = cpu_ops.PanelLinear(w, b)
        for rows in (1, 3, 8, 9, 16, lin.rows, lin.rows + 1, 2 * lin.rows + 3):
            x = torch.randn(rows, in_features)
            got = lin(x)
            want = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
            torch.testing.assert_close(got, want.float(), atol=1e-4, rtol=1e-5)
            for i in (0, rows - 1):
                assert torch.equal(lin(x[i:i + 1])[0], got[i])
            if rows <= 8:
                assert torch.equal(got, cpu_ops.linear(x, w.t().contiguous().t(), b))
    assert lin(torch.randn(0, in_features)).shape == (0, out_features)
    with pytest.raises(RuntimeError, match="wp must be"):
        cpu_ops.ops().linear_panels(torch.randn(2, in_features), lin.weight, None, out_features + 64)
    with pytest.raises(RuntimeError, match="bias must be"):  # the bias is padded once, by PanelLinear
        cpu_ops.ops().linear_panels(torch.randn(2, in_features), lin.weight, bias[:out_features - 1], out_features)


def test_float32_packed_layers_take_the_panels_below_their_rows():
    """pack_linears_ with the CPU ops: a float32 layer keeps oneDNN's copy and a panel copy (no float
    weight); up to the panels' rows through the panels, above through oneDNN."""
    from pagoda.engine.executor import parallel
    from pagoda.engine.layers import deterministic

    layer = parallel.Linear(64, 48, bias=True)
    model = torch.nn.Sequential(layer)
    assert deterministic.pack_linears_(model, keep_weights=True) == 1
    assert layer.weight is None and isinstance(layer.panels, cpu_ops.PanelLinear)
    layer.fused_ops = cpu_ops
    calls = []
    for name in ("panels", "packed"):
        inner = getattr(layer, name)
        setattr(layer, name, type("Spy", (), {"rows": getattr(inner, "rows", 0),
                                              "__call__": lambda s, x, f=inner, n=name: calls.append(n) or f(x)})())
    with torch.no_grad():
        layer(torch.randn(layer.panels.rows, 64))
        layer(torch.randn(layer.panels.rows + 1, 64))
    assert calls == ["panels", "packed"]


def test_float32_models_take_the_few_row_linear_below_its_limit(monkeypatch):
    """parallel.Linear with the CPU ops bound: up to FEW_ROWS rows through the op, more through torch."""
    from pagoda.engine.executor import parallel

    layer = parallel.Linear(64, 48, bias=True)
    layer.fused_ops = cpu_ops
    calls = []
    monkeypatch.setattr(cpu_ops, "linear", lambda *a: calls.append(a[0].shape[0]) or torch.zeros(a[0].shape[0], 48))
    with torch.no_grad():
        layer(torch.randn(parallel.FEW_ROWS, 64))
        layer(torch.randn(parallel.FEW_ROWS + 1, 64))
    assert calls == [parallel.FEW_ROWS]


def _assert_equalish(got, want, dtype):
    if dtype == torch.float32:  # the same math; a fused multiply-add may round the last bit differently
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # bf16: rounded where transformers rounds, so equal
        assert torch.equal(got, want)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bfloat16_engine_with_cpu_ops_agrees_with_torch(checkpoint, family):
    """bf16 weights: the C++ attention and fused layers (norms, SiLU, rotary: bitwise transformers'; the
    few-row linear: float32 sums rounded once) and plain torch pick the same greedy tokens, but for the
    rare near-tie that bf16 rounding flips."""
    from pagoda.engine import LLM, SamplingParams

    rng = random.Random(1)
    prompts = [[rng.randrange(200) for _ in range(n)] for n in (1, 15, 17, 40, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = {}
    for backend in ("auto", "torch"):
        llm = LLM(checkpoint(family), dtype="bfloat16", num_kv_blocks=64, attention_backend=backend)
        norms = [m for m in llm.engine.model.modules() if type(m).__name__ == "RMSNorm"]
        assert all((m.fused_ops is None) == (backend == "torch") for m in norms)
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert all(len(t) == 8 for t in outs["auto"])
    first = sum(a[:4] == b[:4] for a, b in zip(outs["auto"], outs["torch"]))
    assert first >= len(prompts) - 1


def test_a_lock_left_by_a_killed_build_is_cleared(tmp_path, monkeypatch):
    """torch's build lock survives a killed build; left alone, every later start would hang on it."""
    import os
    import time

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    directory = cpu_ops._build_directory("pagoda_lock_test", "flags")
    lock = os.path.join(directory, "lock")
    open(lock, "w").close()
    cpu_ops._clear_stale_lock(directory)
    assert os.path.exists(lock)  # a build may be running right now
    old = time.time() - cpu_ops._STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    cpu_ops._clear_stale_lock(directory)
    assert not os.path.exists(lock)


def test_each_torch_installation_builds_in_its_own_directory(tmp_path, monkeypatch):
    """Two virtualenvs on one machine (two torch installations) must not share a build directory:
    torch keys a build by its include paths, so sharing one rebuilds every time they alternate."""
    import torch

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    here = cpu_ops._build_directory("pagoda_cpu_ops_x", "flags")
    assert here == cpu_ops._build_directory("pagoda_cpu_ops_x", "flags") and here.startswith(str(tmp_path))
    monkeypatch.setattr(torch, "__file__", "/other/venv/lib/python3.11/site-packages/torch/__init__.py")
    assert cpu_ops._build_directory("pagoda_cpu_ops_x", "flags") != here


def test_the_install_built_both_libraries_and_each_runs_here():
    """setup.py compiled the ops for AVX-512 and for AVX2 machines (no compiling at start); each is
    loaded by its CPU kind (ATEN_CPU_CAPABILITY makes torch report AVX2 on an AVX-512 machine) and
    computes what torch computes. A machine with neither reports DEFAULT and compiles its own."""
    import glob
    import os
    import subprocess
    import sys

    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    here = os.path.dirname(cpu_ops.__file__)
    tag = torch.__version__.replace(".", "_").replace("+", "_")
    for kind in ("avx512", "avx2"):
        assert glob.glob(os.path.join(here, f"_cpu_ops_{kind}_{tag}_*.so")), f"no {kind} library from the install"
    kinds = {"AVX512": ["avx512", "avx2"], "AVX2": ["avx2"]}.get(capability, [])
    code = ("import logging, torch; logging.basicConfig(level=logging.INFO)\n"
            "from pagoda.engine.layers import cpu_ops\n"
            "x, w = torch.randn(7, 96), torch.randn(96)\n"
            "want = w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)\n"
            "assert torch.allclose(cpu_ops.rms_norm(x, w, 1e-6), want, atol=1e-5)\n")
    for kind in kinds:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "ATEN_CPU_CAPABILITY": kind})
        assert out.returncode == 0, out.stderr
        assert f"built at install, loaded from _cpu_ops_{kind}_" in out.stderr, out.stderr


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512",
                    reason="an AVX2 machine runs the AVX2 path in every other test of this file")
def test_the_avx2_path_on_an_avx512_machine():
    """ATEN_CPU_CAPABILITY=avx2 (torch's own switch) makes an AVX-512 machine run torch's and pagoda's
    AVX2 code: this file's kernel tests, the greedy check against transformers and the int8
    weight-only checks (torch's int8 kernel has its own AVX2 code) pass there too. On a machine with
    AMX, torch's own flash attention fails there in bf16 (test_sdpa_in_half_precision_matches_float32
    runs the shapes it fails on, the bf16 engine test a user's): pagoda's attention must not."""
    import os
    import subprocess
    import sys

    tests = REPO / "tests" / "engine"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider",
                          str(tests / "layers" / "test_cpu_ops.py"), str(tests / "models" / "test_correctness.py"),
                          str(tests / "layers" / "test_quantization.py"), str(tests / "layers" / "test_gguf_kernels.py"),
                          "-k", "(matches or argmax or fused or padding or skips or int8 or dequantized "
                                "or bfloat16_engine) and not triton and not avx2_path"],
                         capture_output=True, text=True, timeout=900, cwd=REPO,
                         env={**os.environ, "ATEN_CPU_CAPABILITY": "avx2"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and " failed" not in out.stdout


@pytest.mark.parametrize("family,options", [
    ("llama", {}), ("llama-untied", {}), ("qwen2", {}), ("qwen3", {}),  # float32: the linears in panels
    ("llama", {"cpu_linear": "mkl"}), ("qwen2", {"cpu_linear": "mkl"}),  # float32: the few-row op's weights
    ("llama-untied", {"dtype": "bfloat16"}), ("qwen3", {"dtype": "bfloat16"})])
def test_decoder_layer_op_is_bitwise_the_layer_op_by_op(checkpoint, family, options):
    """csrc/decoder_layer_cpu.cpp (models/llama.py FusedDecoderLayer) against the same layer run op by op
    from Python, on a step with decodes, a prompt chunk and a multi-token query over cached context, in
    the first layer (no residual yet) and a later one: output, residual and KV cache all bitwise equal."""
    from pagoda.engine import LLM, SamplingParams
    from pagoda.engine.core.scheduler import SchedulerOutput
    from pagoda.engine.core.sequence import BlockTable, Sequence

    options = {"dtype": "float32", **options}
    runner = LLM(checkpoint(family), num_kv_blocks=16, block_size=4, **options).engine.runner
    model = runner.model
    assert all(layer.fused is not None for layer in model.layers)

    def seq(num_tokens, num_computed, blocks):
        s = Sequence(str(blocks), list(range(3, 3 + num_tokens)), SamplingParams(max_tokens=8))
        s.num_computed_tokens, s.block_tables = num_computed, [BlockTable(blocks)]
        return s

    batch = SchedulerOutput([seq(6, 5, [3, 7]), seq(3, 2, [9]), seq(10, 4, [1, 2, 5]), seq(8, 5, [4, 6])],
                            num_new_tokens=[1, 1, 3, 3], num_sampled=[1, 1, 0, 3])
    ids, positions, meta, _ = runner._prepare_inputs(batch)
    assert len(ids) <= model.layers[0].fused.rows  # the step takes the one op (bfloat16: up to 8 rows)
    torch.manual_seed(0)
    runner.kv_cache.normal_()  # the cached context the new tokens attend to
    with torch.inference_mode():
        x = model.embed_tokens(ids)
        rope = model.rotary(positions, x.dtype)
        cache = runner.kv_cache.clone()
        for layer, residual in ((model.layers[0], None), (model.layers[1], torch.randn_like(x))):
            results, op = [], layer.fused
            for fused in (op, None):
                runner.kv_cache.copy_(cache)
                layer.fused, res = fused, None if residual is None else residual.clone()
                out, res = layer(rope, x.clone(), res, meta)
                results.append((out, res, runner.kv_cache.clone()))
            layer.fused = op
            for got, want in zip(*results):
                assert torch.equal(got, want)
            assert not torch.equal(results[0][2], cache)  # the step's K/V were written


@pytest.mark.parametrize("options", [dict(cpu_fused_layers=False), dict(attention_backend="torch"),
                                     dict(cpu_linear="onednn-only"), dict(dtype="float16"),
                                     dict(deterministic=True), dict(quantization="int8"),
                                     dict(allow_lora_loading=True)])
def test_decoder_layers_run_op_by_op_where_the_one_op_is_not_their_path(checkpoint, options):
    """No weights for the few-row op (onednn-only), another attention, float16, batch-invariant linears,
    int8, LoRA updates, or turned off: the layers keep their Python path (EngineConfig.cpu_fused_layers)."""
    from pagoda.engine import LLM, SamplingParams

    llm = LLM(checkpoint("llama"), **{"dtype": "float32", "num_kv_blocks": 16, **options})
    assert all(layer.fused is None for layer in llm.engine.runner.model.layers)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3


def test_decoder_layers_above_their_rows_run_op_by_op(checkpoint, monkeypatch):
    """The one op serves steps of up to its rows (the panels' block); a longer step (a prompt) takes the
    Python path, and the greedy tokens are the same with the op turned off."""
    from pagoda.engine import LLM, SamplingParams

    prompts = [list(range(3, 3 + n)) for n in (2, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = LLM(checkpoint("qwen2"), dtype="float32", num_kv_blocks=32, enable_prefix_caching=False)
    layer = llm.engine.runner.model.layers[0]
    rows, op = [], layer.fused
    monkeypatch.setattr(layer, "fused", type("Spy", (), {"rows": op.rows, "__call__": lambda s, rope, x, *a: (
        rows.append(x.shape[0]) or op(rope, x, *a))})())
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert rows and max(rows) <= op.rows  # the 42-token prefill step went op by op
    off = LLM(checkpoint("qwen2"), dtype="float32", num_kv_blocks=32, cpu_fused_layers=False)
    assert [o.token_ids for o in off.generate(prompts, params)] == got


# ---- attention variants: sliding window, soft-capped scores, sinks ----

def _dense(q, k, v, tables, lens, qlens, scale, window=0, softcap=0.0, sinks=None):
    """Each query token's attention written out one token at a time in float64: the definition the
    torch reference and the op are held to. q: [num_tokens, H, D] flat over sequences (each sequence's
    qlens[i] new tokens are its last)."""
    block_size, num_kv_heads = k.shape[1], k.shape[2]
    out, t = [], 0
    for i, (n, m) in enumerate(zip(lens.tolist(), qlens)):
        blocks = tables[i, :-(-n // block_size)].long()
        ks = k[blocks].reshape(-1, num_kv_heads, k.shape[3])[:n].double()  # [n, kvh, D]
        vs = v[blocks].reshape(-1, num_kv_heads, v.shape[3])[:n].double()
        for j in range(m):
            pos, row = n - m + j, q[t].double()  # [H, D]
            group = row.shape[0] // num_kv_heads
            kk, vv = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)  # [n, H, D]
            s = torch.einsum("hd,nhd->hn", row, kk) * scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            keys = torch.arange(n)
            s = s.masked_fill(~((keys <= pos) & (keys > pos - window if window else True)), float("-inf"))
            if sinks is not None:
                s = torch.cat((s, sinks.double()[:, None]), 1)
            p = torch.softmax(s, -1)[:, :n]
            out.append(torch.einsum("hn,nhd->hd", p, vv))
            t += 1
    return torch.stack(out)


VARIANTS = {"window": dict(window=21), "window-of-a-block": dict(window=16), "softcap": dict(softcap=3.0),
            "sinks": dict(sinks=True), "all": dict(window=9, softcap=3.0, sinks=True)}


def _variant(num_heads, window=0, softcap=0.0, sinks=False):
    g = torch.Generator().manual_seed(3)
    return ref.Variant(window, softcap, torch.randn(num_heads, generator=g) * 2 if sinks else None)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype,head_dim,num_heads,num_kv_heads,block_size", [CASES[0], CASES[4], CASES[6]])
def test_attention_variants_match_their_definition(variant, dtype, head_dim, num_heads, num_kv_heads, block_size):
    """Decode rows and prefill chunks (fresh, after a cached prefix, longer than the window) through the op
    and the torch reference, against each token's attention written out."""
    var = _variant(num_heads, **VARIANTS[variant])
    shapes = [(1, 1), (1, 9), (1, 70), (20, 20), (5, 37), (40, 40), (block_size, 3 * block_size)]
    num_blocks = 64
    (k, v), (k_ops, v_ops) = _cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, seed=2)
    lens = torch.tensor([c for _, c in shapes], dtype=torch.int32)
    tables = _tables(lens.tolist(), block_size, num_blocks, seed=2)
    qlens = [n for n, _ in shapes]
    start_loc = torch.tensor([0] + qlens, dtype=torch.int64).cumsum(0).to(torch.int32)
    q = torch.randn(sum(qlens), num_heads, head_dim, generator=torch.Generator().manual_seed(4)).to(dtype)
    want = _dense(q, k, v, tables, lens, qlens, 0.3, var.window, var.softcap, var.sinks).float()
    tol = dict(atol=max(TOL[dtype], 1e-4), rtol=max(TOL[dtype], 1e-4))
    for backend, (kc, vc) in ((cpu_attention, (k_ops, v_ops)), (ref, (k, v))):
        got = backend.prefill_attention(q, kc, vc, tables, start_loc, lens, 0.3, max(qlens), var)
        torch.testing.assert_close(got.float(), want, **tol)
        decode = backend.decode_attention(q[:3], kc, vc, tables[:3], lens[:3], 0.3, var)
        torch.testing.assert_close(decode.float(), want[:3], **tol)


def test_a_window_never_reads_the_blocks_before_it():
    """The blocks a sliding window has left may be freed: their table entries (-1 here) are not read."""
    head_dim, block_size, window = 32, 16, 20
    (k, v), (k_ops, v_ops) = _cache(16, block_size, 2, head_dim, torch.float32)
    lens = torch.tensor([70, 50], dtype=torch.int32)  # windows start at key 50 (block 3) and 30 (block 1)
    tables = _tables(lens.tolist(), block_size, 16)
    q = torch.randn(2, 4, head_dim)
    var = ref.Variant(window=window)
    want = cpu_attention.decode_attention(q, k_ops, v_ops, tables, lens, 0.2, var)
    tables[0, :3], tables[1, :1] = -1, -1
    got = cpu_attention.decode_attention(q, k_ops, v_ops, tables, lens, 0.2, var)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_attention.decode_attention(q, k_ops, v_ops, tables, lens, 0.2, ref.Variant(window=window + 16))

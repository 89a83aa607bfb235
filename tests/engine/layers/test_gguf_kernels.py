"""GGUF block formats in pagoda's one quantized-linear dispatch (engine/layers/quantization.py): each block
type's CPU kernel (csrc/gguf_cpu.cpp) against gguf.quants.dequantize(W), the `gguf` package's own reading of the
blocks. Many rows (dequantized chunks) and the few-row float path equal dequantize(W) @ x within float32 rounding;
the few-row integer path (the op's default, and so the dispatch's, for the types in INTEGER) equals dequantize(W) @ q16(x), its 16-bit activations written here in Python, within float32 rounding, and
dequantize(W) @ x within the bound those activations' rounding gives. Both ISA builds: test_cpu_ops.py runs the tests named "matches" under ATEN_CPU_CAPABILITY=avx2."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from gguf_fixtures import _SCALES, blocks
from pagoda.engine.executor.parallel import Linear
from pagoda.engine.gguf import GGUF_KERNEL_TYPES, GGUFWeight
from pagoda.engine.layers import cpu_ops
from pagoda.engine.layers import quantization as qz

TYPES = [Q[name] for name in GGUF_KERNEL_TYPES]
# the types whose few-row kernel quantizes the activations (gguf_cpu.cpp integer_path)
INTEGER = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.Q4_K, Q.Q5_K, Q.Q6_K]
FLOAT, INTEGER_PATH = 0, 1  # gguf_linear's path argument (-1, the default: the type's)


def q16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The integer path's activations, dequantized: x [.., K] in blocks of 32, dx = max|x| / 32767 in float32,
    q = round-half-even(x / dx) (a block of zeros: dx = 0, q = 0) -> (q * dx [.., K], dx per value [.., K])."""
    b = x.float().reshape(*x.shape[:-1], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 32767
    q = torch.where(d > 0, torch.round(b / d), 0.0)
    return (q * d).reshape(x.shape), d.expand(b.shape).reshape(x.shape)


def _assert_integer_path(got, x, dense, bias=None):
    """got == dequantize(q16(x)) @ W.T (+ bias) within float32 rounding (summation order), and == x @ W.T within
    the bound of the activations' rounding: each x_k is off by at most dx / 2, so each output by at most
    sum_k |W[o, k]| * dx_k / 2 (rounding on top: 1e-5 of the largest output)."""
    xq, dx = q16(x)
    want = F.linear(xq, dense, bias)
    tol = 1e-5 * max(want.abs().max().item(), 1e-30)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=tol)
    exact = F.linear(x.float(), dense, bias)
    bound = (dx / 2) @ dense.abs().T
    assert ((got - exact).abs() <= bound * (1 + 1e-5) + tol).all()


@pytest.fixture(scope="module", autouse=True)
def built():
    ok, why = cpu_ops.is_available("cpu")
    assert ok, why


def _layer(parts, in_features, bias: bool, seed=0):
    """A Linear holding `parts` ((type, blocks or float) in output order), and the dequantized weight."""
    out = sum(t.shape[0] for _, t in parts)
    layer = Linear(in_features, out, bias=bias)
    if bias:
        torch.nn.init.normal_(layer.bias, generator=torch.Generator().manual_seed(seed))
    layer.qweight = GGUFWeight([(k, torch.from_numpy(b) if isinstance(b, np.ndarray) else b) for k, b in parts],
                               in_features)
    layer.weight = None
    dense = torch.cat([t.float() if k is None else torch.from_numpy(dequantize(np.asarray(t), Q[k]))
                       for k, t in parts])
    return layer, dense


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gguf_dequantize_matches_gguf_quants_exactly(qtype):
    rng = np.random.default_rng(1)
    b = blocks(rng.standard_normal((40, 512)).astype(np.float32), qtype, rng)
    got = cpu_ops.ops().gguf_dequantize(torch.from_numpy(b), int(qtype), 512)
    torch.testing.assert_close(got, torch.from_numpy(dequantize(b, qtype)), rtol=2e-7, atol=0)  # fma or not


# rows 1 and 2: several accumulators a row; 3: one; 9: 8 rows, then 1
@pytest.mark.parametrize("rows", [1, 2, 3, 9, qz.DEQUANT_MIN_ROWS - 1, qz.DEQUANT_MIN_ROWS + 5])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gguf_linear_matches_dequantized_matmul(qtype, rows):
    _check_linear(qtype, rows, 768 if GGML_QUANT_SIZES[qtype][0] == 256 else 864)  # 32: spans of 8 blocks, 3 more


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gguf_linear_of_one_block_a_row_matches_dequantized_matmul(qtype):
    """The shortest rows: no whole span of 256 weights, one block (of 32 weights, or a super-block)."""
    for rows in (1, 2, 5):
        _check_linear(qtype, rows, GGML_QUANT_SIZES[qtype][0])


def _check_linear(qtype, rows: int, k: int):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((72, k)).astype(np.float32)  # 72 outputs: a remainder for every thread split
    b = blocks(w, qtype, rng)
    layer, dense = _layer([(qtype.name, b)], k, bias=True)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    want = F.linear(x, dense, layer.bias)
    got = layer(x)  # the dispatch: below DEQUANT_MIN_ROWS the op's own path (the integer one for INTEGER)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    if qtype in INTEGER and rows < qz.DEQUANT_MIN_ROWS:
        _assert_integer_path(got, x, dense, layer.bias)
        got = cpu_ops.ops().gguf_linear(x, torch.from_numpy(b), int(qtype), FLOAT) + layer.bias
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_default_path_matches_the_integer_one_exactly_for_the_integer_types(qtype):
    """gguf_cpu.cpp's integer_path table and INTEGER agree; the types without an integer path refuse one."""
    rng = np.random.default_rng(5)
    k = GGML_QUANT_SIZES[qtype][0] * 3
    b = torch.from_numpy(blocks(rng.standard_normal((24, k)).astype(np.float32), qtype, rng))
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(5))
    op = cpu_ops.ops().gguf_linear
    if qtype in INTEGER:
        assert torch.equal(op(x, b, int(qtype)), op(x, b, int(qtype), INTEGER_PATH))
        assert not torch.equal(op(x, b, int(qtype)), op(x, b, int(qtype), FLOAT))
    else:
        assert torch.equal(op(x, b, int(qtype)), op(x, b, int(qtype), FLOAT))
        with pytest.raises(RuntimeError, match="has no integer path"):
            op(x, b, int(qtype), INTEGER_PATH)


@pytest.mark.parametrize("qtype", INTEGER, ids=lambda t: t.name)
def test_integer_path_with_zero_rows_and_blocks_matches_the_reference(qtype):
    """A row of zeros (dx = 0, q = 0: no 0 / 0) gives 0; a zero block inside a row is skipped; tiny values
    (1e-30) too."""
    rng = np.random.default_rng(6)
    k = 2 * GGML_QUANT_SIZES[qtype][0] + (32 if GGML_QUANT_SIZES[qtype][0] == 32 else 0)
    b = blocks(rng.standard_normal((40, k)).astype(np.float32), qtype, rng)
    dense = torch.from_numpy(dequantize(b, qtype))
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(6))
    x[0] = 0
    x[2, 32:64] = 0
    x[3] *= 1e-30
    got = cpu_ops.ops().gguf_linear(x, torch.from_numpy(b), int(qtype))
    assert torch.equal(got[0], torch.zeros(40)) and torch.isfinite(got).all()
    _assert_integer_path(got, x, dense)


def _extreme_blocks(qtype, rows: int, k: int, fill: int, rng) -> np.ndarray:
    """Blocks whose quant bytes are all `fill` (0xFF: every unsigned quant at its maximum; 0x80: Q8_0's -128),
    their f16 scales sane (gguf_fixtures' positions)."""
    n, size = GGML_QUANT_SIZES[qtype]
    b = blocks(rng.standard_normal((rows, k)).astype(np.float32), qtype, rng).reshape(rows, k // n, size)
    scales = {Q.Q4_1: (0, 2), Q.Q5_1: (0, 2)}.get(qtype) or [at for at, _ in _SCALES.get(qtype, ((0, 0),))]
    out = np.full_like(b, fill)
    for at in scales:
        out[..., at:at + 2] = b[..., at:at + 2]
    return out.reshape(rows, -1)


@pytest.mark.parametrize("qtype", INTEGER, ids=lambda t: t.name)
def test_integer_path_at_the_largest_products_matches_the_reference(qtype):
    """Quants at their extremes (0xFF bytes: 15 / 31 / 63, IQ4_NL's 113; Q8_0 -128 and -1) times activations
    of 1e4 (q = +-32767 in every lane): the int32 sums reach 32 * 128 * 32767 (Q6_K's groups 16 * 32 * 32767)
    and must not wrap."""
    rng = np.random.default_rng(7)
    k = 256
    x = torch.full((4, k), 1e4)
    x[1] = -1e4
    x[2, ::2] = -1e4  # signs alternating
    x[3] = torch.randn(k, generator=torch.Generator().manual_seed(7)) * 1e4
    for fill in (0xFF, 0x80):
        b = _extreme_blocks(qtype, 16, k, fill, rng)
        dense = torch.from_numpy(dequantize(b, qtype))
        _assert_integer_path(cpu_ops.ops().gguf_linear(x, torch.from_numpy(b), int(qtype)), x, dense)


def test_q6_k_integer_path_at_its_largest_scaled_sums_matches_the_reference():
    """Q6_K's worst case: every q = 0 (weight -32 * sc), every scale -128, activations at +-32767: a group of 16
    sums to 16 * 32 * 32767 before its scale; scaled in integers a block of 32 would pass 2^31."""
    rng = np.random.default_rng(8)
    k = 512
    b = _extreme_blocks(Q.Q6_K, 16, k, 0x00, rng).reshape(16, k // 256, 210)
    b[..., 192:208] = 0x80
    b = b.reshape(16, -1)
    x = torch.full((3, k), 1e4)
    x[1, ::3] = -1e4
    x[2] = torch.randn(k, generator=torch.Generator().manual_seed(8)) * 1e4
    dense = torch.from_numpy(dequantize(b, Q.Q6_K))
    d = torch.from_numpy(b.reshape(16, k // 256, 210)[..., 208:210].copy().view(np.float16).astype(np.float32))
    assert torch.equal(dense, (4096 * d).expand(16, k // 256, 256).reshape(16, k))  # d * -128 * (0 - 32)
    _assert_integer_path(cpu_ops.ops().gguf_linear(x, torch.from_numpy(b), int(Q.Q6_K)), x, dense)


@pytest.mark.parametrize("rows", [2, qz.DEQUANT_MIN_ROWS + 1])
def test_a_fused_layer_of_mixed_types_matches_dequantized_matmul(rows):
    """qkv of a Q4_K_M file: q and k in Q4_K, v in Q6_K; a piece the file stores in float stays float.
    bfloat16 activations in, bfloat16 out; [batch, rows, in] as well."""
    rng = np.random.default_rng(3)
    parts = [("Q4_K", blocks(rng.standard_normal((48, 256)).astype(np.float32), Q.Q4_K, rng)),
             ("Q6_K", blocks(rng.standard_normal((16, 256)).astype(np.float32), Q.Q6_K, rng)),
             (None, torch.randn(8, 256, generator=torch.Generator().manual_seed(3)))]
    layer, dense = _layer(parts, 256, bias=False)
    assert layer.qweight.out_features == 72
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(4))
    want = F.linear(x, dense)
    torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    assert torch.equal(layer(x[None])[0], layer(x))
    got = layer(x.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.02 * want.abs().max().item())


def test_blocks_that_do_not_hold_the_input_size_are_refused():
    b = torch.zeros(4, 144, dtype=torch.uint8)  # one Q4_K super-block a row: 256 inputs, not 512
    with pytest.raises(RuntimeError, match="do not hold 512 weights of GGUF type 12"):
        cpu_ops.ops().gguf_linear(torch.zeros(1, 512), b, int(Q.Q4_K))
    with pytest.raises(RuntimeError, match="has no CPU kernel"):
        cpu_ops.ops().gguf_linear(torch.zeros(1, 256), b, int(Q.IQ2_XXS))

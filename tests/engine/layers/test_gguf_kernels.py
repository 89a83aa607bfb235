"""GGUF block formats in pagoda's one quantized-linear dispatch (engine/layers/quantization.py): each block
type's CPU kernel (csrc/gguf_cpu.cpp: a few rows on the blocks, many rows over dequantized chunks) equals
gguf.quants.dequantize(W) @ x, the `gguf` package's own reading of the blocks, within float32 rounding."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from gguf_fixtures import blocks
from pagoda.engine.executor.parallel import Linear
from pagoda.engine.gguf import GGUF_KERNEL_TYPES, GGUFWeight
from pagoda.engine.layers import cpu_ops
from pagoda.engine.layers import quantization as qz

TYPES = [Q[name] for name in GGUF_KERNEL_TYPES]


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
    layer, dense = _layer([(qtype.name, blocks(w, qtype, rng))], k, bias=True)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    want = F.linear(x, dense, layer.bias)
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


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
        cpu_ops.ops().gguf_linear(torch.zeros(1, 256), b, int(Q.Q2_K))

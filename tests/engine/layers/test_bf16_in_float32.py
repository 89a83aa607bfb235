"""bfloat16 on a CPU without native bf16 (no AVX512-BF16, no AMX): linear calls of many rows compute in
float32 over the bf16 weights (deterministic.pack_linears_), since oneDNN would emulate bf16 or not pack it
at all, leaving torch's bf16 GEMM (~100x float32's at a 128-token prompt on AVX2). CPUs with native bf16
keep computing in bf16."""
import pytest
import torch
import torch.nn.functional as F

from oracle import random_prompts
from pagoda.engine import LLM, SamplingParams
from pagoda.engine.executor.parallel import Linear
from pagoda.engine.layers.deterministic import PackedLinear, WidenedLinear, computes_bf16, pack_linears_

ROWS = 40  # above the few-row op's bf16 limit (parallel.FEW_ROWS_PACKED): a prompt's call


def _cpu_with(monkeypatch, native: bool) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)


def _layer() -> Linear:
    torch.manual_seed(0)
    return Linear(64, 96, bias=True).bfloat16()


@pytest.mark.parametrize("keep_weights", [True, False])
def test_without_native_bf16_many_rows_compute_in_float32(monkeypatch, keep_weights):
    _cpu_with(monkeypatch, native=False)
    assert not computes_bf16()
    m = _layer()
    w, b = m.weight.detach().clone(), m.bias.detach().clone()
    assert pack_linears_(torch.nn.Sequential(m), keep_weights=keep_weights) == 1
    if keep_weights:  # a float32 copy packed, the bf16 weight kept (column-major) for the few-row op
        assert isinstance(m.packed, PackedLinear) and m.packed.dtype == torch.float32
    else:  # the bf16 weight only, widened per call
        assert isinstance(m.packed, WidenedLinear)
    assert m.weight.dtype == torch.bfloat16 and m.weight.stride() == (1, 96) and torch.equal(m.weight, w)
    x = torch.randn(ROWS, 64).bfloat16()
    y = m(x)
    assert y.dtype == torch.bfloat16 and y.shape == (ROWS, 96)
    want = F.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(y.float(), want, rtol=1e-2, atol=1e-2)  # float32 sums, rounded once to bf16


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN cannot pack bf16 here")
def test_with_native_bf16_linears_compute_in_bf16(monkeypatch):
    _cpu_with(monkeypatch, native=True)
    assert computes_bf16()
    m = _layer()
    pack_linears_(torch.nn.Sequential(m), keep_weights=True)
    assert isinstance(m.packed, PackedLinear) and m.packed.dtype == torch.bfloat16


@pytest.mark.parametrize("cpu_linear", ["onednn", "onednn-only"])
def test_greedy_output_agrees_with_torchs_bf16_gemm(monkeypatch, checkpoint, cpu_linear):
    # the bf16 reference: torch's own GEMM over bf16 weights (cpu_linear mkl), on every CPU
    path = checkpoint("qwen2")
    prompts = random_prompts(256, [12, 40, 70, 9], seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    reference = [o.token_ids for o in LLM(path, dtype="bfloat16", cpu_linear="mkl", num_kv_blocks=64,
                                          device="cpu").generate(prompts, params)]
    _cpu_with(monkeypatch, native=False)
    llm = LLM(path, dtype="bfloat16", cpu_linear=cpu_linear, num_kv_blocks=64, device="cpu")
    kind = PackedLinear if cpu_linear == "onednn" else WidenedLinear
    assert all(isinstance(m.packed, kind) for m in llm.engine.model.modules() if isinstance(m, Linear))
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == reference

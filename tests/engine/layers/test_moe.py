"""Mixture-of-experts layers: the router against transformers' own (ties included), the CPU expert op
(csrc/moe_cpu.cpp) against the per-expert loop (gpt-oss's biases and clamped SwiGLU, int8 and MXFP4 experts
too), MXFP4's dequantization against transformers', and the checkpoint layouts the experts load."""
import pytest
import torch
import transformers

from pagoda.engine.layers import cpu_ops
from pagoda.engine.layers.moe import Experts, GptOssExperts, Router, dequantize_mxfp4, quantize_mxfp4

HIDDEN, INTER, EXPERTS = 64, 40, 8  # 40: the op's vector columns and a scalar tail

pytestmark = pytest.mark.skipif(not cpu_ops.is_available(torch.device("cpu"))[0], reason="no CPU ops")


def _experts(dtype=torch.float32, hidden=HIDDEN, inter=INTER, seed=0) -> Experts:
    torch.manual_seed(seed)
    m = Experts(EXPERTS, hidden, inter, "silu")
    with torch.no_grad():
        m.gate_up_proj.normal_(0, 0.3)
        m.down_proj.normal_(0, 0.3)
    return m.to(dtype)


def _routing(ids: list[list[int]], seed=1):
    torch.manual_seed(seed)
    ids = torch.tensor(ids, dtype=torch.int64)
    weights = torch.rand(ids.shape).softmax(-1)
    return weights, ids


CASES = {
    "uneven groups": [[0, 3], [3, 5], [3, 0], [7, 3], [1, 2], [5, 3], [3, 6], [0, 1], [2, 3], [4, 3], [3, 7]],
    "one token": [[6, 2]],
    "one expert takes every token": [[0, e % 7 + 1] if e % 2 else [e % 7 + 1, 0] for e in range(13)],
    "most experts get none": [[2, 5]] * 9,
}


def _run_op(m: Experts, x, weights, ids):
    out = torch.zeros_like(x)
    cpu_ops.moe_experts_(out, x, m.gate_up_proj, m.down_proj, weights, ids)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_the_op_is_the_per_expert_loop_exactly_in_float32(case):
    m = _experts()
    weights, ids = _routing(CASES[case])
    x = torch.randn(ids.shape[0], HIDDEN)
    got = _run_op(m, x, weights, ids)
    want = m.loop_(torch.zeros_like(x), x, weights, ids, ops=cpu_ops)  # pagoda's linear and SiLU, expert by expert
    assert torch.equal(got, want)
    torch_loop = m.loop_(torch.zeros_like(x), x, weights, ids)  # torch's GEMMs and SiLU: the same to rounding
    torch.testing.assert_close(got, torch_loop, atol=1e-5, rtol=1e-5)
    for i in range(x.shape[0]):  # a row alone: bitwise its result in the batch
        assert torch.equal(_run_op(m, x[i:i + 1], weights[i:i + 1], ids[i:i + 1])[0], got[i])


def test_the_op_adds_in_place_and_never_reads_experts_no_token_chose():
    m = _experts()
    weights, ids = _routing(CASES["most experts get none"])
    with torch.no_grad():
        for e in set(range(EXPERTS)) - {2, 5}:
            m.gate_up_proj[e] = float("nan")
            m.down_proj[e] = float("nan")
    x = torch.randn(ids.shape[0], HIDDEN)
    base = torch.randn_like(x)
    out = base.clone()
    cpu_ops.moe_experts_(out, x, m.gate_up_proj, m.down_proj, weights, ids)
    assert torch.isfinite(out).all()
    assert torch.equal(out, m.loop_(base.clone(), x, weights, ids, ops=cpu_ops))


@pytest.mark.parametrize("case", ["uneven groups", "one expert takes every token"])
def test_the_op_in_bfloat16_rounds_where_the_loop_does(case):
    m = _experts(torch.bfloat16)
    weights, ids = _routing(CASES[case])
    x = torch.randn(ids.shape[0], HIDDEN).bfloat16()
    got = _run_op(m, x, weights, ids)
    assert torch.equal(got, m.loop_(torch.zeros_like(x), x, weights, ids, ops=cpu_ops))
    wide = _experts(torch.float32)  # and within bfloat16's precision of float32 math on the same weights
    full = wide.loop_(torch.zeros(x.shape), x.float(), weights, ids)
    torch.testing.assert_close(got.float(), full, atol=0.1, rtol=0.05)


def test_larger_shapes_match_the_loop():
    """Several column blocks per expert, more rows than a register tile, a weight too large for L1."""
    m = _experts(hidden=96, inter=200)
    torch.manual_seed(2)
    ids = torch.stack([torch.randperm(EXPERTS)[:2] for _ in range(37)])
    weights = torch.rand(ids.shape).softmax(-1)
    x = torch.randn(37, 96)
    assert torch.equal(_run_op(m, x, weights, ids), m.loop_(torch.zeros_like(x), x, weights, ids, ops=cpu_ops))


@pytest.mark.parametrize("norm", [False, True])
def test_the_router_is_transformers_ties_included(norm):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=2,
                                         norm_topk_prob=norm)
    theirs = Qwen3MoeTopKRouter(config)
    ours = Router(HIDDEN, EXPERTS, 2, norm, round_weights=True)
    torch.manual_seed(0)
    w = torch.randn(EXPERTS, HIDDEN)
    w[5] = w[2]  # experts 2 and 5 always tie; 6 and 1 too
    w[6] = w[1]
    with torch.no_grad():
        theirs.weight.copy_(w)
        ours.weight.copy_(w)
    x = torch.randn(50, HIDDEN)
    _, want_weights, want_ids = theirs(x)
    weights, ids = ours(x)
    assert torch.equal(ids, want_ids)  # the logits' GEMM runs over the weight's transpose: weights to rounding
    torch.testing.assert_close(weights, want_weights.float(), atol=1e-6, rtol=1e-6)
    assert any(len({2, 5} & set(r)) == 2 or len({1, 6} & set(r)) == 2 for r in ids.tolist())  # ties were chosen


def test_fused_3d_experts_load_as_per_expert_ones(checkpoint, tmp_path):
    """A checkpoint whose experts are stored fused ([E, 2I, H] gate|up, [E, H, I] down, as transformers holds
    them) loads the same weights as one with a tensor per expert and projection."""
    import shutil

    from safetensors.torch import load_file, save_file

    from pagoda.engine.loader import load_hf_config, load_weights
    from pagoda.engine.models import build_model

    path = checkpoint("qwen3_moe")
    fused = tmp_path / "fused"
    shutil.copytree(path, fused)
    tensors = load_file(f"{path}/model.safetensors")
    out = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in {k.split(".mlp.experts.")[0] for k in tensors if ".mlp.experts." in k}:
        per = lambda p: torch.stack([tensors[f"{layer}.mlp.experts.{e}.{p}.weight"] for e in range(EXPERTS)])  # noqa
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.cat([per("gate_proj"), per("up_proj")], dim=1)
        out[f"{layer}.mlp.experts.down_proj"] = per("down_proj")
    save_file(out, f"{fused}/model.safetensors", metadata={"format": "pt"})
    models = []
    for p in (path, str(fused)):
        model = build_model(load_hf_config(p))
        load_weights(model, p)
        models.append(dict(model.named_parameters()))
    assert models[0].keys() == models[1].keys()
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])
    experts = models[0]["layers.1.mlp.experts.gate_up_proj"]
    assert experts.shape == (EXPERTS, 64, 64) and experts.stride() == (64 * 64, 1, 64)


def _gpt_oss(inter=INTER, mxfp4=False, limit=1.0, seed=0) -> GptOssExperts:
    """gpt-oss's experts with random weights and biases; a limit the random projections pass often."""
    torch.manual_seed(seed)
    m = GptOssExperts(EXPERTS, HIDDEN, inter, limit, 1.702, mxfp4=mxfp4)
    with torch.no_grad():
        for p in (m.gate_up_proj_bias, m.down_proj_bias):
            p.normal_(0, 0.3)
        for proj in ("gate_up_proj", "down_proj"):
            w = torch.randn(EXPERTS, *(2 * inter, HIDDEN) if proj == "gate_up_proj" else (HIDDEN, inter)) * 0.3
            if mxfp4:
                blocks, scales = quantize_mxfp4(w)
                getattr(m, f"{proj}_blocks").copy_(blocks)
                getattr(m, f"{proj}_scales").copy_(scales)
            else:
                getattr(m, proj).copy_(w)
    return m


def _run_module_op(m: Experts, x, weights, ids):
    out = torch.zeros_like(x)
    w13, w2, s13, s2 = m.operands()
    cpu_ops.ops().moe_experts_(out, x, w13, w2, weights, ids, s13, s2, m.gate_up_proj_bias, m.down_proj_bias,
                               **m.swiglu())
    return out


def _check_against_the_loop(m: Experts, case: str, dtype=torch.float32, tol=1e-5):
    """The op against the torch loop over the same (dequantized) weights, and each row alone bitwise itself."""
    weights, ids = _routing(CASES[case])
    x = torch.randn(ids.shape[0], HIDDEN).to(dtype)
    got = _run_module_op(m, x, weights, ids)
    want = m.loop_(torch.zeros_like(x), x, weights, ids)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    for i in range(x.shape[0]):
        assert torch.equal(_run_module_op(m, x[i:i + 1], weights[i:i + 1], ids[i:i + 1])[0], got[i])
    return got


@pytest.mark.parametrize("case", ["uneven groups", "one token", "one expert takes every token"])
def test_gpt_oss_biases_and_clamped_swiglu_in_the_op(case):
    m = _gpt_oss()
    x = torch.randn(64, HIDDEN)
    gate, up = (x @ m.gate_up_proj[3].t() + m.gate_up_proj_bias[3]).chunk(2, dim=-1)
    assert (gate > m.limit).any() and (up.abs() > m.limit).any()  # the clamps bite
    _check_against_the_loop(m, case)  # torch's GEMMs and sigmoid: to rounding


@pytest.mark.parametrize("case", ["uneven groups", "one token"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_experts_in_the_op_match_the_loop_on_their_dequantized_weights(case, dtype):
    m = _gpt_oss(inter=64, mxfp4=True).to(dtype)
    assert m.gate_up_proj is None and m.operands()[0].dtype == torch.uint8  # computed from the blocks
    _check_against_the_loop(m, case, dtype, tol=1e-5 if dtype == torch.float32 else 0.05)


@pytest.mark.parametrize("family", ["silu", "gpt-oss"])
def test_int8_experts_in_the_op_match_the_loop_on_their_dequantized_weights(family):
    m = _experts(inter=48) if family == "silu" else _gpt_oss(inter=48)
    dense = m.loop_
    weights, ids = _routing(CASES["uneven groups"])
    x = torch.randn(ids.shape[0], HIDDEN)
    full = dense(torch.zeros_like(x), x, weights, ids)
    assert m.quantize_int8_() and m.gate_up_proj is None and m.operands()[0].dtype == torch.int8
    for case in ("uneven groups", "one token"):
        _check_against_the_loop(m, case)
    got = _run_module_op(m, x, weights, ids)
    assert (got - full).norm() < 0.02 * full.norm()  # int8's precision


def test_mxfp4_dequantization_is_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8)  # every code, either nibble
    scales = torch.randint(110, 140, (3, 40, 4), dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, rows]
    assert torch.equal(dequantize_mxfp4(blocks, scales), want.transpose(1, 2))
    w = torch.randn(3, 40, 128)
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(dequantize_mxfp4(blocks, scales))),
                       dequantize_mxfp4(blocks, scales))  # quantize_mxfp4 keeps what is representable
    assert (dequantize_mxfp4(*quantize_mxfp4(w)) - w).abs().max() < 0.25 * w.abs().max()

"""Mixture-of-experts layers: the router against transformers' own (ties included), the CPU expert op
(csrc/moe_cpu.cpp) against the per-expert loop, and the checkpoint layouts the experts load."""
import pytest
import torch
import transformers

from pagoda.engine.layers import cpu_ops
from pagoda.engine.layers.moe import Experts, Router

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

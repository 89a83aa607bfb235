"""The Triton MoE experts (engine/layers/triton_moe.py, in Triton's interpreter without CUDA) against the per-expert
torch loop (Experts.loop_): the routing's alignment to row blocks, SiLU-and-mul and gpt-oss's biases and clamped
SwiGLU, float32, 16-bit and int8 experts, top_k 1 to 3, groups of one to several blocks and experts with none.

float32 agrees to rounding (the kernels sum the hidden size in another order). 16-bit agrees within a few of its
ulps of the output's scale: the loop rounds its intermediates (x W13^T, the activation's steps) to the dtype, the
kernels only h and the output."""
import os

import pytest
import torch

from pagoda.engine.layers.moe import Experts, GptOssExperts

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton_moe is imported (triton reads it then)

HIDDEN, INTER, EXPERTS = 64, 40, 8  # 40: a partial column block (BLOCK_N 64, BLOCK_K 32 in float32)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}  # of the reference's largest magnitude
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

CASES = {
    "uneven groups": [[0, 3], [3, 5], [3, 0], [7, 3], [1, 2], [5, 3], [3, 6], [0, 1], [2, 3], [4, 3], [3, 7]],
    "one token": [[6, 2]],
    # expert 0 in every row: 20 pairs, two blocks of 16
    "one expert takes every token": [[0, e % 7 + 1] if e % 2 else [e % 7 + 1, 0] for e in range(20)],
    "most experts get none": [[2, 5]] * 9,
    "top_k 1": [[3], [1], [3], [6], [3]],
    "top_k 3": [[0, 3, 5], [3, 5, 7], [6, 0, 3], [7, 3, 1]],
}


def _tm():
    pytest.importorskip("triton")
    import importlib

    from triton.runtime.interpreter import InterpretedFunction

    from pagoda.engine.layers import triton_attention as ta, triton_moe as tm
    if not torch.cuda.is_available() and not isinstance(tm._down_kernel, InterpretedFunction):
        # imported earlier in this session without the interpreter: triton_moe calls triton_attention's _dot
        if not isinstance(ta._decode_kernel, InterpretedFunction):
            importlib.reload(ta)
        tm = importlib.reload(tm)
    return tm


def _experts(dtype=torch.float32, inter=INTER, seed=0) -> Experts:
    torch.manual_seed(seed)
    m = Experts(EXPERTS, HIDDEN, inter, "silu")
    with torch.no_grad():
        m.gate_up_proj.normal_(0, 0.3)
        m.down_proj.normal_(0, 0.3)
    return m.to(dtype).requires_grad_(False)


def _gpt_oss(dtype=torch.float32, limit=1.0, seed=0) -> GptOssExperts:
    """gpt-oss's experts with random weights and biases; a limit the random projections pass often."""
    torch.manual_seed(seed)
    m = GptOssExperts(EXPERTS, HIDDEN, INTER, limit, 1.702)
    with torch.no_grad():
        for p in (m.gate_up_proj, m.down_proj, m.gate_up_proj_bias, m.down_proj_bias):
            p.normal_(0, 0.3)
    return m.to(dtype).requires_grad_(False)


def _routing(case: str, seed=1):
    torch.manual_seed(seed)
    ids = torch.tensor(CASES[case], dtype=torch.int64)
    return torch.rand(ids.shape).softmax(-1), ids


def _run(tm, m: Experts, x, weights, ids, block_m=None):
    w13, w2, s13, s2 = (None if t is None else t.to(DEVICE) for t in m.operands())
    b13, b2 = (None if b is None else b.to(DEVICE) for b in (m.gate_up_proj_bias, m.down_proj_bias))
    out = tm.fused_experts(x.to(DEVICE), w13, w2, weights.to(DEVICE), ids.to(DEVICE), s13, s2, b13, b2,
                           **m.swiglu(), block_m=block_m)
    assert out.shape == x.shape and out.dtype == x.dtype
    return out.cpu()


def _close(got, want, dtype):
    scale = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= TOL[dtype] * scale


def _check(m: Experts, case: str, dtype=torch.float32, block_m=None):
    weights, ids = _routing(case)
    x = torch.randn(ids.shape[0], HIDDEN).to(dtype)
    got = _run(_tm(), m, x, weights, ids, block_m)
    _close(got, m.loop_(torch.zeros_like(x), x, weights, ids), dtype)
    return got, x, weights, ids


def test_align_groups_each_experts_pairs_in_whole_blocks():
    tm = _tm()
    _, ids = _routing("uneven groups")
    sorted_pairs, block_experts = tm.align(ids, EXPERTS, 4)
    blocks = sorted_pairs.view(-1, 4)
    assert blocks.shape[0] == block_experts.shape[0] == tm.triton.cdiv(ids.numel(), 4) + EXPERTS
    flat, none = ids.flatten(), ids.numel()
    for e in range(EXPERTS):
        rows = blocks[block_experts == e]
        want = torch.nonzero(flat == e).flatten().tolist()  # ascending, as loop_'s stable sort
        assert rows.shape[0] == -(-len(want) // 4)  # the fewest blocks that hold them
        assert rows.flatten()[:len(want)].tolist() == want and (rows.flatten()[len(want):] == none).all()
    assert (blocks[block_experts == EXPERTS] == none).all()  # the bound's spare blocks: no pair
    assert torch.equal(block_experts, block_experts.sort().values)


@pytest.mark.parametrize("case", list(CASES))
def test_silu_experts_match_the_loop_in_float32(case):
    _check(_experts(), case, block_m=16)


def test_larger_row_blocks_match_too():
    _check(_experts(), "uneven groups", block_m=64)


@pytest.mark.parametrize("case", ["uneven groups", "one expert takes every token", "top_k 1"])
def test_bfloat16_experts_match_the_loop_within_its_precision(case):
    m = _experts(torch.bfloat16)
    got, x, weights, ids = _check(m, case, torch.bfloat16)
    full = _experts(torch.float32).loop_(torch.zeros(x.shape), x.float(), weights, ids)  # and float32 math
    _close(got, full, torch.bfloat16)


def test_float16_experts_match_the_loop():
    _check(_experts(torch.float16), "top_k 3", torch.float16)


@pytest.mark.parametrize("case", ["uneven groups", "one token", "one expert takes every token"])
def test_gpt_oss_biases_and_clamped_swiglu(case):
    m = _gpt_oss()
    x = torch.randn(64, HIDDEN)
    gate, up = (x @ m.gate_up_proj[3].t() + m.gate_up_proj_bias[3]).chunk(2, dim=-1)
    assert (gate > m.limit).any() and (up.abs() > m.limit).any()  # the clamps bite
    _check(m, case, block_m=16)


def test_gpt_oss_in_bfloat16():
    _check(_gpt_oss(torch.bfloat16), "uneven groups", torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_experts_match_the_loop_on_their_dequantized_weights(dtype):
    m = _experts(dtype, inter=48)  # quantize_int8_ takes multiples of 16
    assert m.quantize_int8_()
    _check(m, "uneven groups", dtype)


def test_experts_no_token_chose_are_never_read():
    m = _gpt_oss()
    with torch.no_grad():
        for e in set(range(EXPERTS)) - {2, 5}:
            for p in (m.gate_up_proj, m.down_proj, m.gate_up_proj_bias, m.down_proj_bias):
                p[e] = float("nan")
    got, *_ = _check(m, "most experts get none")
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("what", ["a weight", "a bias", "a routing weight"])
def test_a_wrong_operand_shows(what):
    """The comparison is tight enough to see one wrong element: one of the 40 x 64 weights of one expert (3, which
    half the tokens chose), a bias, or one pair's routing weight, each off by 0.05."""
    tm, m = _tm(), _gpt_oss()
    weights, ids = _routing("uneven groups")
    x = torch.randn(ids.shape[0], HIDDEN)
    want = m.loop_(torch.zeros_like(x), x, weights, ids)
    with torch.no_grad():
        if what == "a weight":
            m.down_proj[3, 7, 11] += 0.05
        elif what == "a bias":
            m.gate_up_proj_bias[3, INTER + 5] += 0.05
        else:
            weights[4, 1] += 0.05
    with pytest.raises(AssertionError):
        _close(_run(tm, m, x, weights, ids), want, torch.float32)


def test_forward_gives_the_kernels_only_weights_they_take():
    from pagoda.engine.layers.moe import _triton_moe

    tm = _tm()
    w = lambda dtype: torch.empty(2, 4, dtype=dtype)  # noqa: E731
    assert _triton_moe(w(torch.bfloat16), w(torch.bfloat16)) is tm and _triton_moe(w(torch.int8), w(torch.int8)) is tm
    assert _triton_moe(w(torch.bfloat16), w(torch.uint8)) is None  # a GGUF file's blocks, say: the op or the loop


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (Experts.forward's Triton path)")
@pytest.mark.parametrize("gpt_oss", [False, True])
def test_forward_on_cuda_takes_the_kernels(gpt_oss, monkeypatch):
    tm = _tm()
    m = (_gpt_oss() if gpt_oss else _experts()).cuda()
    calls = []
    fused = tm.fused_experts
    monkeypatch.setattr(tm, "fused_experts", lambda *a, **kw: calls.append(1) or fused(*a, **kw))
    weights, ids = (t.cuda() for t in _routing("uneven groups"))
    x = torch.randn(ids.shape[0], HIDDEN, device="cuda")
    got = m(x, weights, ids)
    assert calls
    _close(got.cpu(), m.loop_(torch.zeros_like(x), x, weights, ids).cpu(), torch.float32)

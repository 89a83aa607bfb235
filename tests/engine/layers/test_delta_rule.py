"""The causal conv1d and the gated delta rule of linear-attention layers: the C++ ops (csrc/delta_rule_cpu.cpp)
and the Triton kernels (triton_delta_rule.py, in Triton's interpreter without CUDA) against the torch reference
(engine/layers/delta_rule.py *_reference), on varlen batches of one-token and longer sequences in shuffled slots.

float32 agrees to ~1e-5 of the output's scale, not bitwise: the kernels sum in another order (the chunked form's
triangular solve and matrix products by rows). bfloat16 agrees within a few of its ulps (outputs rounded once)."""
import os

import pytest
import torch

from pagoda.engine.layers import cpu_ops, delta_rule

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton_delta_rule is imported (triton reads it then)

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}  # of the reference's largest magnitude
NUM_SLOTS = 8


def _cpp():
    ok, why = cpu_ops.is_available(torch.device("cpu"))
    if not ok:
        pytest.skip(why)
    return cpu_ops.ops()


def _triton():
    pytest.importorskip("triton")
    import importlib

    from pagoda.engine.layers import triton_delta_rule as td
    if not torch.cuda.is_available() and not td.interpreted():
        td = importlib.reload(td)  # imported earlier in this session without the interpreter
    return td, torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _batch(lens, seed=0):
    # -> query_start_loc [num_seqs + 1] int32, state_slots [num_seqs] int64 (shuffled, distinct)
    gen = torch.Generator().manual_seed(seed)
    starts = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    return starts, torch.randperm(NUM_SLOTS, generator=gen)[:len(lens)]


def _conv_inputs(n, channels, kernel, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(n, channels + 8, generator=gen).to(dtype)  # x: strided rows, as a split of a projection
    weight = (torch.randn(channels, kernel, generator=gen) * 0.5).to(dtype)
    state = torch.randn(NUM_SLOTS, channels, kernel - 1, generator=gen).to(dtype)
    return wide[:, 4:4 + channels], weight, state


def _rule_inputs(n, hk, hv, dk, dv, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, 2 * hk * dk + hv * dv, generator=gen).to(dtype)  # q, k, v: views of one row, as the layer's
    q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.view(n, hk, dk), k.view(n, hk, dk), v.view(n, hv, dv)
    g = -torch.rand(n, hv, generator=gen) * 0.7  # log decays
    beta = torch.rand(n, hv, generator=gen)
    state = torch.randn(NUM_SLOTS, hv, dk, dv, generator=gen) * 0.2
    return q, k, v, g, beta, state


def _close(got, want, dtype):
    scale = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= TOL[dtype] * scale


# lengths: one-token decodes beside prefills shorter than the conv kernel, under, at and past CHUNK (64)
LENS = [1, 2, 70, 1, 3, 130, 64, 1]
SMALL_LENS = [1, 2, 9, 1, 3]  # for the interpreter


def _check_conv(fn, lens, dtype, device, channels=40, kernel=4):
    qsl, slots = _batch(lens)
    x, weight, state = _conv_inputs(int(qsl[-1]), channels, kernel, dtype)
    want_state = state.clone()
    want = delta_rule.causal_conv1d_reference(x, weight, want_state, qsl, slots)
    state = state.to(device)
    got = fn(x.to(device), weight.to(device), state, qsl.to(device), slots.to(device))
    _close(got.cpu(), want, dtype)
    assert torch.equal(state.cpu(), want_state)  # the last inputs, copied


def _check_rule(fn, lens, dtype, device, shape=(2, 4, 32, 48)):
    qsl, slots = _batch(lens)
    q, k, v, g, beta, state = _rule_inputs(int(qsl[-1]), *shape, dtype)
    want_state = state.clone()
    want = delta_rule.gated_delta_rule_reference(q, k, v, g, beta, want_state, qsl, slots)
    state = state.to(device)
    got = fn(*(t.to(device) for t in (q, k, v, g, beta)), state, qsl.to(device), slots.to(device))
    assert got.dtype == dtype
    _close(got.cpu(), want, dtype)
    _close(state.cpu(), want_state, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_causal_conv1d(dtype):
    _check_conv(_cpp().causal_conv1d_, LENS, dtype, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_gated_delta_rule(dtype):
    # GQA: 4 value heads over 2 key heads; head dims off the vector width
    _check_rule(_cpp().gated_delta_rule_, LENS, dtype, "cpu")


def test_cpp_gated_delta_rule_wide_heads():
    # head_v_dim past one block of state columns (64), no GQA
    _check_rule(_cpp().gated_delta_rule_, [1, 65, 1], torch.float32, "cpu", shape=(2, 2, 64, 80))


def test_cpp_chunks_equal_whole():
    # a prompt run in pieces of different sizes (one token, shorter than the kernel, past CHUNK) ends in the
    # whole prompt's states, with its outputs
    ops, lens = _cpp(), [150]
    qsl, slots = _batch(lens)
    x, weight, conv_state = _conv_inputs(150, 40, 4, torch.float32)
    q, k, v, g, beta, state = _rule_inputs(150, 2, 4, 32, 32, torch.float32)
    conv_state[slots] = 0
    state[slots] = 0
    whole_conv, whole_state = conv_state.clone(), state.clone()
    conv_want = ops.causal_conv1d_(x, weight, whole_conv, qsl, slots)
    want = ops.gated_delta_rule_(q, k, v, g, beta, whole_state, qsl, slots)
    convs, outs, a = [], [], 0
    for n in (1, 2, 67, 1, 79):
        piece = torch.tensor([0, n], dtype=torch.int32)
        convs.append(ops.causal_conv1d_(x[a:a + n], weight, conv_state, piece, slots))
        outs.append(ops.gated_delta_rule_(q[a:a + n], k[a:a + n], v[a:a + n], g[a:a + n], beta[a:a + n], state,
                                          piece, slots))
        a += n
    assert torch.equal(torch.cat(convs), conv_want) and torch.equal(conv_state, whole_conv)
    _close(torch.cat(outs), want, torch.float32)
    _close(state, whole_state, torch.float32)


def test_dispatch_uses_cpp_where_loaded():
    ops = _cpp()
    qsl, slots = _batch([1, 5])
    q, k, v, g, beta, state = _rule_inputs(6, 1, 2, 16, 16, torch.float32)
    state2 = state.clone()
    got = delta_rule.gated_delta_rule(q, k, v, g, beta, state, qsl, slots)
    assert torch.equal(got, ops.gated_delta_rule_(q, k, v, g, beta, state2, qsl, slots))
    assert torch.equal(state, state2)


def test_cpp_rejects_bad_slots():
    ops = _cpp()
    q, k, v, g, beta, state = _rule_inputs(2, 1, 1, 16, 16, torch.float32)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.gated_delta_rule_(q, k, v, g, beta, state, torch.tensor([0, 2]), torch.tensor([NUM_SLOTS]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_causal_conv1d(dtype):
    td, device = _triton()
    _check_conv(td.causal_conv1d, SMALL_LENS, dtype, device, channels=24)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_gated_delta_rule(dtype):
    td, device = _triton()
    # 70: three chunks of 32; head_k_dim 24: two blocks of 16, one part masked
    _check_rule(td.gated_delta_rule, [1, 2, 70, 1, 5], dtype, device, shape=(1, 2, 24, 16))

"""Sampler: exact masks on hand-made logits, seeded reproducibility, the softmax law."""
import math

import pytest
import torch
from scipy.stats import chisquare

from pagoda.engine import LLM, SamplingParams
from pagoda.engine.layers.sampler import Sampler, SamplingTensors, apply_allowed, min_p_mask, top_k_top_p_mask

NEG = float("-inf")


def test_top_k_mask_exact():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [0.5, 0.1, 0.3, 0.2]])
    out = top_k_top_p_mask(logits, torch.tensor([2, 1]), None)
    assert out.tolist() == [[NEG, 4.0, 3.0, NEG], [0.5, NEG, NEG, NEG]]


@pytest.mark.parametrize("vocab", [70, 96])
@pytest.mark.parametrize("subset", [False, True])
def test_grammar_mask_exact(vocab, subset):
    """apply_allowed: -inf exactly outside each constrained row's allowed bits (bit j of word w is token
    32 * w + j), other rows untouched; with rescue, a row left with nothing keeps the grammar's set."""
    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    rows = torch.tensor([3, 0]) if subset else None
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (2 if subset else 4, words), dtype=torch.int32, generator=g)
    bits[1, :] = 0
    bits[1, 1] = 1 << 7  # row 1 of the masks: token 39 only
    logits = torch.randn(4, vocab, generator=g)
    allowed = [{32 * w + j for w in range(words) for j in range(32) if int(b[w]) >> j & 1} for b in bits]
    got = logits.clone()
    apply_allowed(got, rows, bits, rescue=False)
    for i, r in enumerate(rows.tolist() if subset else range(4)):
        assert [t for t in range(vocab) if got[r, t] != NEG] == sorted(t for t in allowed[i] if t < vocab)
        assert torch.equal(got[r][got[r] != NEG], logits[r][got[r] != NEG])
    assert subset is False or torch.equal(got[[1, 2]], logits[[1, 2]])
    banned = logits.clone()
    banned[0 if subset else 1, 39] = NEG  # the only allowed token of a row banned (logit_bias -100)
    apply_allowed(banned, rows, bits, rescue=True)
    row = banned[0 if subset else 1]
    assert row[39] == 0 and (row[torch.arange(vocab) != 39] == NEG).all()


def test_top_p_mask_exact():
    # probs 0.5, 0.25, 0.125, 0.125 (in that order of logits)
    logits = torch.tensor([[0.5, 0.25, 0.125, 0.125]]).log()
    assert top_k_top_p_mask(logits, None, torch.tensor([0.5]))[0].isfinite().tolist() == [True, False, False, False]
    assert top_k_top_p_mask(logits, None, torch.tensor([0.6]))[0].isfinite().tolist() == [True, True, False, False]
    assert top_k_top_p_mask(logits, None, torch.tensor([0.0]))[0].isfinite().tolist() == [True, False, False, False]
    assert top_k_top_p_mask(logits, None, torch.tensor([0.75]))[0].isfinite().tolist() == [True, True, False, False]
    assert top_k_top_p_mask(logits, None, torch.tensor([0.8]))[0].isfinite().sum() == 3  # one of the 0.125 pair
    assert top_k_top_p_mask(logits, None, torch.tensor([1.0]))[0].isfinite().all()


def test_top_k_then_top_p_combined():
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    # top_k 3 renormalises to 4/9, 3/9, 2/9; top_p 0.5 then keeps the first two
    out = top_k_top_p_mask(logits, torch.tensor([3]), torch.tensor([0.5]))
    assert out[0].isfinite().tolist() == [True, True, False, False]


def test_min_p_mask_exact():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    out = min_p_mask(logits, torch.tensor([0.3]))  # threshold 0.15
    assert out[0].isfinite().tolist() == [True, True, True, False]


def _tensors(n, temperature, generators=()):
    return SamplingTensors(temperature=torch.full((n,), temperature), top_k=None, top_p=None, min_p=None,
                           is_greedy=torch.zeros(n, dtype=torch.bool), all_greedy=False,
                           generators=list(generators))


def test_temperature_sampling_follows_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    T, n = 0.7, 20000
    sampler = Sampler(seed=123, device=torch.device("cpu"))
    tokens, _ = sampler(logits.repeat(n, 1), _tensors(n, T))
    observed = torch.bincount(tokens, minlength=5).double()
    expected = torch.softmax(logits.double() / T, dim=0) * n
    assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-3
    # and a wrong temperature is rejected by the same test
    wrong = torch.softmax(logits.double(), dim=0) * n
    assert chisquare(observed.numpy(), wrong.numpy()).pvalue < 1e-6


def test_seeded_row_independent_of_batch():
    logits = torch.randn(6, 50)
    def draw(rows, seed):
        gen = torch.Generator().manual_seed(seed)
        sampler = Sampler(seed=len(rows), device=torch.device("cpu"))  # other rows use another stream
        out = []
        for _ in range(5):
            toks, _ = sampler(logits[rows], _tensors(len(rows), 1.0, [(0, gen)]))
            out.append(toks[0].item())
        return out
    assert draw([2], 7) == draw([2, 0, 1, 5], 7) == draw([2, 4], 7)
    assert draw([2], 7) != draw([2], 8)


def test_penalties_and_min_tokens_end_to_end(checkpoint):
    llm = LLM(checkpoint("llama"), dtype="float32", num_kv_blocks=64)
    prompt = [5, 6, 7, 8, 9]
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert len(set(greedy.token_ids)) < len(greedy.token_ids), "want repeats to penalise"
    # a huge frequency penalty forbids any repeat
    pen = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                frequency_penalty=2.0, repetition_penalty=1.0))[0]
    rep = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                repetition_penalty=50.0))[0]
    assert pen.token_ids != greedy.token_ids and rep.token_ids != greedy.token_ids
    assert len(set(rep.token_ids) & set(prompt)) == 0 or rep.token_ids[0] not in prompt
    # min_tokens suppresses the stop token until reached
    first = greedy.token_ids[0]
    stopped = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[first]))[0]
    assert stopped.token_ids == [first] and stopped.stop_reason == "stop_token"
    held = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[first],
                                                 min_tokens=3))[0]
    assert first not in held.token_ids[:3] and len(held.token_ids) >= 3


def test_seed_reproducible_across_batches(checkpoint):
    llm = LLM(checkpoint("llama"), dtype="float32", num_kv_blocks=128)
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([[1, 2, 3]], p)[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True)] * 5
    mixed = llm.generate([[9, 9], [1, 2, 3], [4] * 30, [5], [6] * 17, [7, 8]], [others[0], p] + others[1:])
    assert mixed[1].token_ids == alone
    assert llm.generate([[1, 2, 3]], SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=99,
                                                    max_tokens=16, ignore_eos=True))[0].token_ids != alone


def test_logprobs(checkpoint):
    llm = LLM(checkpoint("llama"), dtype="float32", num_kv_blocks=64)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, logprobs=True, top_logprobs=3,
                                                   ignore_eos=True))[0]
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0][0] == tok  # greedy picks the most likely
        assert math.isclose(lp.top[0][1], lp.logprob, rel_tol=1e-6)


@pytest.mark.parametrize("field,value", [("top_p", 1.5), ("top_p", -0.1), ("temperature", -1.0),
                                         ("max_tokens", -3), ("top_k", -2), ("min_p", 2.0),
                                         ("temperature", float("nan")), ("top_logprobs", 21), ("seed", -2**63 - 1),
                                         ("presence_penalty", 3.0), ("repetition_penalty", 0.0)])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})

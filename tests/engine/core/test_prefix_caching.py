"""Prefix caching end to end: same greedy tokens with caching on and off (and as transformers),
reuse reported, nothing leaked; n > 1 completions share the prompt's blocks."""
import random

from pagoda.engine import LLM, SamplingParams
from oracle import greedy

PREFIX = [random.Random(1).randrange(200) for _ in range(40)]  # 2 full blocks of 16, and 8 more
TAILS = [[7], [8, 9, 10], [11] * 20, [12, 13], [14] * 9]


def _run(path, caching: bool):
    llm = LLM(path, dtype="float32", num_kv_blocks=64, enable_prefix_caching=caching)
    params = SamplingParams(temperature=0, max_tokens=10)
    first = llm.generate([PREFIX + TAILS[0]], params)
    rest = llm.generate([PREFIX + t for t in TAILS[1:]], params)
    return llm, first + rest


def test_caching_on_off_and_transformers_agree(checkpoint):
    path = checkpoint("qwen3")
    on_llm, on = _run(path, True)
    _, off = _run(path, False)
    expected = greedy(path, [PREFIX + t for t in TAILS], 10)
    assert [o.token_ids for o in on] == [o.token_ids for o in off] == expected
    assert on[0].num_cached_tokens == 0
    assert [o.num_cached_tokens for o in on[1:]] == [32] * 4  # the two full blocks of the prefix
    assert all(o.num_cached_tokens == 0 for o in off)
    s = on_llm.engine.stats()
    assert s.num_free_blocks == s.num_total_blocks and s.num_cached_blocks > 0
    assert s.num_cached_prompt_tokens == 128 and 0 < s.prefix_cache_hit_rate < 1


def test_preempted_sequences_recompute_from_cache(checkpoint):
    path = checkpoint("llama")
    prompts = [PREFIX + t for t in TAILS]
    llm = LLM(path, dtype="float32", num_kv_blocks=12, max_num_batched_tokens=32, max_model_len=128)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    assert [o.token_ids for o in outs] == greedy(path, prompts, 12)
    s = llm.engine.stats()
    assert s.num_preemptions > 0 and s.num_free_blocks == s.num_total_blocks


def test_n_completions_share_prompt_blocks(checkpoint):
    llm = LLM(checkpoint("llama"), dtype="float32", num_kv_blocks=64)
    prompt = PREFIX + [5]  # 41 tokens: 2 full blocks shareable
    params = SamplingParams(n=4, temperature=1.0, seed=42, max_tokens=8, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    assert len(out.choices) == 4 and [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.token_ids == out.choices[0].token_ids and out.outputs == out.choices
    assert out.prompt_token_ids == prompt
    assert len({tuple(c.token_ids) for c in out.choices}) > 1, "seeded choices should differ"
    # siblings reuse the first choice's full prompt blocks: 41 + 3 * 9 prompt tokens computed
    assert [c.num_cached_tokens for c in out.choices] == [0, 32, 32, 32]
    assert llm.engine.stats().num_prompt_tokens_processed == 41 + 3 * 9
    again = llm.generate([prompt], params)[0]
    assert [c.token_ids for c in again.choices] == [c.token_ids for c in out.choices]
    s = llm.engine.stats()
    assert s.num_free_blocks == s.num_total_blocks


def test_n_greedy_choices_identical(checkpoint):
    llm = LLM(checkpoint("gpt2"), dtype="float32", num_kv_blocks=64)
    out = llm.generate([[1, 2, 3]], SamplingParams(n=3, temperature=0, max_tokens=6))[0]
    assert out.choices[0].token_ids == out.choices[1].token_ids == out.choices[2].token_ids

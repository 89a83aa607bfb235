"""KV groups for a model mixing sliding and full layers (Gemma 3's five to one; engine/core/block_manager.py
kv_groups): every sliding group holds its window's blocks while the full group holds the context, so a fixed
KV budget holds more long sequences at once than one table for every layer would; greedy float32 output stays
transformers' own through chunked prefill, the prefix cache, preemption, n = 2 and speculative decoding."""
import pytest

from oracle import greedy, random_prompts
from pagoda.engine import LLM, SamplingParams
from pagoda.engine.demo import build_tiny_checkpoint

WINDOW = 16
GEMMA3 = dict(initializer_range=0.3, tie_word_embeddings=False, sliding_window=WINDOW, head_dim=16,
              query_pre_attn_scalar=24, num_hidden_layers=6)
GREEDY = SamplingParams(temperature=0.0, max_tokens=60)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("gemma3-hybrid")), "gemma3",
                                 layer_types=["sliding_attention"] * 5 + ["full_attention"], **GEMMA3)


def _held(table) -> int:
    return sum(b >= 0 for b in table)


def test_sliding_groups_hold_a_window_and_the_full_group_the_context(path):
    llm = LLM(path, dtype="float32", num_kv_blocks=80, block_size=16)
    groups = llm.engine.stats().kv_groups
    assert [(g.window, g.num_layers) for g in groups] == [(0, 1)] + [(WINDOW, 1)] * 5
    bm, peaks = llm.engine.block_manager, {}
    append = bm.append

    def watched(seq, num_tokens):
        append(seq, num_tokens)
        if seq.num_computed_tokens >= seq.num_prompt_tokens:  # decoding
            held = [_held(t) for t in seq.block_tables]
            assert held[0] == len(seq.block_table)  # the full group: every block of the context
            peaks[seq.seq_id] = max(peaks.get(seq.seq_id, 0), *held[1:])
    bm.append = watched
    prompts = random_prompts(llm.engine.hf_config.vocab_size, [130, 60])
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == greedy(path, prompts, 60)
    assert peaks and max(peaks.values()) <= WINDOW // 16 + 1
    s = llm.engine.stats()
    assert s.num_free_blocks == s.num_total_blocks and [g.blocks_used for g in s.kv_groups] == [0] * 6


def test_a_kv_budget_holds_more_long_sequences_than_full_attention_would(path, tmp_path):
    """1 MiB of KV, eight 380-token prompts and 20 new tokens: one table for every layer decodes one sequence at a
    time (42 blocks of six layers; a sequence takes 25), the groups seven (256 blocks of one layer; a sequence
    takes 25 for its full layer and 2 for each of its five sliding ones)."""
    full = build_tiny_checkpoint(str(tmp_path / "full"), "gemma3", layer_types=["full_attention"] * 6, **GEMMA3)
    peaks = {}
    for name, p in (("hybrid", path), ("full", full)):
        llm = LLM(p, dtype="float32", kv_cache_memory="1MiB", block_size=16, max_num_seqs=8)
        sched = llm.engine.scheduler
        schedule, peak = sched.schedule, [0]

        def watched():  # sequences decoding at once (a prompt admitted in part may be preempted again)
            out = schedule()
            peak[0] = max(peak[0], sum(s.num_computed_tokens >= s.num_prompt_tokens for s in sched.running))
            return out
        sched.schedule = watched
        prompts = random_prompts(llm.engine.hf_config.vocab_size, [380] * 8, seed=3)
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
        assert [len(o.token_ids) for o in outs] == [20] * 8
        peaks[name] = peak[0]
        llm.engine.close()
    assert peaks == {"hybrid": 7, "full": 1}


def test_chunked_prefill_prefix_cache_preemption_n_and_speculation(path):
    llm = LLM(path, dtype="float32", num_kv_blocks=40, block_size=16, max_num_batched_tokens=24)
    prompts = random_prompts(llm.engine.hf_config.vocab_size, [90, 70, 50, 1], seed=1)
    want = greedy(path, prompts, 60)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    two = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=60, n=2))
    assert [c.token_ids for c in two[0].choices] == [want[0], want[0]]
    s = llm.engine.stats()
    assert s.num_free_blocks == s.num_total_blocks and s.num_preemptions > 0
    roomy = LLM(path, dtype="float32", num_kv_blocks=200, block_size=16,
                speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    roomy.generate(prompts[:1], GREEDY)
    again = roomy.generate(prompts[:1], GREEDY)  # the full group's blocks, and the sliding groups' last, cached
    assert again[0].token_ids == want[0] and again[0].num_cached_tokens == 80
    spec = roomy
    assert [o.token_ids for o in spec.generate(prompts, GREEDY)] == want
    s = spec.engine.stats()
    assert s.num_free_blocks == s.num_total_blocks

"""KV memory that follows a sliding window (engine/core/block_manager.py): a model whose every layer slides
(Mistral v0.1's kind) gives back the blocks behind the window as it goes, so one sequence holds its window
and one step's tokens whatever its length; the context stays the checkpoint's. Greedy float32 output stays
transformers' own through chunked prefill, the prefix cache, preemption, n = 2 and speculative decoding."""
import pytest

from oracle import greedy, random_prompts
from pagoda.engine import LLM, SamplingParams
from pagoda.engine.demo import build_tiny_checkpoint

WINDOW = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=100)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("mistral-window")), "mistral", initializer_range=0.3,
                                 sliding_window=WINDOW)


def _held(seq) -> int:
    return sum(b >= 0 for b in seq.block_table)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_a_long_prompt_and_its_continuation_run_in_eight_blocks(path, backend):
    """130 prompt tokens and 100 new ones, beside a second sequence, in 8 blocks of 16 (128 slots); while
    decoding each sequence holds its window's blocks and the one being written, no more."""
    llm = LLM(path, dtype="float32", num_kv_blocks=8, block_size=16, attention_backend=backend)
    assert llm.engine.config.max_model_len == 512  # the checkpoint's, not the cache's 128 nor the window
    bm, peaks = llm.engine.block_manager, {}
    append = bm.append

    def watched(seq, num_tokens):
        append(seq, num_tokens)
        if seq.num_computed_tokens >= seq.num_prompt_tokens:  # decoding
            peaks[seq.seq_id] = max(peaks.get(seq.seq_id, 0), _held(seq))
    bm.append = watched
    prompts = random_prompts(llm.engine.hf_config.vocab_size, [130, 60])
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == greedy(path, prompts, 100)
    assert sum(len(o.token_ids) for o in outs) > 120  # long continuations, past the window
    assert peaks and max(peaks.values()) <= WINDOW // 16 + 1
    s = llm.engine.stats()
    assert s.num_free_blocks == s.num_total_blocks == 8


def test_chunked_prefill_prefix_cache_preemption_and_n(path):
    llm = LLM(path, dtype="float32", num_kv_blocks=8, block_size=16, max_num_batched_tokens=24)
    prompts = random_prompts(llm.engine.hf_config.vocab_size, [90, 70, 50, 1], seed=1)
    want = greedy(path, prompts, 100)
    outs = llm.generate(prompts, GREEDY)  # four sequences of 3 blocks each while decoding, in 8: preempted
    assert [o.token_ids for o in outs] == want
    two = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=100, n=2))
    assert [c.token_ids for c in two[0].choices] == [want[0], want[0]]
    s = llm.engine.stats()
    assert s.num_free_blocks == s.num_total_blocks and s.num_preemptions > 0
    roomy = LLM(path, dtype="float32", num_kv_blocks=64, block_size=16)
    roomy.generate(prompts[:1], GREEDY)
    again = roomy.generate(prompts[:1], GREEDY)  # the blocks given back during the first run stayed cached
    assert again[0].token_ids == want[0] and again[0].num_cached_tokens == 80


def test_speculative_decoding_through_a_window(path):
    llm = LLM(path, dtype="float32", num_kv_blocks=8, block_size=16,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    prompts = random_prompts(llm.engine.hf_config.vocab_size, [130, 40], seed=2)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == greedy(path, prompts, 100)
    s = llm.engine.stats()
    assert s.num_free_blocks == s.num_total_blocks


def test_a_cache_smaller_than_one_window_is_refused_naming_the_option(path):
    with pytest.raises(ValueError, match=r"num_kv_blocks 2 cannot hold one sliding window \(32 tokens\)"):
        LLM(path, dtype="float32", num_kv_blocks=2, block_size=16)

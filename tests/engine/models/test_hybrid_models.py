"""Hybrid linear-attention models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next: gated DeltaNet layers beside gated full
attention) with the engine's scheduling: chunked prefill (chunks shorter than the conv kernel too), batches
mixing prefill and decode, preemption and recompute, n = 2 give transformers' greedy tokens, and every state
slot is free after. Prefix caching is turned off for them and speculative decoding is refused, each naming
why. (Greedy matches per backend, Triton attention included: test_correctness.py; two tensor-parallel ranks:
tests/engine/executor/test_tensor_parallel.py; every door: tests/server/test_family_doors.py.)"""
import logging

import pytest

from conftest import HYBRID
from oracle import greedy, random_prompts
from pagoda.engine import LLM, SamplingParams


@pytest.mark.parametrize("budget", [3, 24])  # 3: chunks shorter than the conv kernel (4)
@pytest.mark.parametrize("family", HYBRID)
def test_chunked_prefill_preemption_and_n2_match_transformers(checkpoint, family, budget):
    path = checkpoint(family)
    prompts = random_prompts(256, [1, 2, 5, 17, 40, 70], seed=3)
    want = greedy(path, prompts, 12)
    # 6 prompts x 2 sequences need ~24 blocks of 16; 8 force preemptions (where the budget lets many run)
    llm = LLM(path, dtype="float32", num_kv_blocks=8, block_size=16, max_num_batched_tokens=budget,
              max_model_len=128)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, n=2))
    assert [[c.token_ids for c in o.choices] for o in outs] == [[w, w] for w in want]
    stats = llm.engine.block_manager.stats()
    assert llm.engine.scheduler.num_preemptions > 0 or budget == 3
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_state_slots == 256 and stats.num_used_state_slots == 0


def test_prefix_caching_is_turned_off_saying_why(checkpoint, caplog):
    path = checkpoint("qwen3_5")
    prompt = list(range(40, 90))
    with caplog.at_level(logging.WARNING, logger="pagoda.engine"):
        llm = LLM(path, dtype="float32", num_kv_blocks=32)
    assert "prefix caching off for Qwen3_5ForCausalLM: its linear-attention layers keep one state" in caplog.text
    params = SamplingParams(temperature=0.0, max_tokens=8)
    first, again = (llm.generate([prompt], params)[0] for _ in range(2))
    assert first.token_ids == again.token_ids == greedy(path, [prompt], 8)[0]
    assert again.num_cached_tokens == 0 and not llm.engine.config.enable_prefix_caching


@pytest.mark.parametrize("option, message", [
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     r"speculative_config: Qwen3_5ForCausalLM has linear-attention layers, whose state takes in every token"),
])
def test_what_hybrid_models_cannot_do_is_refused_by_name(checkpoint, option, message):
    with pytest.raises(ValueError, match=message):
        LLM(checkpoint("qwen3_5"), dtype="float32", num_kv_blocks=16, **option)


def test_states_are_counted_in_the_memory_budget(checkpoint):
    """A slot per running sequence, as many as half the budget holds (here all of max_num_seqs), and the KV
    blocks from the rest."""
    llm = LLM(checkpoint("qwen3_5"), dtype="float32", kv_cache_memory="1MiB", max_num_seqs=4)
    runner, blocks = llm.engine.runner, llm.engine.config.num_kv_blocks
    per_slot = runner.state_bytes_per_slot()
    layer = runner.linear_layers[0]
    assert per_slot == 3 * (4 * layer.conv_dim * 3 + 4 * 4 * 16 * 8)  # 3 layers: conv [96, 3], state [4, 16, 8]
    assert llm.engine.block_manager.num_state_slots == 4
    assert blocks == (2**20 - 4 * per_slot) // runner.kv_bytes_per_block(16, llm.engine.kv_groups)
    assert tuple(layer.ssm_state.shape) == (4, 4, 16, 8) and tuple(layer.conv_state.shape) == (4, 96, 3)

"""Scheduler over integers (no model): the token budget, chunked prefill, preemption order, the
prefix cache's bookkeeping, and update_from_output's stop checks."""
import pytest

from pagoda.engine.core.block_manager import BlockManager
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.core.scheduler import Scheduler, check_stop
from pagoda.engine.core.sequence import Sequence, SequenceStatus
from pagoda.engine.outputs import FinishReason



def seq(name, n_prompt, max_tokens=8, priority=0):
    start = 1000 * sum(map(ord, name))  # distinct prompts: no prefix sharing between test sequences
    return Sequence(name, list(range(start, start + n_prompt)), SamplingParams(max_tokens=max_tokens),
                    priority=priority)


def toks(name, ids, max_tokens=4, **params):
    return Sequence(name, list(ids), SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=frozenset({2}))


def _run_to_completion(sched: Scheduler, token=7, max_steps=500):
    """Drive the scheduler as the engine would, sampling a fixed token; returns per-step outputs."""
    steps = []
    for _ in range(max_steps):
        if not sched.has_work():
            return steps
        out = sched.schedule()
        assert out.seqs, "no progress: deadlock"
        assert out.num_tokens <= sched.max_num_batched_tokens
        steps.append(out)
        sched.update_from_output(out, [[token]] * sum(out.num_sampled))
    raise AssertionError("did not finish")


def test_decodes_first_then_waiting_under_token_budget():
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=10, max_model_len=64)
    a, b = seq("a", 6), seq("b", 6)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    # a takes 6, b gets the remaining 4 as a first chunk (chunked prefill)
    assert [s.request_id for s in out.seqs] == ["a", "b"] and out.num_new_tokens == [6, 4]
    assert a.block_table == [0, 1] and b.block_table == [2]
    assert out.num_sampled == [1, 0]
    sched.update_from_output(out, [[9]])
    out = sched.schedule()
    # a decodes (1 token, listed first); b finishes its prompt (2 tokens)
    assert [s.request_id for s in out.seqs] == ["a", "b"] and out.num_new_tokens == [1, 2]
    assert b.block_table == [2, 3]


def test_preempts_newest_and_recomputes_without_deadlock():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=16)
    a, b = seq("a", 4, max_tokens=8), seq("b", 4, max_tokens=8)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert a.block_table == [0] and b.block_table == [1]
    sched.update_from_output(out, [[5], [5]])
    # each now needs a second block: 2 free, fine
    out = sched.schedule()
    assert a.block_table == [0, 2] and b.block_table == [1, 3]
    sched.update_from_output(out, [[5], [5]])
    for _ in range(3):
        sched.update_from_output(sched.schedule(), [[5], [5]])
    # both hold 9 tokens' worth next step: a needs a third block, none free -> b (newest) preempted
    out = sched.schedule()
    assert out.preempted == [b] and b.status is SequenceStatus.PREEMPTED
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert a.block_table == [0, 2, 3]
    assert sched.num_preemptions == 1 and sched.waiting == [b]
    sched.update_from_output(out, [[5]])
    steps = _run_to_completion(sched)
    assert a.finish_reason is FinishReason.LENGTH and b.finish_reason is FinishReason.LENGTH
    assert a.num_generated_tokens == 8 and b.num_generated_tokens == 8
    # b came back with a full recompute of prompt + generated tokens
    assert any(s.seqs == [b] and s.num_new_tokens[0] > 1 for s in steps)
    assert bm.num_free_blocks == 4 and all(blk.ref_count == 0 for blk in bm.blocks)


def test_fifo_no_starvation_and_max_num_seqs():
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=100, max_model_len=64)
    seqs = [seq(f"s{i}", 3, max_tokens=2) for i in range(5)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [s.request_id for s in out.seqs] == ["s0", "s1"]
    finish_order = []
    sched.update_from_output(out, [[1], [1]])
    while sched.has_work():
        out = sched.schedule()
        assert len(sched.running) <= 2
        sched.update_from_output(out, [[1]] * sum(out.num_sampled))
        finish_order += [s.request_id for s in out.seqs if s.is_finished]
    assert finish_order == ["s0", "s1", "s2", "s3", "s4"]
    assert bm.num_free_blocks == 64


def test_priority_orders_waiting_and_victims():
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=100, max_model_len=64)
    low, high = seq("low", 3, priority=5), seq("high", 3, priority=0)
    sched.add(low)
    sched.add(high)
    assert [s.request_id for s in sched.schedule().seqs] == ["high"]


def test_abort_frees_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32)
    a, b = seq("a", 9), seq("b", 3)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    assert bm.num_free_blocks == 4
    sched.finish(a, FinishReason.ABORT)
    assert bm.num_free_blocks == 7 and a.is_finished and sched.running == [b]
    sched.finish(a, FinishReason.ABORT)  # idempotent
    assert bm.num_free_blocks == 7


def test_scheduler_reports_cached_prompt_tokens():
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    a = toks("a", range(10), max_tokens=2)
    sched.add(a)
    _run_to_completion(sched)
    b = toks("b", list(range(9)) + [77], max_tokens=2)
    sched.add(b)
    out = sched.schedule()
    assert out.seqs == [b] and out.num_new_tokens == [2]  # 8 cached, 2 computed
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 8
    assert sched.num_prompt_tokens_cached == 8 and sched.num_prompt_tokens_seen == 20
    sched.update_from_output(out, [[3]])
    _run_to_completion(sched)
    assert bm.num_free_blocks == 16


def test_waits_a_step_for_a_prefix_being_computed():
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    a, b = toks("a", range(10), max_tokens=2), toks("b", list(range(8)) + [70, 71], max_tokens=2)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert out.seqs == [a]  # b's first block is in flight in a
    sched.update_from_output(out, [[1]])
    out = sched.schedule()
    assert out.seqs == [a, b] and out.num_new_tokens == [1, 2] and b.num_cached_tokens == 8
    assert b.block_table[:2] == a.block_table[:2] and bm.blocks[a.block_table[0]].ref_count == 2


@pytest.mark.parametrize("num_waiting", [10, 2000])
def test_a_step_looks_at_the_head_of_the_queue_only(num_waiting):
    """The scheduler's per-step cost does not grow with the waiting queue: once the head does not
    fit, nothing behind it is examined (the block manager is asked about one waiting request)."""
    bm = BlockManager(num_blocks=8, block_size=4)
    sched = Scheduler(bm, max_num_seqs=64, max_num_batched_tokens=64, max_model_len=64)
    running = [seq(f"r{i}", 5, max_tokens=40) for i in range(3)]  # 6 of the 8 blocks, room to decode 3
    for s in running:
        sched.add(s)
    first = sched.schedule()
    assert first.seqs == running
    sched.update_from_output(first, [[7], [7], [7]])
    for i in range(num_waiting):
        sched.add(seq(f"w{i}", 12))  # 3 blocks each: none fits next to the running ones
    looked = []
    match = bm.match_prefix
    bm.match_prefix = lambda s: looked.append(s) or match(s)
    for _ in range(3):
        out = sched.schedule()
        assert out.seqs == running  # decodes only
        sched.update_from_output(out, [[7], [7], [7]])
    assert len(looked) == 3  # one waiting request per step, whatever the queue's length
    assert len(sched.waiting) == num_waiting


# ---- stop checks: one token at a time, through update_from_output ----

class _Detokenizer:
    """Stand-in for IncrementalDetokenizer: token t reads as chr(t)."""

    def __init__(self):
        self.text = ""

    def append(self, token):
        self.text += chr(token)

    def find_stop(self, stops, include):
        return any(s in self.text for s in stops)


def _generated(params: dict, prompt=(100, 101)) -> Sequence:
    """A sequence with a stand-in detokenizer, its tokens appended by the test."""
    s = toks("s", prompt, **params)
    s.detokenizer = _Detokenizer()
    return s


@pytest.mark.parametrize("params, tokens, want", [
    ({}, [2], FinishReason.EOS),
    ({"ignore_eos": True}, [2], None),
    ({"stop_token_ids": [9]}, [9], FinishReason.STOP_TOKEN),
    ({"stop": ["ab"]}, [ord("a"), ord("b")], FinishReason.STOP_STRING),
    ({"max_tokens": 2}, [5, 5], FinishReason.LENGTH),
    ({"min_tokens": 2}, [2], None),  # EOS under min_tokens does not stop
    ({"min_tokens": 2, "stop_token_ids": [9]}, [5, 9], FinishReason.STOP_TOKEN),
])
def test_check_stop_each_kind(params, tokens, want):
    s = _generated(params)
    got = None
    for t in tokens:
        s.token_ids.append(t)
        got = check_stop(s, max_model_len=64)
    assert got is want


def test_check_stop_at_the_context_limit():
    s = _generated({"max_tokens": 100})
    s.token_ids.append(5)
    assert check_stop(s, max_model_len=3) is FinishReason.LENGTH


def _decoding(sched: Scheduler, *seqs: Sequence) -> None:
    """Admit seqs and compute their prompts (each samples 7), so that the next step decodes them."""
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    sched.update_from_output(out, [[7]] * len(seqs))
    assert [s.num_generated_tokens for s in seqs] == [1] * len(seqs)


def test_update_from_output_appends_several_tokens_and_stops_at_the_first_stop():
    sched = Scheduler(BlockManager(num_blocks=16, block_size=4), max_num_seqs=4, max_num_batched_tokens=64,
                      max_model_len=64)
    a = toks("a", range(10, 15), max_tokens=10, stop_token_ids=[9])
    b = toks("b", range(20, 25), max_tokens=10)
    _decoding(sched, a, b)
    out = sched.schedule()
    assert out.seqs == [a, b] and out.num_sampled == [1, 1]
    changed = sched.update_from_output(out, [[5, 9, 6, 6], [3, 4, 5]])
    assert changed == [a, b]
    assert a.generated_token_ids == [7, 5, 9] and a.finish_reason is FinishReason.STOP_TOKEN  # 6, 6 dropped
    assert a.block_table == [] and sched.running == [b]
    assert b.generated_token_ids == [7, 3, 4, 5] and not b.is_finished
    assert sched.num_generated_tokens == 2 + 2 + 3


def test_update_from_output_stops_at_max_tokens_within_a_step():
    sched = Scheduler(BlockManager(num_blocks=16, block_size=4), max_num_seqs=4, max_num_batched_tokens=64,
                      max_model_len=64)
    a = toks("a", range(10, 15), max_tokens=3)
    _decoding(sched, a)
    sched.update_from_output(sched.schedule(), [[5, 6, 7, 8]])
    assert a.generated_token_ids == [7, 5, 6] and a.finish_reason is FinishReason.LENGTH


def test_finish_records_the_error_once():
    sched = Scheduler(BlockManager(num_blocks=16, block_size=4), max_num_seqs=4, max_num_batched_tokens=64,
                      max_model_len=64)
    a = toks("a", range(10, 15))
    sched.add(a)
    sched.finish(a, FinishReason.ERROR, "boom")
    assert (a.finish_reason, a.error, sched.waiting) == (FinishReason.ERROR, "boom", [])
    sched.finish(a, FinishReason.ABORT)  # already finished: nothing changes
    assert (a.finish_reason, a.error) == (FinishReason.ERROR, "boom")

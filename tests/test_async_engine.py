"""The asyncio front: streams add up to the offline result, cancel frees blocks, a failing
step fails only its requests, a full queue is refused."""
import asyncio

import pytest

from engine import LLM, AsyncEngine, EngineConfig, SamplingParams
from engine.errors import EngineError, InvalidRequestError, QueueFullError


@pytest.fixture(scope="module")
def engine(checkpoint):
    eng = AsyncEngine(EngineConfig(model=checkpoint("llama"), num_kv_blocks=64, max_queue_len=8))
    eng.start()
    yield eng
    eng.shutdown()


async def _collect(eng, prompt, params, **kw):
    outs = [o async for o in eng.generate(prompt, params, **kw)]
    return outs


def test_stream_equals_offline(engine, checkpoint):
    params = SamplingParams(temperature=0.9, seed=5, max_tokens=20, ignore_eos=True, logprobs=True)
    outs = asyncio.run(_collect(engine, "héllo wörld", params))
    offline = LLM(checkpoint("llama"), num_kv_blocks=64).generate(["héllo wörld"], params)[0]
    assert sum((o.token_ids for o in outs), []) == offline.token_ids
    assert "".join(o.text for o in outs) == offline.text
    assert sum(len(o.logprobs) for o in outs) == 20
    assert outs[-1].finished and outs[-1].finish_reason == "length" and not any(o.finished for o in outs[:-1])
    assert outs[-1].num_generated_tokens == 20


def test_a_consumer_that_falls_behind_gets_merged_deltas(engine, checkpoint):
    """Deltas that piled up while the consumer was busy come as one: same tokens, text and
    logprobs in fewer messages (the per-message cost of a slow stream does not stall the rest)."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=True, top_logprobs=2)

    async def slow():
        outs = []
        async for o in engine.generate("héllo wörld", params):
            outs.append(o)
            await asyncio.sleep(0.05)  # several engine steps pass per message
        return outs
    outs = asyncio.run(slow())
    offline = LLM(checkpoint("llama"), num_kv_blocks=64).generate(["héllo wörld"], params)[0]
    assert 1 < len(outs) < 40
    assert sum((o.token_ids for o in outs), []) == offline.token_ids
    assert "".join(o.text for o in outs) == offline.text
    assert [lp.token_id for o in outs for lp in o.logprobs] == offline.token_ids
    assert [o.num_generated_tokens for o in outs] == sorted({o.num_generated_tokens for o in outs})
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])


def test_concurrent_streams_get_their_own_tokens(engine):
    async def main():
        ps = [SamplingParams(temperature=1.0, seed=i, max_tokens=10, ignore_eos=True) for i in range(8)]
        together = await asyncio.gather(*[_collect(engine, [i + 1, 2, 3], p) for i, p in enumerate(ps)])
        alone = [await _collect(engine, [i + 1, 2, 3], p) for i, p in enumerate(ps)]
        return together, alone
    together, alone = asyncio.run(main())
    for a, b in zip(together, alone):
        assert sum((o.token_ids for o in a), []) == sum((o.token_ids for o in b), [])


def leave_a_stream(eng, tries: int = 200):
    """Takes one delta of a long stream, closes it, and returns the stats once its blocks are
    free (or after `tries` polls 10 ms apart)."""
    async def main():
        gen = eng.generate([1, 2, 3] * 10, SamplingParams(max_tokens=400, ignore_eos=True))
        async for _ in gen:
            break
        await gen.aclose()
        for _ in range(tries):
            await asyncio.sleep(0.01)
            s = eng.stats()
            if s.num_free_blocks == s.num_total_blocks and s.num_running == 0:
                break
        return eng.stats()
    return asyncio.run(main())


def test_cancel_frees_blocks(engine):
    s = leave_a_stream(engine)
    assert s.num_free_blocks == s.num_total_blocks and s.num_running == 0


def test_invalid_request_and_queue_full(engine):
    with pytest.raises(InvalidRequestError, match="prompt"):
        asyncio.run(_collect(engine, "", SamplingParams()))

    async def flood():
        gens = [engine.generate([1, 2], SamplingParams(max_tokens=200, ignore_eos=True)) for _ in range(30)]
        tasks = [asyncio.ensure_future(g.__anext__()) for g in gens]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            await g.aclose()
        return results
    results = asyncio.run(flood())
    assert any(isinstance(r, QueueFullError) for r in results)


@pytest.mark.parametrize("front", ["thread", "process"])
def test_the_queue_limit_counts_waiting_requests(checkpoint, front):
    """max_num_seqs 1, max_queue_len 2: with one request running, two more wait and a fourth is
    refused, by both fronts (the process front counts the child's waiting list)."""
    from engine.engine_process import ProcessEngine

    cls = AsyncEngine if front == "thread" else ProcessEngine
    eng = cls(EngineConfig(model=checkpoint("llama"), num_kv_blocks=64, max_num_seqs=1, max_queue_len=2))
    eng.start()

    async def main():
        running = eng.generate([1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True))
        await running.__anext__()  # it has a token: it is running, not waiting
        waiting = [eng.generate([4, 5], SamplingParams(max_tokens=2, ignore_eos=True)) for _ in range(2)]
        heads = [asyncio.ensure_future(g.__anext__()) for g in waiting]
        await asyncio.sleep(0.05)  # both admitted (each waits for its first token)
        assert not any(h.done() for h in heads)
        with pytest.raises(QueueFullError, match="queue is full"):
            await eng.generate([6], SamplingParams(max_tokens=2)).__anext__()
        await running.aclose()  # aborted: the two waiting ones run and finish
        firsts = await asyncio.gather(*heads)
        rests = []
        for g in waiting:
            rests.append([o async for o in g])
        return firsts, rests

    try:
        firsts, rests = asyncio.run(main())
    finally:
        eng.shutdown()
    for first, rest in zip(firsts, rests):
        outs = [first, *rest]
        assert sum(len(o.token_ids) for o in outs) == 2 and outs[-1].finished


def test_failing_step_fails_only_its_requests(engine):
    runner = engine.engine.runner
    original = runner.run
    calls = {"n": 0}

    def broken(sched):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected fault")
        return original(sched)
    runner.run = broken
    try:
        with pytest.raises(EngineError, match="injected fault"):
            asyncio.run(_collect(engine, [1, 2, 3], SamplingParams(max_tokens=4)))
    finally:
        runner.run = original
    outs = asyncio.run(_collect(engine, [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True)))
    assert outs[-1].num_generated_tokens == 4
    s = engine.stats()
    assert s.num_free_blocks == s.num_total_blocks


def test_n_choices_stream_to_the_end(engine):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    outs = asyncio.run(asyncio.wait_for(_collect(engine, [5, 6, 7, 8], params), 30))
    finished = [o.index for o in outs if o.finished]
    assert sorted(finished) == [0, 1, 2]
    for i in range(3):
        assert sum(len(o.token_ids) for o in outs if o.index == i) == 6


def test_outputs_carry_engine_timings(engine):
    outs = asyncio.run(_collect(engine, [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)))
    m = outs[-1].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time

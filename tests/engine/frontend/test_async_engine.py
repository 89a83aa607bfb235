"""The asyncio front over both transports (the engine loop in a thread, and in a child process as
`pagoda serve` runs it): every test here runs against each, so the two cannot differ. Streams add
up to the offline result, refusals name the field, cancel frees blocks, a full queue is refused."""
import asyncio
import contextlib
import os
import signal

import pytest

from pagoda.engine import LLM, AsyncEngine, EngineConfig, SamplingParams
from pagoda.engine.errors import (DuplicateRequestError, EngineClosedError, EngineDeadError, EngineError,
                                  InvalidRequestError, QueueFullError)

TRANSPORTS = ["thread", "process"]


def start(checkpoint, transport: str, **options) -> AsyncEngine:
    eng = AsyncEngine(EngineConfig(dtype="float32", model=checkpoint("llama"), num_kv_blocks=64,
                                   engine_process=transport == "process", **options))
    eng.start()
    return eng


@pytest.fixture(scope="module", params=TRANSPORTS)
def engine(checkpoint, request):
    eng = start(checkpoint, request.param, max_queue_len=8)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def offline(checkpoint):
    return LLM(checkpoint("llama"), dtype="float32", num_kv_blocks=64)


async def _collect(eng, prompt, params, **kw):
    outs = [o async for o in eng.generate(prompt, params, **kw)]
    return outs


def test_stream_equals_offline(engine, offline):
    params = SamplingParams(temperature=0.9, seed=5, max_tokens=20, ignore_eos=True, logprobs=True)
    outs = asyncio.run(_collect(engine, "héllo wörld", params))
    offline = offline.generate(["héllo wörld"], params)[0]
    assert sum((o.token_ids for o in outs), []) == offline.token_ids
    assert "".join(o.text for o in outs) == offline.text
    assert sum(len(o.logprobs) for o in outs) == 20
    assert outs[-1].finished and outs[-1].finish_reason == "length" and not any(o.finished for o in outs[:-1])
    assert outs[-1].num_generated_tokens == 20


def test_a_consumer_that_falls_behind_gets_merged_deltas(engine, offline):
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
    offline = offline.generate(["héllo wörld"], params)[0]
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


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_queue_limit_counts_waiting_requests(checkpoint, transport):
    """max_num_seqs 1, max_queue_len 2: with one request running, two more wait and a fourth is
    refused (the front counts the core's waiting list as the core reports it)."""
    eng = start(checkpoint, transport, max_num_seqs=1, max_queue_len=2)

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


def test_failing_step_fails_only_its_requests(checkpoint):
    # in-thread, where the test can reach the model run (the loop and the outputs are the same code
    # in the child process)
    engine = start(checkpoint, "thread")
    runner = engine.core.runner
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
    engine.shutdown()
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


def test_n_choices_equal_offline(engine, offline):
    params = SamplingParams(temperature=0.9, seed=5, max_tokens=20, ignore_eos=True, logprobs=True, n=2)
    outs = asyncio.run(_collect(engine, "héllo wörld", params))
    want = offline.generate(["héllo wörld"], params)[0]
    for i, choice in enumerate(want.choices):
        mine = [o for o in outs if o.index == i]
        assert sum((o.token_ids for o in mine), []) == choice.token_ids
        assert "".join(o.text for o in mine) == choice.text
        assert mine[-1].finished and mine[-1].finish_reason == "length"


def test_stop_strings_are_held_back_and_cut_as_offline(engine, offline):
    """Text that may begin a stop string is not sent until it cannot; the stream's text, tokens and
    counts equal the offline result, which stops at the step that produced the stop string."""
    greedy = dict(temperature=0.0, max_tokens=16, ignore_eos=True)
    text = offline.generate(["héllo wörld"], SamplingParams(**greedy))[0].text
    # a stop string across two tokens' text: its first character must be held back, not sent
    bounds = [len(offline.generate(["héllo wörld"], SamplingParams(**greedy | {"max_tokens": m}))[0].text)
              for m in range(4, 12)]
    stop = next(text[b - 1:b + 1] for b in bounds if 0 < b < len(text) and text.index(text[b - 1:b + 1]) == b - 1)
    reasons = []
    for params in (SamplingParams(**greedy, stop=[stop]), SamplingParams(**greedy, stop=["never-there"]),
                   SamplingParams(**greedy)):
        want = offline.generate(["héllo wörld"], params)[0]
        outs = asyncio.run(_collect(engine, "héllo wörld", params))
        got = "".join(o.text for o in outs)
        assert got == want.text and outs[-1].stop_reason == want.stop_reason
        reasons.append(want.stop_reason)
        assert sum((o.token_ids for o in outs), []) == want.token_ids
        assert (outs[-1].num_prompt_tokens, outs[-1].num_generated_tokens) == (want.num_prompt_tokens,
                                                                             want.num_generated_tokens)
        for i in range(1, len(outs)):  # no output gave away text the stop string later cut
            sent = "".join(o.text for o in outs[:i])
            assert got.startswith(sent)
    assert reasons == ["stop_string", "length", "length"]
    assert len(want.token_ids) == 16 and len(offline.generate(["héllo wörld"], SamplingParams(
        **greedy, stop=[stop]))[0].token_ids) < 16


def test_refusals_name_the_field_on_first_iteration(engine):
    with pytest.raises(InvalidRequestError) as e:
        asyncio.run(_collect(engine, [1, 2, 99999], SamplingParams(max_tokens=4)))
    assert e.value.field == "prompt_token_ids[2]"
    with pytest.raises(InvalidRequestError, match="^max_tokens"):
        asyncio.run(_collect(engine, [1, 2, 3], SamplingParams(max_tokens=10**6)))
    with pytest.raises(InvalidRequestError, match="^sampling_params"):
        asyncio.run(_collect(engine, [1, 2, 3], {"max_tokens": 3}))
    gen = engine.generate("", SamplingParams())  # nothing happens until it is iterated
    with pytest.raises(InvalidRequestError, match="^prompt must not be empty"):
        asyncio.run(gen.__anext__())
    assert asyncio.run(_collect(engine, [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)))[-1].finished


def test_a_request_id_in_flight_is_refused(engine):
    async def main():
        first = engine.generate([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True), request_id="same")
        await first.__anext__()
        with pytest.raises(DuplicateRequestError, match="'same' is already used"):
            await _collect(engine, [1, 2], SamplingParams(max_tokens=2), request_id="same")
        await first.aclose()
        await asyncio.sleep(0.05)
        return await _collect(engine, [1, 2], SamplingParams(max_tokens=2, ignore_eos=True), request_id="same")
    assert asyncio.run(main())[-1].finished


def test_a_dead_engine_process_fails_its_requests(checkpoint):
    eng = start(checkpoint, "process")

    async def main():
        gen = eng.generate([1, 2, 3], SamplingParams(max_tokens=500, ignore_eos=True))
        await gen.__anext__()
        os.kill(eng._transport.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="engine process exited"):
            async for _ in gen:
                pass
        with pytest.raises(EngineClosedError):
            await _collect(eng, [1, 2], SamplingParams(max_tokens=2))
    failures = []
    eng.on_failure = failures.append
    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        eng.shutdown()
    assert len(failures) == 1 and isinstance(failures[0], EngineDeadError)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_model_that_cannot_load_raises_its_own_error(tmp_path, transport):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "tokenizer.json").write_text("{}")  # the files a checkpoint directory must hold, unread
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="architecture 'llama' is not supported"):
        AsyncEngine(EngineConfig(dtype="float32", model=str(tmp_path), num_kv_blocks=8,
                engine_process=transport == "process"))


def test_output_kinds_deltas_whole_and_folded_agree(engine):
    """The core's whole-output mode (stream=False: one output per choice, when it finishes) and
    deltas folded by whole_outputs give the doors the same completions."""
    from pagoda.engine.frontend.async_engine import merge_streams, whole_outputs

    params = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=12, ignore_eos=True, logprobs=True)

    async def main():
        whole = [o async for o in engine.generate(engine.make_request("héllo", params, stream=False))]
        async with contextlib.aclosing(engine.open(engine.make_request("héllo", params))) as deltas:
            folded = await whole_outputs(merge_streams([deltas]))
        return whole, [out for _, out in folded]
    whole, folded = asyncio.run(main())
    assert len(whole) == len(folded) == 2 and all(o.finished for o in whole + folded)
    for w, f in zip(sorted(whole, key=lambda o: o.index), folded):
        assert (w.index, w.text, w.token_ids, w.finish_reason) == (f.index, f.text, f.token_ids, f.finish_reason)
        assert len(w.logprobs) == len(f.logprobs) == 12 and w.num_generated_tokens == f.num_generated_tokens == 12


def test_abort_with_an_error_raises_it_at_once_and_frees_blocks(engine):
    """A time limit: the stream raises the error now, not after the core's next step reports."""
    class TimedOut(Exception):
        pass

    async def main():
        req = engine.make_request([1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True))
        got = []
        with pytest.raises(TimedOut):
            async for out in engine.generate(req):
                got.append(out)
                if len(got) == 2:
                    engine.abort(req.request_id, TimedOut())
        assert not any(o.finished for o in got)
        for _ in range(500):
            s = engine.stats()
            if s.num_free_blocks == s.num_total_blocks and s.num_running == 0:
                break
            await asyncio.sleep(0.01)
        return s
    s = asyncio.run(asyncio.wait_for(main(), 30))
    assert s.num_free_blocks == s.num_total_blocks and s.num_running == 0

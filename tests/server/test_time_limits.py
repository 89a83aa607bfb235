"""Time limits (time_limit_ms): a generation that runs out of time ends with what it has and the
finish reason time_limit on both doors (a request still queued then ends with nothing); requests
that wait in the queue past --max-queue-wait are refused with RESOURCE_EXHAUSTED / 429 and
Retry-After; a request whose time limit the queue before it is estimated to outlast is refused at
once. Steps are slowed (slow_steps) so that a limit of a second or two lands mid-generation."""
import asyncio
import dataclasses
import time
import types

import grpc
import httpx
import openai
import pytest

from grpc_fixtures import InProcessServer, openai_client, slow_steps, tiny_checkpoint, wait_all_blocks_free
from pagoda.client.client import Client
from pagoda.engine import LLM, AsyncEngine, EngineConfig, SamplingParams
from pagoda.engine.core.block_manager import BlockManager
from pagoda.engine.errors import InvalidRequestError, QueueWaitError
from pagoda.engine.outputs import EngineStats
from pagoda.engine.core.scheduler import Scheduler
from pagoda.engine.core.sequence import Sequence
from pagoda.engine.outputs import FinishReason
from pagoda.server.options import ServerOptions
from pagoda.v1 import generation_pb2 as pb
from pagoda.v1 import generation_pb2_grpc as pb_grpc

LONG = 200  # tokens a limited generation asks for; slowed steps make that take far longer than the limit
LIMIT_MS = 1500


# ---- the scheduler, no model ----

def _seq(rid: str, arrival: float, **params) -> Sequence:
    return Sequence(rid, [1, 2, 3], SamplingParams(max_tokens=4, **params), arrival_time=arrival)


def test_the_scheduler_ends_what_is_past_its_limit_in_the_queue_too():
    bm = BlockManager(8, 4)
    s = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=32, max_queue_wait_s=30.0)
    running, late, fresh = _seq("a", 0.0), _seq("b", 0.0, time_limit_ms=5), _seq("c", float("inf"))
    for seq in (running, late, fresh):
        s.add(seq)
    s.schedule()  # one seat: `running` is scheduled, the other two wait
    assert s.num_waiting_tokens == 6
    # `late`'s time limit passed: it ends with nothing; `running` never had a limit, but it arrived at 0
    # and was scheduled, so the queue-wait limit no longer applies to it
    assert s.expire() == [late]
    assert late.finish_reason is FinishReason.TIME_LIMIT and late.times.finished is not None
    assert s.waiting == [fresh] and s.running == [running] and s.num_waiting_tokens == 3
    assert s.expire() == []


def test_the_scheduler_refuses_a_sequence_never_scheduled_within_the_queue_wait():
    bm = BlockManager(8, 4)
    s = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=32, max_queue_wait_s=1.0)
    running, queued = _seq("a", 0.0), _seq("b", 0.0)
    s.add(running)
    s.schedule()
    s.add(queued)
    assert s.expire() == [queued]
    assert queued.finish_reason is FinishReason.REFUSED and "--max-queue-wait" in queued.error
    assert running.finish_reason is None and bm.num_free_blocks == 8 - len(running.block_table)


def test_the_queue_wait_estimate_is_the_slower_of_compute_and_seats():
    s = EngineStats(num_running=2, num_waiting=3, num_total_blocks=0, num_free_blocks=0, num_used_blocks=0,
                    num_wasted_slots=0, num_prompt_tokens_processed=0, num_generated_tokens=0, num_preemptions=0,
                    uptime_s=0.0, num_waiting_tokens=300, num_free_seats=0, step_token_budget=100)
    assert s.queue_wait_s() == 0.0  # nothing measured yet: no estimate, nothing refused
    s = dataclasses.replace(s, step_s=1.0, finished_per_s=2.0)
    assert s.queue_wait_s() == pytest.approx(3.0)  # 300 tokens: 3 steps of 1 s; 4 seats at 2/s is 2 s
    assert s.queue_wait_s(num_seqs=7) == pytest.approx(5.0)  # 10 seats at 2/s
    assert s.queue_wait_s(num_tokens=101) == pytest.approx(5.0)  # 401 tokens: 5 steps


def test_finished_sequences_do_not_stay_in_the_deadline_heap():
    bm = BlockManager(8, 4)
    s = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=32)
    seqs = [_seq(str(i), time.monotonic(), time_limit_ms=3_600_000) for i in range(200)]
    for seq in seqs:
        s.add(seq)
    for seq in seqs[:-1]:
        s.finish(seq, FinishReason.ABORT)
    assert s.expire() == [] and [d[2] for d in s.deadlines] == [seqs[-1]]


@pytest.mark.parametrize("value", [0, -1, 1.5, True, 24 * 3600 * 1000 + 1])
def test_a_bad_time_limit_names_the_field(value):
    with pytest.raises(InvalidRequestError, match="time_limit_ms"):
        SamplingParams(time_limit_ms=value)


# ---- the engine and both doors ----

@pytest.fixture(scope="module")
def model():
    return tiny_checkpoint()


@pytest.fixture(scope="module")
def reference(model):
    """The greedy completion the limited ones must be a prefix of."""
    llm = LLM(model, dtype="float32", num_kv_blocks=64)
    return llm.generate(["Time flies"], SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True))[0]


@pytest.fixture(scope="module")
def srv(model):
    s = InProcessServer.for_config(EngineConfig(dtype="float32", model=model, num_kv_blocks=64),
                                   ServerOptions(http_port=0)).wait_ready()
    yield s
    s.stop()


def _check_partial(text: str, token_ids: list[int], reference, engine) -> None:
    assert 0 < len(token_ids) < LONG
    assert list(token_ids) == reference.token_ids[:len(token_ids)]
    assert text == engine.decode(list(token_ids))


def test_offline_time_limit_ends_with_the_tokens_so_far(model, reference):
    llm = LLM(model, dtype="float32", num_kv_blocks=64)
    with slow_steps(types.SimpleNamespace(core=llm.engine), 0.02):
        out = llm.generate(["Time flies"], SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True,
                                                          time_limit_ms=200))[0]
    assert out.finish_reason == "time_limit" and out.stop_reason == "time_limit"
    assert out.token_ids == reference.token_ids[:len(out.token_ids)] and len(out.token_ids) < LONG


def test_grpc_time_limit_unary_and_streamed(srv, reference):
    with Client(srv.target, timeout=60) as c, slow_steps(srv.engine, 0.02):
        unary = c.generate("Time flies", temperature=0, max_tokens=LONG, ignore_eos=True, time_limit_ms=LIMIT_MS)
        parts = list(c.generate_stream("Time flies", temperature=0, max_tokens=LONG, ignore_eos=True,
                                       time_limit_ms=LIMIT_MS))
        wait_all_blocks_free(c)
    assert unary.finish_reason == pb.FINISH_REASON_TIME_LIMIT
    _check_partial(unary.text, list(unary.token_ids), reference, srv.engine)
    assert unary.usage.completion_tokens == len(unary.token_ids)
    streamed_ids = [t for p in parts for t in p.token_ids]
    assert parts[-1].finish_reason == pb.FINISH_REASON_TIME_LIMIT
    assert all(p.finish_reason == pb.FINISH_REASON_UNSPECIFIED for p in parts[:-1])
    _check_partial("".join(p.text for p in parts), streamed_ids, reference, srv.engine)
    assert parts[-1].usage.completion_tokens == len(streamed_ids)


def test_http_time_limit_completions_and_chat(srv, reference):
    oai = openai_client(srv)
    with slow_steps(srv.engine, 0.02):
        whole = oai.completions.create(model=None, prompt="Time flies", max_tokens=LONG, temperature=0,
                                       extra_body={"ignore_eos": True, "time_limit_ms": LIMIT_MS,
                                                   "return_token_ids": True})
        chunks = list(oai.completions.create(model=None, prompt="Time flies", max_tokens=LONG, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True, "time_limit_ms": LIMIT_MS,
                                                                      "return_token_ids": True}))
        chat = oai.chat.completions.create(model=None, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=LONG, temperature=0,
                                           extra_body={"ignore_eos": True, "time_limit_ms": LIMIT_MS})
    assert whole.choices[0].finish_reason == "time_limit"
    _check_partial(whole.choices[0].text, whole.choices[0].token_ids, reference, srv.engine)
    assert chunks[-1].choices[0].finish_reason == "time_limit"
    _check_partial("".join(c.choices[0].text for c in chunks),
                   [t for c in chunks for t in c.choices[0].token_ids], reference, srv.engine)
    assert chat.choices[0].finish_reason == "time_limit" and 0 < chat.usage.completion_tokens < LONG
    with Client(srv.target) as c:
        wait_all_blocks_free(c)


def test_responses_time_limit_is_an_incomplete_response(srv):
    """The Responses API: status "incomplete", reason "time_limit" (never max_output_tokens), whole and streamed."""
    oai = openai_client(srv)
    no_eos = {str(i): -100 for i in srv.engine.model_info.eos_token_ids}
    extra = {"time_limit_ms": LIMIT_MS, "logit_bias": no_eos, "seed": 0}
    with slow_steps(srv.engine, 0.02):
        whole = oai.responses.create(model=srv.engine.model_info.model_id, input="Hi", max_output_tokens=LONG,
                                     temperature=0, extra_body=extra)
        events = list(oai.responses.create(model=srv.engine.model_info.model_id, input="Hi",
                                           max_output_tokens=LONG, temperature=0, stream=True, extra_body=extra))
    assert (whole.status, whole.incomplete_details.reason) == ("incomplete", "time_limit")
    assert 0 < whole.usage.output_tokens < LONG
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "time_limit"
    with Client(srv.target) as c:
        wait_all_blocks_free(c)


def test_bad_time_limit_on_both_doors(srv):
    with Client(srv.target) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.generate("hi", time_limit_ms=0)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "time_limit_ms" in e.value.details()
    with pytest.raises(openai.BadRequestError) as e:
        openai_client(srv).completions.create(model=None, prompt="hi", extra_body={"time_limit_ms": -5})
    assert e.value.body["param"] == "time_limit_ms"


def test_a_request_whose_limit_passes_in_the_queue_ends_empty(model):
    """One seat: the second request's limit passes while the first holds it."""
    eng = AsyncEngine(EngineConfig(dtype="float32", model=model, num_kv_blocks=64, max_num_seqs=1))
    eng.start()

    async def go():
        first = asyncio.ensure_future(_collect(eng, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)))
        await asyncio.sleep(0.3)  # the first is running
        second = await _collect(eng, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, time_limit_ms=200))
        return await first, second

    try:
        with slow_steps(eng, 0.05):
            first, second = asyncio.run(go())
        assert first[-1].finish_reason == "length" and first[-1].num_generated_tokens == 40
        assert second[-1].finish_reason == "time_limit" and second[-1].num_generated_tokens == 0
        assert "".join(o.text for o in second) == "" and second[-1].metrics.first_scheduled_time is None
        s = eng.stats()
        assert s.num_free_blocks == s.num_total_blocks and s.num_waiting == s.num_running == 0
    finally:
        eng.shutdown()


def test_time_limit_across_the_process_boundary(model):
    """The core in a child process compares the deadline with its own clock (time.monotonic is system-wide)."""
    eng = AsyncEngine(EngineConfig(dtype="float32", model=model, num_kv_blocks=64, engine_process=True))
    eng.start()
    try:
        outs = asyncio.run(_collect(eng, SamplingParams(temperature=0, max_tokens=500, ignore_eos=True,
                                                        time_limit_ms=100)))
        assert outs[-1].finish_reason == "time_limit" and outs[-1].num_generated_tokens < 500
        assert sum(len(o.token_ids) for o in outs) == outs[-1].num_generated_tokens
        assert outs[-1].metrics.finished_time is not None and outs[-1].metrics.prefill_chunks
    finally:
        eng.shutdown()


async def _collect(eng, params, prompt="Time flies"):
    return [o async for o in eng.generate(prompt, params)]


# ---- waiting limits under a flood ----

@pytest.fixture(scope="module")
def flood_srv(model):
    s = InProcessServer.for_config(EngineConfig(dtype="float32", model=model, num_kv_blocks=64, max_num_seqs=1,
            max_queue_wait_s=0.5),
                                   ServerOptions(http_port=0)).wait_ready()
    yield s
    s.stop()


def test_queue_wait_refusals_under_a_flood(flood_srv):
    """One seat, --max-queue-wait 0.5: of 6 requests of ~2 s each sent at once, the first runs and the
    rest are refused with RESOURCE_EXHAUSTED (gRPC) or 429 with Retry-After (HTTP)."""
    async def flood():
        from pagoda.client.client import AsyncClient

        async with AsyncClient(flood_srv.target, timeout=60) as ac:
            return await asyncio.gather(*(ac.generate(f"flood {i}", max_tokens=40, ignore_eos=True)
                                          for i in range(4)), return_exceptions=True)

    async def http():
        async with httpx.AsyncClient(base_url=flood_srv.http_url, timeout=60) as h:
            await asyncio.sleep(0.1)  # after the gRPC ones
            return await asyncio.gather(*(h.post("/v1/completions", json={"prompt": f"http {i}", "max_tokens": 40,
                                                                         "ignore_eos": True}) for i in range(2)))

    async def both():
        return await asyncio.gather(flood(), http())

    with slow_steps(flood_srv.engine, 0.05):
        grpc_results, http_results = asyncio.run(both())
    ok = [r for r in grpc_results if not isinstance(r, Exception)]
    refused = [r for r in grpc_results if isinstance(r, grpc.RpcError)]
    assert len(ok) == 1 and len(refused) == 3, grpc_results
    for e in refused:
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-queue-wait" in e.details()
    for r in http_results:
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error" and "--max-queue-wait" in r.json()["error"]["message"]
    with Client(flood_srv.target) as c:
        wait_all_blocks_free(c)
        assert c.model_info().limits.max_queue_wait_seconds == 0.5


def test_admission_refuses_a_time_limit_the_queue_outlasts(flood_srv):
    """While one long request holds the only seat, the measured rates estimate the wait of the next one;
    a limit shorter than that is refused at once, a longer one admitted."""
    with Client(flood_srv.target, timeout=60) as c, slow_steps(flood_srv.engine, 0.05):
        for i in range(3):  # finished completions: the finish rate is measured
            c.generate(f"warm {i}", max_tokens=2)
        stream = c.generate_stream("hold the seat", max_tokens=100, ignore_eos=True)
        next(stream)
        estimate = c.stats().queue_wait_estimate_seconds
        assert estimate > 0 and c.stats().step_seconds > 0 and c.stats().finished_per_second > 0
        with pytest.raises(grpc.RpcError) as e:
            c.generate("too late", max_tokens=5, time_limit_ms=1)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "cannot be met" in e.value.details()
        stream.cancel()
        wait_all_blocks_free(c)


# ---- the flag ----

def test_max_queue_wait_flag(capsys):
    from pagoda.client.cli import build_parser
    from pagoda.server.main import engine_config

    assert engine_config(build_parser().parse_args(["serve"])).max_queue_wait_s is None
    assert engine_config(build_parser().parse_args(["serve", "--max-queue-wait", "2.5"])).max_queue_wait_s == 2.5
    for bad in ("-1", "soon", "inf"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--max-queue-wait", bad])
        assert "--max-queue-wait: must be a number of seconds >= 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="max_queue_wait_s"):
        EngineConfig(max_queue_wait_s=0)

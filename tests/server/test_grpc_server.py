"""The gRPC server in process (server.app.PagodaServer on a tiny random llama, float32 on CPU):
every RPC, health and reflection, error codes, cancel/deadline freeing KV blocks, stream == unary,
concurrent streams, engine failures, loading/draining, and greedy parity with transformers."""
import asyncio
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from pagoda.client.client import AsyncClient, Client, collect
from grpc_fixtures import (TINY_VOCAB, InProcessServer, engine_config, failing_step, slow_steps, tiny_checkpoint,
                           wait_all_blocks_free)
from pagoda.v1 import generation_pb2 as pb

pytestmark = pytest.mark.timeout(180)

CONTEXT = 512  # the tiny checkpoint's max_position_embeddings
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def srv():
    server = InProcessServer.for_config(engine_config(tiny_checkpoint(), num_kv_blocks=128)).wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv):
    with Client(srv.target, timeout=60) as c:
        yield c


def same_completion(a, b) -> bool:
    return (a.text, list(a.token_ids), a.finish_reason, a.usage) == (b.text, list(b.token_ids), b.finish_reason,
                                                                       b.usage)


# ---- every RPC ----

def test_health_serving_for_server_and_service(client):
    assert client.health("") == "SERVING"
    assert client.health("pagoda.v1.GenerationService") == "SERVING"


def test_reflection_lists_services(srv):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(srv.target) as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        services = set(db.get_services())
        assert {"pagoda.v1.GenerationService", "grpc.health.v1.Health"} <= services
        fd = db.FindFileContainingSymbol("pagoda.v1.GenerationService")
        assert fd.name == "pagoda/v1/generation.proto"


def test_generate_text(client):
    r = client.generate("Hello", temperature=0, max_tokens=8, ignore_eos=True, request_id="abc")
    assert r.request_id == "abc"
    assert len(r.token_ids) == 8 and r.finish_reason == pb.FINISH_REASON_LENGTH
    assert r.usage.prompt_tokens == len(client.tokenize("Hello"))
    assert r.usage.completion_tokens == 8
    assert not r.logprobs


def test_generate_defaults_unset_fields(client):
    """Unset max_tokens: 256 (tests/server/test_grpc_convert.py) capped by the context; unset request_id:
    one is made up."""
    assert client.model_info().limits.default_max_tokens == 256
    near_full = [65] * (CONTEXT - 3)
    r = client.generate(near_full, ignore_eos=True, temperature=0)
    assert len(r.token_ids) == 3 and r.finish_reason == pb.FINISH_REASON_LENGTH
    assert r.request_id


def test_generate_token_ids_and_messages(client):
    ids = client.tokenize("Hello")
    a = client.generate("Hello", temperature=0, max_tokens=6, ignore_eos=True)
    b = client.generate(ids, temperature=0, max_tokens=6, ignore_eos=True)
    assert list(a.token_ids) == list(b.token_ids) and a.text == b.text
    c = client.generate(messages=[("system", "be brief"), ("user", "hi")], temperature=0, max_tokens=4,
                        ignore_eos=True)
    assert len(c.token_ids) == 4 and c.usage.prompt_tokens > 4


def test_tokenize_model_info_stats(srv, client):
    assert client.tokenize("Hello") == srv.engine.encode("Hello")
    info = client.model_info()
    assert info.architecture == "LlamaForCausalLM" and info.dtype == "float32"
    assert info.context_length == CONTEXT and info.vocab_size == TINY_VOCAB
    assert list(info.eos_token_ids) == srv.engine.model_info.eos_token_ids
    assert info.block_size == 16 and info.num_kv_blocks == 128
    assert info.limits.max_num_seqs > 0 and info.limits.max_queue_len > 0 and info.limits.max_top_logprobs == 20
    s = client.stats()
    assert s.kv_blocks_total == 128 and s.kv_blocks_free + s.kv_blocks_used == 128
    assert s.uptime_seconds > 0 and s.generated_tokens > 0


def test_logprobs(client):
    r = client.generate("Hello", temperature=0, max_tokens=5, ignore_eos=True, top_logprobs=3)
    assert len(r.logprobs) == 5
    for tok, lp in zip(r.token_ids, r.logprobs):
        assert lp.token_id == tok and lp.logprob <= 0
        assert len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0].token_id == tok  # greedy picks the most likely token
    r = client.generate("Hello", temperature=0, max_tokens=3, logprobs=True)
    assert len(r.logprobs) == len(r.token_ids) and all(not lp.top_logprobs for lp in r.logprobs)


def test_stop_token_and_stop_string(client):
    base = client.generate("Hello", temperature=0, max_tokens=12, ignore_eos=True)
    stop_tok = base.token_ids[2]
    first = list(base.token_ids).index(stop_tok)
    r = client.generate("Hello", temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_tok])
    assert r.finish_reason == pb.FINISH_REASON_STOP_TOKEN
    assert list(r.token_ids) == list(base.token_ids[:first + 1])
    text = base.text
    stop = text[len(text) // 2:len(text) // 2 + 1]
    r = client.generate("Hello", temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
    assert r.finish_reason == pb.FINISH_REASON_STOP_STRING
    assert r.text == text[:text.index(stop)]


# ---- streaming ----

@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, top_p=0.9, seed=1234),
                                      dict(temperature=0.8, top_k=20, seed=7, repetition_penalty=1.2,
                                           presence_penalty=0.5, frequency_penalty=0.5)])
def test_stream_equals_unary(client, sampling):
    kw = dict(max_tokens=24, ignore_eos=True, top_logprobs=2, **sampling)
    unary = client.generate("Once upon a time", **kw)
    msgs = list(client.generate_stream("Once upon a time", request_id="s1", **kw))
    assert msgs  # a short stream may come as one message: deltas a slow reader missed are merged
    assert all(m.request_id == "s1" for m in msgs)
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED and not m.HasField("usage") for m in msgs[:-1])
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH and msgs[-1].HasField("usage")
    streamed = collect(msgs)
    assert same_completion(streamed, unary)
    assert [lp.token_id for lp in streamed.logprobs] == list(unary.token_ids)


def test_concurrent_streams_get_their_own_tokens(srv, client):
    prompts = [f"prompt number {i}" for i in range(8)]
    seeds = [100 + i for i in range(8)]
    kw = dict(max_tokens=20, ignore_eos=True, temperature=1.0)

    async def run_all():
        async with AsyncClient(srv.target, timeout=60) as ac:
            async def one(i):
                msgs = [m async for m in ac.generate_stream(prompts[i], seed=seeds[i], request_id=f"c{i}", **kw)]
                assert all(m.request_id == f"c{i}" for m in msgs)
                return collect(msgs)
            return await asyncio.gather(*(one(i) for i in range(8)))

    streamed = asyncio.run(run_all())
    for i, got in enumerate(streamed):
        alone = client.generate(prompts[i], seed=seeds[i], **kw)
        assert same_completion(got, alone), f"stream {i} differs from the same request alone"
    wait_all_blocks_free(client)


# ---- errors ----

BAD_REQUESTS = [
    (dict(prompt=""), "text"),
    (dict(prompt=None), "prompt"),
    (dict(prompt=[1, TINY_VOCAB + 5]), "token_ids.ids[1]"),
    (dict(prompt=[]), "token_ids.ids"),
    (dict(messages=[]), "messages.messages"),
    (dict(messages=[("", "hi")]), "messages.messages[0].role"),
    (dict(prompt="Hello", max_tokens=CONTEXT), "stopping.max_tokens"),
    (dict(prompt=[1] * CONTEXT), "token_ids"),
    (dict(prompt="Hello", max_tokens=4, min_tokens=5), "stopping.min_tokens"),
    (dict(prompt="Hello", temperature=-0.5), "sampling.temperature"),
    (dict(prompt="Hello", temperature=float("nan")), "sampling.temperature"),
    (dict(prompt="Hello", top_p=1.5), "sampling.top_p"),
    (dict(prompt="Hello", top_p=1.5), "sampling.top_p"),
    (dict(prompt="Hello", top_k=-2), "sampling.top_k"),
    (dict(prompt="Hello", min_p=2.0), "sampling.min_p"),
    (dict(prompt="Hello", seed=2**63), "sampling.seed"),
    (dict(prompt="Hello", repetition_penalty=0.0), "sampling.repetition_penalty"),
    (dict(prompt="Hello", presence_penalty=3.0), "sampling.presence_penalty"),
    (dict(prompt="Hello", frequency_penalty=-2.5), "sampling.frequency_penalty"),
    (dict(prompt="Hello", stop=["ok", ""]), "stopping.stop[1]"),
    (dict(prompt="Hello", stop_token_ids=[TINY_VOCAB]), "stopping.stop_token_ids[0]"),
    (dict(prompt="Hello", top_logprobs=21), "top_logprobs"),
    (dict(prompt="Hello", request_id="x" * 300), "request_id"),
    # protobuf strings are UTF-8, but JSON's own escape can spell a lone surrogate inside one
    (dict(prompt="Hello", json_schema='{"properties": {"\\ud800": {}}}'), "structured_output.json_schema"),
]


@pytest.mark.parametrize("kw,field", BAD_REQUESTS, ids=[f for _, f in BAD_REQUESTS])
def test_invalid_argument_names_the_field(client, kw, field):
    kw = dict(kw)
    prompt = kw.pop("prompt", None)
    with pytest.raises(grpc.RpcError) as e:
        client.generate(prompt, **kw)
    assert e.value.code() == INVALID, e.value.details()
    assert e.value.details().startswith(field), e.value.details()
    with pytest.raises(grpc.RpcError) as e:  # the stream reports the same error before any message
        list(client.generate_stream(prompt, **kw))
    assert e.value.code() == INVALID and e.value.details().startswith(field)


def test_tokenize_empty_text(client):
    with pytest.raises(grpc.RpcError) as e:
        client.tokenize("")
    assert e.value.code() == INVALID and "text" in e.value.details()


def test_duplicate_request_id_in_flight(srv, client):
    with slow_steps(srv.engine, 0.01):
        stream = client.generate_stream("Hello", request_id="dup", max_tokens=200, ignore_eos=True)
        next(stream)
        with pytest.raises(grpc.RpcError) as e:
            client.generate("Hello", request_id="dup", max_tokens=2)
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "request_id" in e.value.details()
        stream.cancel()
    wait_all_blocks_free(client)


# ---- cancel and deadline free the KV blocks ----

def test_stream_cancel_frees_blocks(srv, client):
    with slow_steps(srv.engine, 0.01):
        stream = client.generate_stream("Hello", max_tokens=400, ignore_eos=True)
        for _ in range(3):
            next(stream)
        s = client.stats()
        assert s.kv_blocks_used > 0 and s.num_running == 1
        stream.cancel()
        with pytest.raises(grpc.RpcError) as e:
            list(stream)
        assert e.value.code() == grpc.StatusCode.CANCELLED
        wait_all_blocks_free(client, timeout=5)


def test_unary_cancel_frees_blocks(srv, client):
    with slow_steps(srv.engine, 0.01):
        fut = client.stub.Generate.future(
            pb.GenerateRequest(text="Hello", stopping=pb.StoppingCriteria(max_tokens=400, ignore_eos=True)))
        deadline = time.monotonic() + 10
        while client.stats().kv_blocks_used == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
        fut.cancel()
        wait_all_blocks_free(client, timeout=5)


@pytest.mark.parametrize("streaming", [False, True])
def test_deadline_frees_blocks(srv, client, streaming):
    with slow_steps(srv.engine, 0.01):
        with pytest.raises(grpc.RpcError) as e:
            if streaming:
                list(client.generate_stream("Hello", max_tokens=400, ignore_eos=True, timeout=0.5))
            else:
                client.generate("Hello", max_tokens=400, ignore_eos=True, timeout=0.5)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_all_blocks_free(client, timeout=5)


# ---- engine failure ----

def test_engine_exception_is_internal_and_server_keeps_serving(srv, client):
    with failing_step(srv.engine, times=1):
        with pytest.raises(grpc.RpcError) as e:
            client.generate("Hello", max_tokens=4)
        assert e.value.code() == grpc.StatusCode.INTERNAL
        assert "injected failure" in e.value.details()
    wait_all_blocks_free(client)
    r = client.generate("Hello", max_tokens=4, ignore_eos=True)
    assert len(r.token_ids) == 4
    assert client.health() == "SERVING"


# ---- greedy parity with transformers ----

def test_greedy_matches_transformers(client):
    import torch
    from transformers import AutoModelForCausalLM

    ids = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]  # "Hello, world"
    n = 24
    r = client.generate(ids, temperature=0, max_tokens=n, ignore_eos=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: EOS may be generated, it does not stop
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, pad_token_id=0)
    assert list(r.token_ids) == out[0, len(ids):].tolist()


# ---- loading, queue bound, draining (their own small server) ----

def test_loading_queue_full_and_draining():
    gate = threading.Event()
    config = engine_config(tiny_checkpoint(), num_kv_blocks=64, max_num_seqs=1, max_queue_len=1)

    def factory():
        from pagoda.engine import AsyncEngine

        gate.wait(60)
        return AsyncEngine(config)

    server = InProcessServer(factory)
    try:
        with Client(server.target, timeout=30) as c:
            # loading: health NOT_SERVING, calls UNAVAILABLE
            assert c.health("") == "NOT_SERVING"
            assert c.health("pagoda.v1.GenerationService") == "NOT_SERVING"
            for call in (lambda: c.generate("Hello", max_tokens=2), c.stats, c.model_info,
                         lambda: list(c.generate_stream("Hello", max_tokens=2))):
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in e.value.details()
            gate.set()
            server.wait_ready()
            assert c.health("") == "SERVING"

            # queue bound: one running, one waiting, the next one RESOURCE_EXHAUSTED
            with slow_steps(server.engine, 0.01):
                running = c.generate_stream("Hello", max_tokens=300, ignore_eos=True)
                next(running)
                waiting = c.generate_stream("Hello", max_tokens=5, ignore_eos=True)
                deadline = time.monotonic() + 10
                while c.stats().num_waiting < 1:
                    assert time.monotonic() < deadline, "second request never queued"
                    time.sleep(0.01)
                with pytest.raises(grpc.RpcError) as e:
                    c.generate("Hello", max_tokens=2)
                assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                running.cancel()
                assert collect(waiting).finish_reason == pb.FINISH_REASON_LENGTH

                # draining: NOT_SERVING, new calls UNAVAILABLE, the call in flight finishes
                inflight = c.generate_stream("Hello", max_tokens=100, ignore_eos=True)
                next(inflight)
                drained = server.submit(server.server.drain(grace=30))
                deadline = time.monotonic() + 5
                while c.health("") != "NOT_SERVING":
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                assert c.health("pagoda.v1.GenerationService") == "NOT_SERVING"
                with pytest.raises(grpc.RpcError) as e:
                    c.generate("Hello", max_tokens=2)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in e.value.details()
                rest = collect(inflight)
                assert rest.finish_reason == pb.FINISH_REASON_LENGTH and rest.usage.completion_tokens == 100
                drained.result(30)
    finally:
        gate.set()
        server.loop.call_soon_threadsafe(server.loop.stop)
        server.thread.join(10)


def test_health_status_names_match_grpc():
    assert health_pb2.HealthCheckResponse.ServingStatus.Name(1) == "SERVING"


# ---- n completions and prefix caching ----

def test_n_choices_unary_and_stream(client):
    kw = dict(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True, n=3)
    r = client.generate([5, 6, 7, 8], **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert (r.text, list(r.token_ids)) == (r.choices[0].text, list(r.choices[0].token_ids))
    assert r.usage.completion_tokens == 18 and r.usage.prompt_tokens == 4
    assert len({tuple(c.token_ids) for c in r.choices}) > 1
    pieces: dict[int, list[int]] = {}
    finished = set()
    for m in client.generate_stream([5, 6, 7, 8], **kw):
        pieces.setdefault(m.index, []).extend(m.token_ids)
        if m.finish_reason:
            finished.add(m.index)
            assert m.usage.completion_tokens == 6
    assert finished == {0, 1, 2}
    assert [pieces[i] for i in range(3)] == [list(c.token_ids) for c in r.choices]
    wait_all_blocks_free(client)


def test_n_out_of_range(client):
    with pytest.raises(grpc.RpcError) as e:
        client.generate("hi", n=65)
    assert e.value.code() == INVALID and "sampling.n" in e.value.details()


def test_prefix_cache_reuse_reported(client):
    prompt = list(range(40, 80))  # 40 tokens: two full 16-token blocks
    client.generate(prompt + [1], max_tokens=2)
    r = client.generate(prompt + [2], max_tokens=2)
    assert r.usage.cached_prompt_tokens == 32
    s = client.stats()
    assert s.cached_prompt_tokens >= 32 and 0 < s.prefix_cache_hit_rate <= 1 and s.kv_blocks_cached >= 2

"""Load over loopback, bounded in count and time: rounds of 640 concurrent GenerateStream calls on a
few channels, 20% cancelled at a random point, 10% with deadlines of a few milliseconds. The engine's
first step of a round waits until at least 500 calls are in flight on the server, so that many streams
are held at once whatever the machine's speed. Every stream that completes holds exactly the tokens
the same seeded request gives alone; no KV block, request id or call leaks; memory stays steady over
the rounds."""
from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import threading
import time

import grpc
import pytest

from pagoda.client.client import AsyncClient, Client, build_request
from grpc_fixtures import patched_run
from hardening_fixtures import rss_bytes, running, server_idle, wait_all_blocks_free
from pagoda.server.options import ServerOptions

pytestmark = pytest.mark.timeout(300)

STREAMS = 640
HELD = 500  # calls in flight on the server before the engine's first step of a round
ROUNDS = 5
CHANNELS = 4
C = grpc.StatusCode

# Distinct requests; each stream is one of them, so each has a reference computed alone.
SHAPES = [dict(prompt=f"{word} number {i}", seed=1000 + i, max_tokens=4 + i % 5, ignore_eos=True,
               **(dict(temperature=0.9, top_p=0.95) if i % 3 else dict(temperature=0.0)))
          for i, word in enumerate(["Once", "The", "A quick brown fox", "Hello", "In the beginning", "We",
                                    "Tokens", "Lorem ipsum dolor sit amet"] * 5)]


def shape_kwargs(shape: dict) -> dict:
    kw = dict(shape)
    return dict(prompt=kw.pop("prompt"), **kw)


@pytest.fixture(scope="module")
def srv():
    opts = ServerOptions(max_concurrent_streams=STREAMS + 64)
    with running(opts, num_kv_blocks=1024, max_num_seqs=256) as s:
        yield s


@pytest.fixture(scope="module")
def references(srv):
    """Each shape run alone, one at a time."""
    refs = []
    with Client(srv.target, timeout=60) as c:
        for shape in SHAPES:
            kw = shape_kwargs(shape)
            r = c.generate(kw.pop("prompt"), **kw)
            refs.append(list(r.token_ids))
            assert len(r.token_ids) == shape["max_tokens"]
    return refs


async def one_stream(client: AsyncClient, i: int, plan: str, rng: random.Random, stats: dict):
    """Runs stream i; returns (shape index, plan, status code, tokens)."""
    shape = i % len(SHAPES)
    kw = shape_kwargs(SHAPES[shape])
    prompt = kw.pop("prompt")
    timeout = rng.uniform(0.001, 0.05) if plan == "deadline" else 120
    cancel_after = rng.randint(0, 3) if plan == "cancel" else None
    call = client.stub.GenerateStream(build_request(prompt, stream=True, **kw), timeout=timeout)
    tokens: list[int] = []
    stats["open"] += 1
    stats["peak_open"] = max(stats["peak_open"], stats["open"])
    try:
        if cancel_after == 0:
            await asyncio.sleep(rng.uniform(0, 0.05))
            call.cancel()
        n = 0
        async for msg in call:
            tokens.extend(msg.token_ids)
            n += 1
            if cancel_after is not None and n >= cancel_after:
                call.cancel()
                break
        code = await call.code()
    except grpc.RpcError as e:
        code = e.code()
    except asyncio.CancelledError:
        code = C.CANCELLED
    finally:
        stats["open"] -= 1
    return shape, plan, code, tokens


async def one_round(target: str, seed: int) -> list[tuple]:
    rng = random.Random(seed)
    plans = ["cancel"] * (STREAMS // 5) + ["deadline"] * (STREAMS // 10)
    plans += ["complete"] * (STREAMS - len(plans))
    rng.shuffle(plans)
    clients = [AsyncClient(target) for _ in range(CHANNELS)]
    stats = {"open": 0, "peak_open": 0}
    try:
        results = await asyncio.gather(*(one_stream(clients[i % CHANNELS], i, plan, rng, stats)
                                         for i, plan in enumerate(plans)))
    finally:
        for c in clients:
            await c.close()
    return results, stats["peak_open"]


@contextlib.contextmanager
def gate(srv, held: int, timeout: float = 30.0):
    """The engine's next model run waits until `held` generation calls are in flight on the server."""
    state = srv.server.state

    def wrap(run):
        def gated_run(*a, **kw):
            deadline = time.monotonic() + timeout
            while state.num_generations < held and time.monotonic() < deadline:
                time.sleep(0.005)
            runner.run = run
            return run(*a, **kw)
        return gated_run

    with patched_run(srv.engine, wrap) as runner:
        yield


def server_peak(srv, stop: threading.Event, out: list) -> None:
    """Samples the server's count of generation calls in flight (its high-water mark)."""
    state = srv.server.state
    peak = 0
    while not stop.is_set():
        peak = max(peak, state.num_generations)
        time.sleep(0.002)
    out.append(peak)


def test_concurrent_streams_with_cancels_and_deadlines(srv, references):
    figures = {"streams": 0, "completed": 0, "cancelled": 0, "deadline": 0, "peak_server": 0, "rss_mb": [],
               "objects": []}
    with Client(srv.target, timeout=60) as c:
        base = c.stats()
        for r in range(ROUNDS):
            stop, peak = threading.Event(), []
            sampler = threading.Thread(target=server_peak, args=(srv, stop, peak))
            sampler.start()
            t0 = time.monotonic()
            with gate(srv, HELD):
                results, peak_client = asyncio.run(one_round(srv.target, seed=r))
            stop.set()
            sampler.join()
            elapsed = time.monotonic() - t0
            for shape, plan, code, tokens in results:
                if plan == "complete":
                    assert code == C.OK, (shape, code)
                else:
                    allowed = {C.OK, C.CANCELLED} if plan == "cancel" else {C.OK, C.DEADLINE_EXCEEDED}
                    assert code in allowed, (plan, code)
                if code == C.OK:
                    assert tokens == references[shape], f"stream of shape {shape} ({plan}) differs from it alone"
                    figures["completed"] += 1
                elif code == C.CANCELLED:
                    figures["cancelled"] += 1
                else:
                    figures["deadline"] += 1
            figures["streams"] += len(results)
            figures["peak_server"] = max(figures["peak_server"], peak[0])
            assert peak[0] >= HELD, f"only {peak[0]} streams in flight at once on the server (client: {peak_client})"
            s = wait_all_blocks_free(c)
            server_idle(srv)
            assert not getattr(srv.engine, "_queues", {}), "engine still holds request queues"
            gc.collect()
            figures["rss_mb"].append(round(rss_bytes() / 2**20, 1))
            figures["objects"].append(len(gc.get_objects()))
            print(f"round {r}: {len(results)} streams in {elapsed:.1f}s, server peak {peak[0]} in flight, "
                  f"rss {figures['rss_mb'][-1]:.0f} MiB, {figures['objects'][-1]} objects, "
                  f"blocks used {s.kv_blocks_used}")
        after = c.stats()
    # Memory steady: after the first round warmed everything up, later rounds add at most a little
    # (a leak of one object per stream would show as 640 more objects per round).
    rss, objects = figures["rss_mb"], figures["objects"]
    assert max(rss[1:]) - rss[0] < 48, f"RSS grew over the rounds: {rss}"
    assert max(objects[2:]) - objects[1] < 600, f"Python objects grew over the rounds: {objects}"
    assert after.generated_tokens > base.generated_tokens
    assert figures["cancelled"] >= ROUNDS * STREAMS // 10 and figures["deadline"] > 0
    print(f"load: {figures}")

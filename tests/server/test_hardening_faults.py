"""Faults, with nothing lost: a model forward that raises fails only that step's requests (INTERNAL)
and the next ones succeed; a cache too small for the load preempts and completes everything; a
request that can never fit is refused at admission; a request past --request-timeout is aborted and
its blocks freed; draining past the grace period cancels what is left; a second SIGTERM exits at once."""
from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time

import grpc
import pytest

from pagoda.client.client import AsyncClient, Client, collect
from grpc_fixtures import ServeProcess, patched_run, slow_steps, tiny_checkpoint
from hardening_fixtures import OptionsServer, running, server_idle, wait_all_blocks_free
from pagoda.server.options import ServerOptions

pytestmark = pytest.mark.timeout(180)

C = grpc.StatusCode
FAULTS: dict[str, int] = {}  # figures for the notes


@contextlib.contextmanager
def poisoned_step(engine, request_id: str, failed_steps: list):
    """The model run of the first step holding `request_id` raises; every request of that step is
    recorded in failed_steps (one set per failing step)."""
    def wrap(run):
        def bad_run(sched, *a, **kw):
            ids = {s.request_id for s in sched.seqs}
            if request_id in ids and not failed_steps:
                failed_steps.append(ids)
                raise RuntimeError("injected forward failure (test)")
            return run(sched, *a, **kw)
        return bad_run

    with patched_run(engine, wrap):
        yield


def test_forward_failure_fails_only_that_steps_requests():
    kw = dict(max_tokens=12, ignore_eos=True, temperature=0.8)
    with running(ServerOptions(), num_kv_blocks=128, max_num_seqs=4) as srv, Client(srv.target, timeout=60) as c:
        refs = {f"r{i}": list(c.generate(f"request {i}", seed=i, **kw).token_ids) for i in range(12)}
        failed: list[set] = []

        async def all_streams():
            async with AsyncClient(srv.target, timeout=60) as ac:
                async def one(i):
                    rid = f"r{i}" if i < 12 else "poison"
                    try:
                        msgs = [m async for m in ac.generate_stream(f"request {i}", seed=i, request_id=rid, **kw)]
                        return rid, C.OK, list(collect(msgs).token_ids), ""
                    except grpc.RpcError as e:
                        return rid, e.code(), None, e.details()
                return await asyncio.gather(*(one(i) for i in (0, 1, 2, 12, 3, 4, 5, 6, 7, 8, 9, 10, 11)))

        with poisoned_step(srv.engine, "poison", failed), slow_steps(srv.engine, 0.002):
            results = asyncio.run(all_streams())
        assert len(failed) == 1 and "poison" in failed[0]
        internal = {rid for rid, code, _, _ in results if code == C.INTERNAL}
        assert internal == failed[0], (internal, failed)
        for rid, code, tokens, details in results:
            if rid in internal:
                assert "injected forward failure" in details
            else:
                assert code == C.OK and tokens == refs[rid], (rid, code, details)
        assert len(internal) < len(results)
        # The next requests succeed, and nothing leaked.
        assert list(c.generate("request 0", seed=0, **kw).token_ids) == refs["r0"]
        assert c.health() == "SERVING"
        wait_all_blocks_free(c)
        server_idle(srv)
        FAULTS["forward failures"] = 1
        FAULTS["requests failed by it"] = len(internal)
        FAULTS["requests of other steps completed"] = len(results) - len(internal)


def test_tiny_cache_preempts_and_completes_everything():
    # 12 blocks of 16 tokens: the context is capped at 192; each request needs 5 blocks at its end.
    n, kw = 24, dict(max_tokens=60, ignore_eos=True, temperature=0.9, top_p=0.9)
    with running(ServerOptions(), num_kv_blocks=12, max_num_seqs=16) as srv, Client(srv.target, timeout=120) as c:
        assert c.model_info().context_length == 192
        prompts = [f"a prompt of some twenty tokens, #{i:02d}" for i in range(n)]
        refs = [list(c.generate(p, seed=i, **kw).token_ids) for i, p in enumerate(prompts)]
        before = c.stats().num_preemptions

        async def all_streams():
            async with AsyncClient(srv.target, timeout=120) as ac:
                async def one(i):
                    return list(collect([m async for m in ac.generate_stream(prompts[i], seed=i, **kw)]).token_ids)
                return await asyncio.gather(*(one(i) for i in range(n)))

        got = asyncio.run(all_streams())
        assert got == refs
        s = wait_all_blocks_free(c)
        assert s.num_preemptions > before, "the load never preempted: the test does not test preemption"
        FAULTS["preemptions survived"] = s.num_preemptions - before


def test_request_that_can_never_fit_is_refused_at_admission():
    with running(ServerOptions(), num_kv_blocks=12) as srv, Client(srv.target, timeout=60) as c:
        before = c.stats()
        for kw, field in [(dict(prompt=[65] * 100, max_tokens=150), "stopping.max_tokens"),
                          (dict(prompt=[65] * 300, max_tokens=1), "token_ids.ids"),
                          (dict(prompt="x" * 400), "text"),
                          (dict(prompt=[65] * 180, n=8, max_tokens=13), "stopping.max_tokens")]:
            prompt = kw.pop("prompt")
            for stream in (False, True):
                with pytest.raises(grpc.RpcError) as e:
                    list(c.generate_stream(prompt, **kw)) if stream else c.generate(prompt, **kw)
                assert e.value.code() == C.INVALID_ARGUMENT and e.value.details().startswith(field), \
                    e.value.details()
                assert "context_length (192)" in e.value.details() or "192" in e.value.details()
        after = c.stats()
        # Refused before the engine saw it: nothing was computed, nothing is held.
        assert after.prompt_tokens_processed == before.prompt_tokens_processed
        assert after.kv_blocks_used == 0 and after.num_waiting == 0


def test_request_timeout_aborts_and_frees_blocks():
    with running(ServerOptions(request_timeout=0.4), num_kv_blocks=64) as srv, Client(srv.target, timeout=60) as c:
        assert c.model_info().limits.request_timeout_seconds == pytest.approx(0.4)
        with slow_steps(srv.engine, 0.01):
            t0 = time.monotonic()
            stream = c.generate_stream("Hello", max_tokens=400, ignore_eos=True, request_id="slow-stream")
            got = []
            with pytest.raises(grpc.RpcError) as e:
                for msg in stream:
                    got.append(msg)
            assert e.value.code() == C.DEADLINE_EXCEEDED
            assert "--request-timeout" in e.value.details() and "slow-stream" in e.value.details()
            assert got and 0.35 < time.monotonic() - t0 < 5
            with pytest.raises(grpc.RpcError) as e:
                c.generate("Hello", max_tokens=400, ignore_eos=True)
            assert e.value.code() == C.DEADLINE_EXCEEDED
        # A wedged engine (its step never returns) still gets an answer at the time limit.
        release = threading.Event()
        runner = srv.engine.core.runner
        run = runner.run
        runner.run = lambda *a, **kw: (release.wait(30), run(*a, **kw))[1]
        try:
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                list(c.generate_stream("Hello", max_tokens=4, ignore_eos=True))
            assert e.value.code() == C.DEADLINE_EXCEEDED and time.monotonic() - t0 < 5
        finally:
            release.set()
            runner.run = run
        wait_all_blocks_free(c)
        server_idle(srv)
        # Short requests are not affected.
        assert len(c.generate("Hello", max_tokens=4, ignore_eos=True).token_ids) == 4
        FAULTS["requests timed out"] = 3


def test_drain_past_the_grace_period_cancels_what_is_left():
    srv = OptionsServer.start(ServerOptions(), num_kv_blocks=64)
    try:
        with Client(srv.target, timeout=60) as c, slow_steps(srv.engine, 0.01):
            stream = c.generate_stream("Hello", max_tokens=400, ignore_eos=True)
            next(stream)
            t0 = time.monotonic()
            srv.call(srv.server.drain(0.3), 30)
            assert time.monotonic() - t0 < 5
            with pytest.raises(grpc.RpcError) as e:
                list(stream)
            assert e.value.code() in (C.CANCELLED, C.UNAVAILABLE, C.ABORTED), e.value.code()
        engine = srv.engine
        s = engine.stats()
        assert s.num_running == 0 and s.num_waiting == 0 and s.num_used_blocks == 0
    finally:
        srv.loop.call_soon_threadsafe(srv.loop.stop)
        srv.thread.join(10)


def test_second_sigterm_exits_at_once():
    proc = ServeProcess("--model", tiny_checkpoint(), "--dtype", "float32", "--device", "cpu",
                        "--num-kv-blocks", "64", "--max-num-seqs", "1", "--grace-period", "120")
    try:
        proc.wait_ready()
        with Client(proc.target, timeout=60) as c:
            streams = [c.generate_stream("Hello", max_tokens=400, ignore_eos=True) for _ in range(4)]
            next(streams[0])
            proc.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while "draining" not in proc.output():
                assert time.monotonic() < deadline, proc.output()
                time.sleep(0.01)
            assert proc.proc.poll() is None  # draining: waits for the calls in flight
            t0 = time.monotonic()
            proc.proc.send_signal(signal.SIGTERM)
            assert proc.proc.wait(10) == 1
            assert time.monotonic() - t0 < 5
    finally:
        proc.kill()


def test_zz_fault_figures():
    print(f"\nfaults: {FAULTS}")

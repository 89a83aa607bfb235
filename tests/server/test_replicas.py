"""Several replicas behind one client: pagoda.client's round_robin channel over a list of targets
spreads calls over two `pagoda serve` processes, and when one of them gets SIGTERM mid-run no call
fails: its in-flight streams finish during its drain, new calls go to the other replica (client-side
health checking drops the draining one; a call it refuses UNAVAILABLE is retried on the other).
Also the target forms (a list, "a,b", dns:///) and the CLI's --target with several servers."""
from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import threading
import time

import grpc
import pytest

from grpc_fixtures import ServeProcess, assert_all_gone, children
from pagoda.client.cli import main
from pagoda.client.client import (RETRY_ATTEMPTS, SERVICE_NAME, AsyncClient, Client, channel_target, collect,
                                  make_channel)
from pagoda.v1 import generation_pb2 as pb

pytestmark = pytest.mark.timeout(600)

# One engine thread each: two replicas (a server and an engine process each) share a small CI machine.
SERVE_ARGS = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "1024", "--cpu-threads", "1"]
LONG = 2000  # tokens of the streams that must still be running when their replica gets SIGTERM


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """The tests' tiny random model, with room for LONG-token streams (it generates thousands of
    tokens a second on one CPU thread, so a stream must be long to still run at the SIGTERM)."""
    from pagoda.engine.demo import build_tiny_checkpoint

    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("replicas") / "llama"), initializer_range=0.3,
                                 max_position_embeddings=4096)


def _family(proc: ServeProcess) -> set[int]:
    """The server's process and its children (the engine process), grandchildren included."""
    pids, todo = set(), [proc.proc.pid]
    while todo:
        pid = todo.pop()
        if pid not in pids:
            pids.add(pid)
            todo.extend(children(pid))
    return pids


def _stop_all(procs: list[ServeProcess], families: list[set[int]]) -> None:
    """SIGTERM (then kill) every server; fails if any of their processes is left behind."""
    for p in procs:
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.proc.wait(60)
        except Exception:
            p.kill()
    pids = set().union(*families) if families else set()
    assert_all_gone(pids, timeout=30)


@pytest.fixture
def replicas(model):
    """Two `pagoda serve` processes on the tiny model, SERVING, on loopback ports; stopped at the end."""
    procs: list[ServeProcess] = []
    families: list[set[int]] = []
    try:
        for _ in range(2):  # both load at once
            procs.append(ServeProcess("--model", model, *SERVE_ARGS, "--grace-period", "120"))
        for p in procs:
            p.wait_ready(timeout=240)
            families.append(_family(p))
        yield procs
    finally:
        try:
            _stop_all(procs, families)
        finally:
            for p in procs:
                p.kill()


def _stats(proc: ServeProcess) -> pb.GetStatsResponse:
    with Client(proc.target, timeout=30) as c:
        return c.stats()


def test_calls_are_spread_over_both_replicas(replicas):
    a, b = replicas
    before = [_stats(p).generated_tokens for p in replicas]
    with Client([a.target, b.target], timeout=120) as c:
        c.wait_ready(60)
        done = 0
        # round_robin alternates once both connections are up (the first calls may all go to the one
        # that was ready first): go on until both replicas have generated, within generous bounds
        while done < 60:
            r = c.generate("Hello", max_tokens=3, ignore_eos=True, temperature=0)
            assert len(r.token_ids) == 3
            done += 1
            if done >= 10 and all(_stats(p).generated_tokens > n for p, n in zip(replicas, before)):
                break
        # the async client and the comma-separated form balance the same way
        async def several():
            async with AsyncClient(f"{a.target},{b.target}", timeout=120) as ac:
                return await asyncio.gather(*(ac.generate("Hi", max_tokens=2, ignore_eos=True) for _ in range(6)))

        assert all(len(r.token_ids) == 2 for r in asyncio.run(several()))
    grew = [_stats(p).generated_tokens - n for p, n in zip(replicas, before)]
    assert all(g > 0 for g in grew), f"tokens generated per replica: {grew} after {done} calls"
    assert sum(grew) == 3 * done + 2 * 6


def test_sigterm_on_one_replica_fails_no_call(replicas):
    a, b = replicas
    failures: list[BaseException] = []
    results: list[pb.GenerateResponse] = []
    lock = threading.Lock()
    with Client([a.target, b.target], timeout=180) as c:
        c.wait_ready(60)
        # Streams in flight on both replicas: long enough to outlive the SIGTERM, each read up to its
        # first message (so it is running, and committed: gRPC would not retry it).
        deadline = time.monotonic() + 120
        while True:
            streams = [c.generate_stream("Hello", max_tokens=LONG, ignore_eos=True) for _ in range(6)]
            firsts = [next(s) for s in streams]
            running = [_stats(p).num_running for p in replicas]
            if all(running):
                break
            for s in streams:  # all landed on one replica (the other connection was not up yet): again
                s.cancel()
            assert time.monotonic() < deadline, f"streams never ran on both replicas: {running}"

        def finish(first, stream):
            try:
                out = collect([first, *stream])
                assert out.finish_reason == pb.FINISH_REASON_LENGTH and len(out.token_ids) == LONG, out
                with lock:
                    results.append(out)
            except BaseException as e:  # noqa: BLE001 - reported below
                with lock:
                    failures.append(e)

        readers = [threading.Thread(target=finish, args=(f, s)) for f, s in zip(firsts, streams)]
        for t in readers:
            t.start()

        stop_new = threading.Event()
        new_calls = [0]

        def new_work(streaming: bool):
            while not stop_new.is_set():
                try:
                    if streaming:
                        out = collect(c.generate_stream("Hi", max_tokens=4, ignore_eos=True))
                    else:
                        out = c.generate("Hi", max_tokens=4, ignore_eos=True)
                    assert len(out.token_ids) == 4, out
                    with lock:
                        new_calls[0] += 1
                except BaseException as e:  # noqa: BLE001 - reported below
                    with lock:
                        failures.append(e)
                    return

        workers = [threading.Thread(target=new_work, args=(s,)) for s in (False, True, False, True)]
        for t in workers:  # new calls, flowing to both replicas until the SIGTERM, then to b
            t.start()

        a.proc.send_signal(signal.SIGTERM)  # at once: a's LONG streams are still running
        deadline = time.monotonic() + 60
        while not (drain := re.search(r"draining: (\d+) call\(s\) in flight", a.output())):
            assert time.monotonic() < deadline, a.output()
            time.sleep(0.05)
        # the drain had calls to wait for: a's share of the LONG streams (gen. at most a few thousand
        # tokens a second here, shared by three or more streams) at least
        assert int(drain.group(1)) >= 1, a.output()
        assert a.proc.wait(150) == 0, a.output()  # drained: its streams finished, then it stopped
        served_after = new_calls[0]
        deadline = time.monotonic() + 60
        while new_calls[0] < served_after + 8 and not failures:  # and calls go on, to b alone
            assert time.monotonic() < deadline, "no new calls completed after the drain"
            time.sleep(0.1)
        stop_new.set()
        for t in workers + readers:
            t.join(180)
            assert not t.is_alive()
    assert not failures, "".join(f"\n{type(e).__name__}: {e}" for e in failures)
    assert len(results) == 6
    assert "grace period over" not in a.output(), a.output()
    assert b.proc.poll() is None


# ---- the target forms, without servers ----

def test_target_forms():
    assert channel_target("localhost:50051") == ("localhost:50051", False)  # one target: as before
    assert channel_target(["127.0.0.1:1"]) == ("127.0.0.1:1", False)
    assert channel_target("127.0.0.1:1,localhost:2") == ("ipv4:127.0.0.1:1,127.0.0.1:2", True)
    assert channel_target(["127.0.0.1:1", " 127.0.0.2:2 "]) == ("ipv4:127.0.0.1:1,127.0.0.2:2", True)
    assert channel_target("[::1]:1,[::1]:2") == ("ipv6:[::1]:1,[::1]:2", True)
    assert channel_target("dns:///pagoda-headless.ns.svc.cluster.local:50051") == \
        ("dns:///pagoda-headless.ns.svc.cluster.local:50051", True)
    with pytest.raises(ValueError, match="host:port"):
        channel_target("127.0.0.1,127.0.0.2:1")
    with pytest.raises(ValueError, match="cannot mix"):
        channel_target("127.0.0.1:1,[::1]:2")
    with pytest.raises(ValueError, match="cannot resolve"):
        channel_target("127.0.0.1:1,nowhere.invalid:2")
    with pytest.raises(ValueError, match="tls_server_name"):
        make_channel("127.0.0.1:1,127.0.0.2:2", tls=True)
    make_channel("127.0.0.1:1,127.0.0.2:2", tls=True, tls_server_name="pagoda.example").close()


def test_service_config_round_robin_retries_health():
    """The channel gets the replica service config; gRPC accepts it (a bad one fails the channel)."""
    from pagoda.client.client import replica_service_config

    config = replica_service_config()
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert config["healthCheckConfig"] == {"serviceName": SERVICE_NAME}
    retry = config["methodConfig"][0]["retryPolicy"]
    assert retry["retryableStatusCodes"] == ["UNAVAILABLE"] and 2 <= retry["maxAttempts"] == RETRY_ATTEMPTS <= 5
    with socket.socket() as s:  # a closed port: the call fails UNAVAILABLE after the channel parsed its config
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with Client(f"127.0.0.1:{port},localhost:{port}", timeout=5) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.tokenize("x")
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
        assert "service config" not in (e.value.details() or "").lower(), e.value.details()
    json.dumps(config)


def test_cli_target_list(replicas, capsys):
    a, b = replicas
    status = main(["generate", "Hello", "--max-tokens", "3", "--ignore-eos", "--temperature", "0",
                   "--target", f"{a.target},{b.target}", "--timeout", "60"])
    out, err = capsys.readouterr()
    assert status == 0 and out.strip(), err
    status = main(["info", "--target", f"dns:///localhost:{a.port}", "--timeout", "60"])
    out, err = capsys.readouterr()
    assert status == 0, err
    with pytest.raises(SystemExit) as e:
        main(["info", "--target", "127.0.0.1,127.0.0.1:1"])
    assert e.value.code == 2
    assert "--target 127.0.0.1,127.0.0.1:1: each of several targets must be host:port" in capsys.readouterr().err


def test_tls_to_several_targets_checks_the_given_server_name(tmp_path):
    """Two TLS servers (in process) behind one list: the certificate is checked against tls_server_name,
    and calls reach both."""
    from hardening_fixtures import make_certs, running
    from pagoda.server.options import ServerOptions

    certs = make_certs(tmp_path / "certs")
    opts = ServerOptions(tls_cert=certs["server_cert"], tls_key=certs["server_key"])
    with running(opts, num_kv_blocks=32) as s1, running(opts, num_kv_blocks=32) as s2:
        targets = [s1.target, s2.target]
        with Client(targets, timeout=30, tls_ca=certs["ca"], tls_server_name="localhost") as c:
            c.wait_ready(30)
            for _ in range(8):
                assert len(c.generate("Hello", max_tokens=2, ignore_eos=True).token_ids) == 2
        for s in (s1, s2):
            with Client(s.target, timeout=30, tls_ca=certs["ca"]) as one:
                assert one.stats().generated_tokens > 0
        with Client(targets, timeout=5, tls_ca=certs["ca"], tls_server_name="pagoda.example.com") as c:
            with pytest.raises(grpc.RpcError) as e:  # the certificate is not for that name
                c.tokenize("x")
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE

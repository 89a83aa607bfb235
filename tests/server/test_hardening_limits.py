"""Limits, each a `pagoda serve` flag (and PAGODA_* variable) with a default: message size, prompt
tokens, max_tokens, stop strings (number and length), stop token ids, waiting-queue length (with a
retry hint), concurrent generation calls, request timeout (tests/server/test_hardening_faults.py), and
keepalive settings that tolerate a long prefill yet drop a vanished client."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from pagoda.client.client import Client
from grpc_fixtures import REPO, patched_run
from hardening_fixtures import running, server_idle, wait_all_blocks_free
from pagoda.server.options import ServerOptions

pytestmark = pytest.mark.timeout(180)

C = grpc.StatusCode


@contextlib.contextmanager
def held_engine(engine):
    """The engine's next model run waits until released (the requests it holds stay in flight)."""
    release = threading.Event()

    def wrap(run):
        def held(*a, **kw):
            release.wait(30)
            return run(*a, **kw)
        return held

    with patched_run(engine, wrap):
        try:
            yield release
        finally:
            release.set()


def invalid(fn, *a, **kw) -> str:
    with pytest.raises(grpc.RpcError) as e:
        r = fn(*a, **kw)
        if not hasattr(r, "token_ids"):
            list(r)
    assert e.value.code() == C.INVALID_ARGUMENT, (e.value.code(), e.value.details())
    return e.value.details()


# ---- flags and environment -> ServerOptions ----

def parse_serve(argv, env=None, monkeypatch=None):
    from pagoda.client.cli import build_parser
    from pagoda.server.main import server_options

    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    args = build_parser().parse_args(["serve", *argv])
    return server_options(args)


def test_limit_flags_defaults(monkeypatch):
    for k in list(os.environ):
        if k.startswith("PAGODA_"):
            monkeypatch.delenv(k)
    o = parse_serve([], monkeypatch=monkeypatch)
    assert (o.max_message_bytes, o.max_prompt_tokens, o.max_tokens_limit) == (4 << 20, None, None)
    assert (o.max_stop_strings, o.max_stop_string_len, o.max_stop_token_ids) == (16, 256, 64)
    assert (o.max_concurrent_streams, o.request_timeout) == (2048, 600.0)
    assert (o.keepalive_time, o.keepalive_timeout, o.keepalive_min_ping_interval) == (30.0, 20.0, 5.0)
    assert o.http_keepalive_timeout == 75.0  # past httpx's (the openai SDK's) 5 s and nginx's 60 s
    assert (o.tls_cert, o.tls_key, o.tls_client_ca, o.api_key, o.metrics_port) == (None, None, None, None, 0)
    grpc_opts = dict(o.grpc_options())
    assert grpc_opts["grpc.max_send_message_length"] == 4 << 20
    # gRPC takes in more, for the servicer to refuse what is over the limit by name (server/servicer.py Oversized)
    assert grpc_opts["grpc.max_receive_message_length"] == 2 * (4 << 20) + (16 << 20)
    # Keepalive that tolerates long prefills: clients may ping every 5 s with no data in flight, the
    # server keeps pinging through a prefill (no cap on pings without data) and answers pings on idle
    # connections.
    assert grpc_opts["grpc.http2.min_ping_interval_without_data_ms"] == 5000
    assert grpc_opts["grpc.http2.max_pings_without_data"] == 0
    assert grpc_opts["grpc.keepalive_permit_without_calls"] == 1
    assert grpc_opts["grpc.keepalive_time_ms"] == 30000 and grpc_opts["grpc.keepalive_timeout_ms"] == 20000


def test_limit_flags_and_env(monkeypatch):
    env = {"PAGODA_MAX_MESSAGE_BYTES": "65536", "PAGODA_MAX_PROMPT_TOKENS": "100", "PAGODA_MAX_STOP_STRINGS": "4",
           "PAGODA_REQUEST_TIMEOUT": "12.5", "PAGODA_API_KEY": "s3cret", "PAGODA_METRICS_PORT": "9400",
           "PAGODA_KEEPALIVE_MIN_PING_INTERVAL": "1", "PAGODA_HTTP_KEEPALIVE_TIMEOUT": "90"}
    o = parse_serve(["--max-tokens-limit", "50", "--max-stop-string-len", "32", "--max-stop-token-ids", "8",
                     "--max-concurrent-streams", "7", "--keepalive-time", "60", "--keepalive-timeout", "5",
                     "--max-prompt-tokens", "90"], env, monkeypatch)
    assert (o.max_message_bytes, o.max_prompt_tokens, o.max_tokens_limit) == (65536, 90, 50)
    assert (o.max_stop_strings, o.max_stop_string_len, o.max_stop_token_ids) == (4, 32, 8)
    assert (o.max_concurrent_streams, o.request_timeout, o.api_key, o.metrics_port) == (7, 12.5, "s3cret", 9400)
    assert (o.keepalive_time, o.keepalive_timeout, o.keepalive_min_ping_interval, o.http_keepalive_timeout) == (
        60.0, 5.0, 1.0, 90.0)
    assert "s3cret" not in repr(o)  # the key stays out of logs and tracebacks


@pytest.mark.parametrize("argv,message", [
    (["--max-message-bytes", "0"], "max_message_bytes"),
    (["--max-concurrent-streams", "-1"], "max_concurrent_streams"),
    (["--request-timeout", "nan"], "request_timeout"),
    (["--max-stop-strings", "-2"], "max_stop_strings"),
    (["--tls-cert", "c.pem"], "tls_key"),
    (["--tls-client-ca", "ca.pem"], "tls_client_ca"),
    (["--metrics-port", "70000"], "metrics_port"),
    (["--http-keepalive-timeout", "0"], "http_keepalive_timeout"),
])
def test_bad_limit_values_are_refused(monkeypatch, argv, message):
    with pytest.raises(ValueError, match=message):
        parse_serve(argv, monkeypatch=monkeypatch)


def test_bad_flag_exits_1_with_the_reason():
    from grpc_fixtures import pagoda_command

    out = subprocess.run(pagoda_command() + ["serve", "--port", "0", "--http-port", "off", "--max-message-bytes", "0"],
                         capture_output=True, text=True, timeout=60, cwd=str(REPO))
    assert out.returncode == 1 and "max_message_bytes" in out.stderr


# ---- the limits on a live server ----

@pytest.fixture(scope="module")
def srv():
    opts = ServerOptions(max_message_bytes=64 * 1024, max_prompt_tokens=32, max_tokens_limit=8, max_stop_strings=2,
                         max_stop_string_len=5, max_stop_token_ids=3, max_concurrent_streams=3)
    with running(opts, num_kv_blocks=64, max_num_seqs=1, max_queue_len=2) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    with Client(srv.target, timeout=60) as c:
        yield c


def wait_until(cond, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def fill(srv, client) -> list:
    """With the engine held: one stream running and two waiting, the server's three calls in flight.
    The first is seen running before the others are sent: a request that arrives while the first
    is still waiting for its step would (rightly) find the two-request queue full."""
    scheduler = srv.engine.core.scheduler
    streams = [client.generate_stream("Hello", max_tokens=2)]
    wait_until(lambda: len(scheduler.running) == 1, "the first request to run")
    streams += [client.generate_stream("Hello", max_tokens=2) for _ in range(2)]
    wait_until(lambda: srv.server.state.num_generations == 3 and srv.engine.num_queued() == 2,
               "two queued requests")
    return streams


def test_limits_are_reported(client):
    lim = client.model_info().limits
    assert (lim.max_prompt_tokens, lim.max_tokens_limit, lim.default_max_tokens) == (32, 8, 8)
    assert (lim.max_stop_strings, lim.max_stop_string_len, lim.max_stop_token_ids) == (2, 5, 3)
    assert (lim.max_message_bytes, lim.max_concurrent_streams, lim.max_queue_len) == (64 * 1024, 3, 2)
    assert lim.request_timeout_seconds == 600


def test_max_message_bytes(client):
    for fn in (client.generate, client.generate_stream):
        with pytest.raises(grpc.RpcError) as e:
            r = fn("x" * (64 * 1024 + 10), max_tokens=2)
            list(r) if fn.__name__ == "generate_stream" else r
        assert e.value.code() == C.RESOURCE_EXHAUSTED and "larger than --max-message-bytes" in e.value.details()
    # Just under the limit: an ordinary answer (here the prompt is too long in tokens).
    assert invalid(client.generate, "x" * (60 * 1024), max_tokens=2).startswith("text is")
    # The limit holds for answers too: 40 KB of text tokenizes to an answer over 64 KiB.
    with pytest.raises(grpc.RpcError) as e:
        client.tokenize("\u00e9" * 20_000)
    assert e.value.code() == C.RESOURCE_EXHAUSTED
    assert client.health() == "SERVING"


def test_max_prompt_tokens(client):
    assert len(client.generate([65] * 32, max_tokens=2).token_ids) <= 2
    for fn in (client.generate, client.generate_stream):
        msg = invalid(fn, [65] * 33, max_tokens=2)
        assert msg.startswith("token_ids.ids is 33 tokens") and "--max-prompt-tokens" in msg
        msg = invalid(fn, "y" * 40, max_tokens=2)
        assert msg.startswith("text is 4") and "32 prompt tokens" in msg
        msg = invalid(fn, messages=[("user", "z" * 40)], max_tokens=2)
        assert msg.startswith("messages is")


def test_max_tokens_limit(client):
    r = client.generate("Hello", ignore_eos=True)  # unset: the default, capped by the limit
    assert len(r.token_ids) == 8
    assert len(client.generate("Hello", max_tokens=8, ignore_eos=True).token_ids) == 8
    for fn in (client.generate, client.generate_stream):
        msg = invalid(fn, "Hello", max_tokens=9)
        assert msg.startswith("stopping.max_tokens must be at most 8") and "--max-tokens-limit" in msg


def test_stop_string_limits(client):
    client.generate("Hello", max_tokens=2, stop=["ab", "cdefg"])
    for fn in (client.generate, client.generate_stream):
        msg = invalid(fn, "Hello", max_tokens=2, stop=["a", "b", "c"])
        assert msg.startswith("stopping.stop must hold at most 2") and "--max-stop-strings" in msg
        msg = invalid(fn, "Hello", max_tokens=2, stop=["ok", "abcdef"])
        assert msg.startswith("stopping.stop[1] must be at most 5 characters") and "--max-stop-string-len" in msg
        msg = invalid(fn, "Hello", max_tokens=2, stop_token_ids=[1, 2, 3, 4])
        assert msg.startswith("stopping.stop_token_ids must hold at most 3") and "--max-stop-token-ids" in msg


def test_queue_full_has_a_retry_hint(srv, client):
    """max_num_seqs 1 and max_queue_len 2: with the engine held, the fourth request finds the queue full."""
    with held_engine(srv.engine):
        streams = fill(srv, client)
        srv.set_options(max_concurrent_streams=10)
        try:
            with pytest.raises(grpc.RpcError) as e:
                client.generate("Hello", max_tokens=2)
        finally:
            srv.set_options(max_concurrent_streams=3)
        assert e.value.code() == C.RESOURCE_EXHAUSTED
        assert "queue is full" in e.value.details() and "retry after a short backoff" in e.value.details()
    assert [len(list(s)) > 0 for s in streams] == [True] * 3  # all three complete
    wait_all_blocks_free(client)


def test_max_concurrent_streams(srv, client):
    with held_engine(srv.engine):
        streams = fill(srv, client)
        for fn in (client.generate, client.generate_stream):
            with pytest.raises(grpc.RpcError) as e:
                r = fn("Hello", max_tokens=2)
                list(r) if fn.__name__ == "generate_stream" else r
            assert e.value.code() == C.RESOURCE_EXHAUSTED
            assert "--max-concurrent-streams" in e.value.details()
            assert "retry after a short backoff" in e.value.details()
        # Other calls are not counted.
        assert client.stats().kv_blocks_total == 64 and client.health() == "SERVING"
    for s in streams:
        list(s)
    assert len(client.generate("Hello", max_tokens=2, ignore_eos=True).token_ids) == 2
    server_idle(srv)


# ---- keepalive ----

@contextlib.contextmanager
def long_prefill(engine, seconds: float):
    """The engine's next model run takes `seconds` longer: a stream sends no data meanwhile."""
    def wrap(run):
        def slow(*a, **kw):
            runner.run = run
            time.sleep(seconds)
            return run(*a, **kw)
        return slow

    with patched_run(engine, wrap) as runner:
        yield


# A client that pings as often as grpc lets it (about once a second once throttled) with no data.
EAGER_PINGS = [("grpc.keepalive_time_ms", 100), ("grpc.keepalive_timeout_ms", 5000),
               ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]


@pytest.mark.parametrize("min_ping_interval,ok", [(0.5, True), (300.0, False)],
                         ids=["pagoda-setting", "grpc-default"])
def test_keepalive_tolerates_a_long_prefill(min_ping_interval, ok):
    """A client pinging during a 3.5 s prefill: fine with a server that allows pings that often, and
    GOAWAY too_many_pings with grpc's default (5 minutes, 2 strikes), which is what the setting is for.
    (Scaled down: the defaults allow pings every 5 s through prefills of any length.)"""
    with running(ServerOptions(keepalive_min_ping_interval=min_ping_interval), num_kv_blocks=64) as srv:
        with Client(srv.target, timeout=30, options=EAGER_PINGS) as c:
            c.health()
            with long_prefill(srv.engine, 3.5):
                try:
                    msgs = list(c.generate_stream("Hello", max_tokens=4, ignore_eos=True))
                    code = C.OK
                except grpc.RpcError as e:
                    code, msgs = e.code(), None
            if ok:
                assert code == C.OK and sum(len(m.token_ids) for m in msgs) == 4
            else:
                assert code == C.UNAVAILABLE
            wait_all_blocks_free(c)


CLIENT_SCRIPT = r"""
import sys
from pagoda.client.client import Client
with Client(sys.argv[1], timeout=120) as c:
    for msg in c.generate_stream("Hello", max_tokens=400, ignore_eos=True):
        print("got", flush=True)
"""


def test_keepalive_drops_a_vanished_client_and_frees_its_blocks():
    """A client process that stops answering (SIGSTOP: its socket stays open, nothing reads it): the
    server's keepalive ping goes unanswered, the connection is dropped, the request aborted. (With
    grpc.keepalive_timeout_ms alone, grpc 1.85 never drops it: grpc.http2.ping_timeout_ms is what
    times the ping out.)"""
    from grpc_fixtures import slow_steps

    opts = ServerOptions(keepalive_time=0.3, keepalive_timeout=0.5)
    # 400 tokens at 50 ms a step: the generation would last 20 s; the keepalive must end it well before.
    with running(opts, num_kv_blocks=64) as srv, Client(srv.target, timeout=30) as c, \
            slow_steps(srv.engine, 0.05):
        proc = subprocess.Popen([sys.executable, "-c", CLIENT_SCRIPT, srv.target], cwd=str(REPO),
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            assert proc.stdout.readline().strip() == "got"
            assert c.stats().kv_blocks_used > 0
            proc.send_signal(signal.SIGSTOP)
            t0 = time.monotonic()
            wait_all_blocks_free(c, timeout=10)
            server_idle(srv)
            assert time.monotonic() - t0 < 8
        finally:
            proc.kill()
            proc.wait(10)


def test_max_connection_age_recycles_connections_without_cutting_calls(caplog):
    """--max-connection-age: the server asks a client to reconnect (GOAWAY) once a connection is that
    old, so that clients balancing over a DNS name see new replicas; a stream running past the age
    still finishes, and later calls arrive over a new connection (another client port)."""
    import json as _json

    from grpc_fixtures import slow_steps

    caplog.set_level("INFO", logger="pagoda.requests")
    with running(ServerOptions(max_connection_age=0.5), num_kv_blocks=64) as srv:
        with Client(srv.target, timeout=60) as c:
            with slow_steps(srv.engine, 0.02):
                msgs = list(c.generate_stream("Hello", max_tokens=60, ignore_eos=True))  # ~1.5 s: past the age
            assert sum(len(m.token_ids) for m in msgs) == 60 and msgs[-1].finish_reason
            time.sleep(1.0)
            for _ in range(3):
                assert c.generate("Hello", max_tokens=2).usage.completion_tokens == 2
                time.sleep(0.7)
    peers = [_json.loads(r.getMessage())["peer"] for r in caplog.records if r.name == "pagoda.requests"]
    assert len(peers) == 4 and len(set(peers)) >= 2, peers
    assert ("grpc.max_connection_age_ms", 500) in ServerOptions(max_connection_age=0.5).grpc_options()
    assert not any(k == "grpc.max_connection_age_ms" for k, _ in ServerOptions().grpc_options())


def test_http_keeps_an_idle_connection_for_its_keepalive_timeout():
    """--http-keepalive-timeout: an idle HTTP connection is reused within it (the default, 75 s, outlasts
    the clients' own pools, so that they close first: a server closing as a client reuses the
    connection resets that request) and closed by the server after it."""
    import http.client

    with running(ServerOptions(http_port=0, http_keepalive_timeout=1.5), num_kv_blocks=64) as srv:
        conn = http.client.HTTPConnection("127.0.0.1", srv.server.http_port, timeout=30)
        try:
            for pause in (0.0, 0.3):
                time.sleep(pause)
                conn.request("GET", "/health")
                response = conn.getresponse()
                assert response.status == 200 and response.read()
                if pause == 0.0:
                    sock = conn.sock
            assert conn.sock is sock  # the same connection, still open
            time.sleep(2.5)
            sock.settimeout(1.0)  # (uvicorn's own default, 5 s, would still hold it open)
            assert sock.recv(1) == b""  # closed by the server
        finally:
            conn.close()

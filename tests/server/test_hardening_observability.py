"""Observability: Prometheus metrics on --metrics-port (scraped over loopback: requests by method and
code, latency histograms, KV blocks, running/waiting, preemptions, tokens), x-request-id echoed and
used as the request id, and one structured (JSON) log line per finished generation."""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.client.client import AsyncClient, Client
from grpc_fixtures import ServeProcess, slow_steps, tiny_checkpoint
from hardening_fixtures import running, wait_all_blocks_free
from pagoda.v1 import generation_pb2 as pb
from pagoda.server.options import ServerOptions

pytestmark = pytest.mark.timeout(180)

C = grpc.StatusCode


def scrape(port: int) -> dict:
    """{(name, frozenset(labels.items())): value} of every sample at http://127.0.0.1:port/metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture(scope="module")
def srv():
    # A small cache, so concurrent requests preempt each other.
    with running(ServerOptions(metrics_port=-1, metrics_host="127.0.0.1"), num_kv_blocks=12, max_num_seqs=8) as s:
        yield s


def test_metrics_move(srv):
    port = srv.server.metrics_port
    before = scrape(port)
    assert value(before, "pagoda_kv_blocks_total") == 12
    with Client(srv.target, timeout=60) as c:
        for _ in range(3):
            c.generate("Hello", max_tokens=5, ignore_eos=True)
        list(c.generate_stream("Hello", max_tokens=5, ignore_eos=True))
        with pytest.raises(grpc.RpcError):
            c.generate("", max_tokens=5)
        c.stats()
        # Held mid-generation: blocks used and a running request show.
        with slow_steps(srv.engine, 0.02):
            stream = c.generate_stream("Hello", max_tokens=100, ignore_eos=True)
            next(stream)
            during = scrape(port)
            stream.cancel()
        assert value(during, "pagoda_kv_blocks_used") > 0 and value(during, "pagoda_num_requests_running") == 1
        assert value(during, "pagoda_inflight_generations") == 1

        async def crowd():  # 8 requests of 5 blocks each on 12 blocks: preemptions
            async with AsyncClient(srv.target, timeout=60) as ac:
                await asyncio.gather(*(ac.generate(f"request {i} " * 3, max_tokens=60, ignore_eos=True, seed=i,
                                                   temperature=1.0) for i in range(8)))
        asyncio.run(crowd())
        wait_all_blocks_free(c)
    after = scrape(port)
    assert value(after, "pagoda_requests_total", method="Generate", code="OK") - \
        value(before, "pagoda_requests_total", method="Generate", code="OK") == 3 + 8
    assert value(after, "pagoda_requests_total", method="GenerateStream", code="OK") >= 1
    assert value(after, "pagoda_requests_total", method="GenerateStream", code="CANCELLED") >= 1
    assert value(after, "pagoda_requests_total", method="Generate", code="INVALID_ARGUMENT") >= 1
    assert value(after, "pagoda_requests_total", method="GetStats", code="OK") >= 1
    for hist in ("pagoda_time_to_first_token_seconds", "pagoda_inter_token_latency_seconds",
                 "pagoda_queue_time_seconds", "pagoda_e2e_request_latency_seconds", "pagoda_prefill_time_seconds",
                 "pagoda_decode_time_seconds", "pagoda_time_per_output_token_seconds"):
        assert value(after, f"{hist}_count", door="grpc") > value(before, f"{hist}_count", door="grpc"), hist
        assert value(after, f"{hist}_bucket", door="grpc", le="+Inf") == value(after, f"{hist}_count", door="grpc")
    # a sample per message after each request's first; a message carries more than one token when the
    # consumer fell behind the engine (deltas merged), which a busy machine makes common: so at most a
    # sample per token generated, and some (it was >= 8 x 50, which failed with 302 under load)
    itl = value(after, "pagoda_inter_token_latency_seconds_count", door="grpc") - \
        value(before, "pagoda_inter_token_latency_seconds_count", door="grpc")
    assert 0 < itl <= value(after, "pagoda_completion_tokens_total") - value(before, "pagoda_completion_tokens_total")
    # a decode per finished completion: 3 + 8 Generate calls and 1 stream (the cancelled one has no end)
    assert value(after, "pagoda_decode_time_seconds_count", door="grpc") - \
        value(before, "pagoda_decode_time_seconds_count", door="grpc") == 3 + 8 + 1
    assert value(after, "pagoda_e2e_request_latency_seconds_sum", door="grpc") > \
        value(before, "pagoda_e2e_request_latency_seconds_sum", door="grpc")
    assert value(after, "pagoda_generation_tokens_total") - value(before, "pagoda_generation_tokens_total") >= 8 * 60
    assert value(after, "pagoda_completion_tokens_total") - value(before, "pagoda_completion_tokens_total") >= 8 * 60
    assert value(after, "pagoda_prompt_tokens_total") > value(before, "pagoda_prompt_tokens_total")
    assert value(after, "pagoda_preemptions_total") > 0
    assert value(after, "pagoda_kv_blocks_used") == 0 and value(after, "pagoda_kv_blocks_free") == 12
    assert value(after, "pagoda_num_requests_waiting") == 0 and value(after, "pagoda_inflight_generations") == 0


# ---- x-request-id ----

def test_x_request_id_echoed_and_used(srv):
    with Client(srv.target, timeout=60) as c:
        req = pb.GenerateRequest(text="Hello", stopping=pb.StoppingCriteria(max_tokens=2))
        resp, call = c.stub.Generate.with_call(req, metadata=(("x-request-id", "trace-abc-1"),))
        assert resp.request_id == "trace-abc-1"
        assert dict(call.initial_metadata())["x-request-id"] == "trace-abc-1"
        sreq = pb.GenerateStreamRequest(text="Hello", stopping=pb.StoppingCriteria(max_tokens=2))
        stream = c.stub.GenerateStream(sreq, metadata=(("x-request-id", "trace-abc-2"),))
        msgs = list(stream)
        assert {m.request_id for m in msgs} == {"trace-abc-2"}
        assert dict(stream.initial_metadata())["x-request-id"] == "trace-abc-2"
        # The request's own request_id wins; it is what is echoed.
        req.request_id = "field-id"
        resp, call = c.stub.Generate.with_call(req, metadata=(("x-request-id", "header-id"),))
        assert resp.request_id == "field-id" and dict(call.initial_metadata())["x-request-id"] == "field-id"
        # Neither: the server makes one up and echoes it.
        req.request_id = ""
        resp, call = c.stub.Generate.with_call(req)
        assert resp.request_id and dict(call.initial_metadata())["x-request-id"] == resp.request_id
        # Echoed on failures too (in the initial metadata sent before the error).
        with pytest.raises(grpc.RpcError) as e:
            c.stub.Generate(pb.GenerateRequest(text="Hello", stopping=pb.StoppingCriteria(max_tokens=10**9)),
                            metadata=(("x-request-id", "bad-one"),))
        assert e.value.code() == C.INVALID_ARGUMENT
        assert dict(e.value.initial_metadata())["x-request-id"] == "bad-one"
        with pytest.raises(grpc.RpcError) as e:
            c.stub.Generate(req, metadata=(("x-request-id", "x" * 300),))
        assert e.value.code() == C.INVALID_ARGUMENT and e.value.details().startswith("x-request-id")


# ---- the structured request log ----

def request_lines(caplog) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "pagoda.requests"]


def test_one_structured_log_line_per_finished_request(srv, caplog):
    caplog.set_level(logging.INFO, logger="pagoda.requests")
    with Client(srv.target, timeout=60) as c:
        c.generate("Hello", max_tokens=4, ignore_eos=True, metadata=(("x-request-id", "log-ok"),))
        list(c.generate_stream("Hello", max_tokens=3, ignore_eos=True, request_id="log-stream"))
        with pytest.raises(grpc.RpcError):
            c.generate("Hello", max_tokens=10**9, metadata=(("x-request-id", "log-bad"),))
        with slow_steps(srv.engine, 0.02):
            stream = c.generate_stream("Hello", max_tokens=100, ignore_eos=True, request_id="log-cancel")
            next(stream)
            stream.cancel()
        wait_all_blocks_free(c)
        c.stats()  # not a generation: no line
    expected = {"log-ok", "log-stream", "log-bad", "log-cancel"}
    deadline = time.monotonic() + 5
    while not expected <= {line["request_id"] for line in request_lines(caplog)} and time.monotonic() < deadline:
        time.sleep(0.02)
    mine = [line for line in request_lines(caplog) if line["request_id"] in expected]
    lines = {line["request_id"]: line for line in mine}
    assert len(mine) == 4 and set(lines) == expected, mine  # one line each
    ok = lines["log-ok"]
    assert (ok["method"], ok["status"], ok["completion_tokens"]) == ("Generate", "OK", 4)
    assert ok["prompt_tokens"] == len(Client(srv.target).tokenize("Hello")) and ok["cached_tokens"] >= 0
    assert 0 <= ok["queue_s"] <= ok["ttft_s"] <= ok["e2e_s"] and ok["finish_reasons"] == ["length"]
    assert set(ok) >= {"request_id", "method", "status", "prompt_tokens", "completion_tokens", "cached_tokens",
                       "queue_s", "ttft_s", "e2e_s"}
    assert (lines["log-stream"]["method"], lines["log-stream"]["completion_tokens"]) == ("GenerateStream", 3)
    assert lines["log-bad"]["status"] == "INVALID_ARGUMENT" and lines["log-bad"]["ttft_s"] is None
    assert lines["log-cancel"]["status"] == "CANCELLED" and lines["log-cancel"]["completion_tokens"] >= 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_port_flag_and_json_logs():
    port = _free_port()
    proc = ServeProcess("--model", tiny_checkpoint(), "--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "32",
                        "--metrics-port", str(port), "--metrics-host", "127.0.0.1",
                        env={"PAGODA_LOG_FORMAT": "json"})
    try:
        proc.wait_ready()
        with Client(proc.target, timeout=60) as c:
            c.generate("Hello", max_tokens=3, ignore_eos=True, metadata=(("x-request-id", "json-log-1"),))
        samples = scrape(port)
        assert value(samples, "pagoda_requests_total", method="Generate", code="OK") == 1
        assert value(samples, "pagoda_kv_blocks_total") == 32
        deadline = time.monotonic() + 5
        while "json-log-1" not in proc.output() and time.monotonic() < deadline:
            time.sleep(0.02)
        records = [json.loads(line) for line in proc.output().splitlines() if line.startswith("{")]
        assert records and all({"ts", "level", "logger"} <= set(r) for r in records)
        line = next(r for r in records if r.get("request_id") == "json-log-1")
        assert line["logger"] == "pagoda.requests" and line["status"] == "OK" and line["completion_tokens"] == 3
    finally:
        proc.kill()

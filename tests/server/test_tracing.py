"""OpenTelemetry traces (server/tracing.py): every kind of generation call, on both doors, gives the
expected span tree under the caller's traceparent, its phases add up to the call's wall time, and no
span is left open; with OTEL_* set, a real OTLP/HTTP exporter sends the same spans to a receiver
here (which decodes the protobuf it gets); with them unset, tracing is off."""
import contextlib
import http.server
import secrets
import threading
import time

import grpc
import pytest
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from grpc_fixtures import InProcessServer, openai_client, slow_steps, tiny_checkpoint, wait_all_blocks_free
from pagoda.client.client import Client, build_request
from pagoda.engine import EngineConfig
from pagoda.server import tracing
from pagoda.server.options import ServerOptions
from pagoda.server.tracing import Tracing
from pagoda.v1 import generation_pb2_grpc as pb_grpc

GEN, STREAM = "pagoda.v1.GenerationService/Generate", "pagoda.v1.GenerationService/GenerateStream"
PHASES = ["queue", "prefill", "decode"]


class OpenSpans(SpanProcessor):
    """Counts spans started and not ended."""

    def __init__(self):
        self.open = 0
        self.lock = threading.Lock()

    def on_start(self, span, parent_context=None):
        with self.lock:
            self.open += 1

    def on_end(self, span):
        with self.lock:
            self.open -= 1


@pytest.fixture(scope="module")
def traced():
    exporter, opened = InMemorySpanExporter(), OpenSpans()
    provider = TracerProvider()
    provider.add_span_processor(opened)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    srv = InProcessServer.for_config(EngineConfig(dtype="float32", model=tiny_checkpoint(), num_kv_blocks=64),
                                     ServerOptions(http_port=0)).wait_ready()
    assert srv.server.state.tracing is None  # no OTEL_* set: off
    srv.server.state.tracing = Tracing(provider)
    srv.exporter, srv.opened = exporter, opened
    yield srv
    srv.stop()


def caller():
    """A caller's trace context: (traceparent, trace id, span id)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", int(trace_id, 16), int(span_id, 16)


def trace(srv, trace_id: int, span_id: int):
    """The call span of the caller's trace (its parent the caller's span) and {span: children}. The
    server ends a call's spans just after the client has its answer: they are waited for."""
    deadline = time.monotonic() + 10
    while True:
        spans = [s for s in srv.exporter.get_finished_spans() if s.context.trace_id == trace_id]
        roots = [s for s in spans if s.parent is not None and s.parent.span_id == span_id]
        if roots or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert len(roots) == 1, [s.name for s in spans]
    children = {s.context.span_id: [] for s in spans}
    for s in spans:
        if s.parent is not None and s.parent.span_id in children:
            children[s.parent.span_id].append(s)
    assert srv.opened.open == 0  # no span left open
    return roots[0], lambda s: sorted(children[s.context.span_id], key=lambda c: (c.start_time, c.name))


def shape(root, kids) -> list:
    """The tree as names: [name, [children...]] for spans with children."""
    return [c.name if not kids(c) else [c.name, shape(c, kids)] for c in kids(root)]


def seconds(span) -> float:
    return (span.end_time - span.start_time) / 1e9


def check_call(srv, ids, name: str, sequences: int, status: str = "OK", phases=PHASES, stream_end=True):
    root, kids = trace(srv, *ids[1:])
    assert root.name == name and root.attributes["pagoda.status"] == status
    want = ["validate", *[["sequence", phases]] * sequences] + (["stream_end"] if stream_end else [])
    got = shape(root, kids)
    assert got[0] in ("validate", ["validate", ["grammar_compile"] * sequences]) and sorted(map(str, got[1:])) == sorted(map(str, want[1:])), got
    for seq in [c for c in kids(root) if c.name == "sequence"]:
        assert seq.start_time >= root.start_time and seq.end_time <= root.end_time
        # the phases of one completion tile its span
        assert sum(seconds(p) for p in kids(seq)) == pytest.approx(seconds(seq), abs=1e-3)
    return root, kids


def check_adds_up(root, kids) -> None:
    """A one-completion call: validate + queue + prefill + decode + stream_end is the call's wall time."""
    parts = {c.name: c for c in kids(root)}
    total = seconds(parts["validate"]) + sum(seconds(p) for p in kids(parts["sequence"])) + seconds(parts["stream_end"])
    assert total == pytest.approx(seconds(root), rel=0.05, abs=0.005)


def test_grpc_unary_and_stream(traced):
    ids = caller()
    with Client(traced.target, timeout=60) as c:
        c.generate("Hello", max_tokens=8, ignore_eos=True, metadata=(("traceparent", ids[0]),))
    root, kids = check_call(traced, ids, GEN, 1)
    check_adds_up(root, kids)
    a = root.attributes
    assert a["pagoda.door"] == "grpc" and a["pagoda.completion_tokens"] == 8 and a["pagoda.prompt_tokens"] > 0
    assert a["pagoda.finish_reasons"] == ("length",) and a["pagoda.n"] == 1 and a["pagoda.request_id"]
    seq = next(c for c in kids(root) if c.name == "sequence")
    prefill, decode = kids(seq)[1:]
    assert [e.name for e in prefill.events] == ["prefill_chunk"] and prefill.events[0].attributes["pagoda.tokens"] > 0
    assert [e.name for e in decode.events] == ["first_token"]

    ids = caller()
    with Client(traced.target, timeout=60) as c:
        list(c.generate_stream("Hello", max_tokens=8, ignore_eos=True, metadata=(("traceparent", ids[0]),)))
    check_adds_up(*check_call(traced, ids, STREAM, 1))


def test_http_completion_stream_and_chat(traced):
    oai = openai_client(traced)
    ids = caller()
    oai.completions.create(model=None, prompt="Hello", max_tokens=6, extra_headers={"traceparent": ids[0]})
    root, kids = check_call(traced, ids, "POST /v1/completions", 1)
    check_adds_up(root, kids)
    assert root.attributes["pagoda.door"] == "http"
    ids = caller()
    list(oai.completions.create(model=None, prompt="Hello", max_tokens=6, stream=True,
                                extra_headers={"traceparent": ids[0]}))
    check_call(traced, ids, "POST /v1/completions", 1)
    ids = caller()
    oai.chat.completions.create(model=None, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                extra_headers={"traceparent": ids[0]})
    check_call(traced, ids, "POST /v1/chat/completions", 1)
    # the phase histograms, from the same stamps, by door
    registry = traced.server.metrics.registry
    for name in ("queue_time", "prefill_time", "decode_time", "time_per_output_token"):
        assert registry.get_sample_value(f"pagoda_{name}_seconds_count", {"door": "http"}) >= 3, name


def test_several_prompts_n_and_structured(traced):
    ids = caller()
    with Client(traced.target, timeout=60) as c:
        c.generate(prompts=["one", "two", "three"], max_tokens=4, n=2, seed=1, metadata=(("traceparent", ids[0]),))
    root, kids = check_call(traced, ids, GEN, 6)
    assert root.attributes["pagoda.num_prompts"] == 3 and root.attributes["pagoda.n"] == 2
    seqs = [c for c in kids(root) if c.name == "sequence"]
    assert sorted((s.attributes["pagoda.prompt_index"], s.attributes["pagoda.index"]) for s in seqs) == \
        [(i, j) for i in range(3) for j in range(2)]
    ids = caller()
    with Client(traced.target, timeout=60) as c:
        c.generate("Pick", choice=["yes", "no"], max_tokens=8, metadata=(("traceparent", ids[0]),))
    root, kids = trace(traced, *ids[1:])
    assert shape(root, kids) == [["validate", ["grammar_compile"]], ["sequence", PHASES], "stream_end"]
    assert root.attributes["pagoda.finish_reasons"] in (("grammar",), ("length",))


def test_refused_cancelled_and_timed_out(traced):
    ids = caller()
    with Client(traced.target, timeout=60) as c, pytest.raises(grpc.RpcError):
        c.generate("Hello", temperature=-1, metadata=(("traceparent", ids[0]),))
    root, kids = trace(traced, *ids[1:])
    assert shape(root, kids) == ["validate"] and root.attributes["pagoda.status"] == "INVALID_ARGUMENT"
    assert root.status.status_code.name == "ERROR"

    ids = caller()  # cancelled mid-decode: the open phases end with the call
    with Client(traced.target, timeout=60) as c, slow_steps(traced.engine, 0.02):
        stream = c.generate_stream("Hello", max_tokens=200, ignore_eos=True, metadata=(("traceparent", ids[0]),))
        next(stream)
        next(stream)
        stream.cancel()
        wait_all_blocks_free(c)
    root, kids = check_call(traced, ids, STREAM, 1, status="CANCELLED")
    seq = next(c for c in kids(root) if c.name == "sequence")
    assert "pagoda.finish_reason" not in seq.attributes

    ids = caller()  # the call's deadline
    with Client(traced.target, timeout=60) as c, slow_steps(traced.engine, 0.02):
        with pytest.raises(grpc.RpcError) as e:
            c.generate("Hello", max_tokens=200, ignore_eos=True, timeout=0.5, metadata=(("traceparent", ids[0]),))
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_all_blocks_free(c)
    root, kids = trace(traced, *ids[1:])
    assert root.attributes["pagoda.status"] == "DEADLINE_EXCEEDED"

    ids = caller()  # a time limit: the call succeeds, its completion says why it ended
    with Client(traced.target, timeout=60) as c, slow_steps(traced.engine, 0.02):
        c.generate("Hello", max_tokens=200, ignore_eos=True, time_limit_ms=500, metadata=(("traceparent", ids[0]),))
    root, kids = check_call(traced, ids, GEN, 1)
    assert root.attributes["pagoda.finish_reasons"] == ("time_limit",)


def test_without_a_traceparent_the_call_starts_a_trace(traced):
    before = len(traced.exporter.get_finished_spans())
    with Client(traced.target, timeout=60) as c:
        c.generate("Hello", max_tokens=2)
    new = traced.exporter.get_finished_spans()[before:]
    root = next(s for s in new if s.name == GEN)
    assert root.parent is None and all(s.context.trace_id == root.context.trace_id for s in new)


# ---- the OTLP/HTTP exporter, configured by the environment ----

class Receiver(http.server.ThreadingHTTPServer):
    """An OTLP/HTTP traces endpoint: keeps the spans of each ExportTraceServiceRequest it is sent."""

    def __init__(self):
        self.spans, self.services = [], set()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(h):
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                                      ExportTraceServiceResponse)
                body = h.rfile.read(int(h.headers["Content-Length"]))
                assert h.path == "/v1/traces" and h.headers["Content-Type"] == "application/x-protobuf"
                req = ExportTraceServiceRequest.FromString(body)
                for rs in req.resource_spans:
                    self.services |= {a.value.string_value for a in rs.resource.attributes if a.key == "service.name"}
                    self.spans += [s for ss in rs.scope_spans for s in ss.spans]
                out = ExportTraceServiceResponse().SerializeToString()
                h.send_response(200)
                h.send_header("Content-Type", "application/x-protobuf")
                h.send_header("Content-Length", str(len(out)))
                h.end_headers()
                h.wfile.write(out)

            def log_message(h, *a):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


@contextlib.contextmanager
def receiver():
    r = Receiver()
    try:
        yield r
    finally:
        r.shutdown()
        r.server_close()


def test_otlp_http_exporter_from_the_environment(monkeypatch):
    with receiver() as r:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{r.server_port}")
        monkeypatch.setenv("OTEL_SERVICE_NAME", "pagoda-test")
        srv = InProcessServer.for_config(EngineConfig(dtype="float32", model=tiny_checkpoint(), num_kv_blocks=64),
                                         ServerOptions(http_port=0)).wait_ready()
        ids = caller()
        try:
            assert srv.server.state.tracing is not None
            with grpc.insecure_channel(srv.target) as ch:
                pb_grpc.GenerationServiceStub(ch).Generate(build_request("Hello", max_tokens=4),
                                                           metadata=(("traceparent", ids[0]),))
            openai_client(srv).completions.create(model=None, prompt="Hi", max_tokens=3,
                                                  extra_headers={"traceparent": ids[0]})
        finally:
            srv.stop()  # exports what is batched
        assert r.services == {"pagoda-test"}
        mine = [s for s in r.spans if s.trace_id == ids[1].to_bytes(16, "big")]
        names = sorted(s.name for s in mine)
        assert names == sorted(["POST /v1/completions", GEN] + ["validate", "sequence", "queue", "prefill",
                                                                 "decode", "stream_end"] * 2)
        roots = [s for s in mine if s.parent_span_id == ids[2].to_bytes(8, "big")]
        assert sorted(s.name for s in roots) == sorted(["POST /v1/completions", GEN])


def test_tracing_is_off_unless_the_environment_asks():
    assert tracing.from_env({}) is None
    assert tracing.from_env({"OTEL_SERVICE_NAME": "x"}) is None
    assert tracing.from_env({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x"}) is None
    assert tracing.from_env({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "console"}) is None
    t = tracing.from_env({"OTEL_TRACES_EXPORTER": "console"})
    assert t is not None
    t.shutdown()
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER"):
        tracing.from_env({"OTEL_TRACES_EXPORTER": "zipkin"})

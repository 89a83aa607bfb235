"""OpenTelemetry traces of generation calls, on either door.

A call's spans are built when it ends, from the time.monotonic() stamps the handlers took (server/
metrics.py RequestRecord) and those the engine core reported in each completion's last output
(engine/outputs.py RequestMetrics): nothing in the engine loop, which may run in another process,
knows about tracing, and a server with tracing off does no tracing work at all.

    <call>           pagoda.v1.GenerationService/Generate(Stream), or POST /v1/completions ...
      validate       the request checked, its prompt rendered and tokenized, admitted
        grammar_compile  a structured output's grammar compiled (one per prompt)
      sequence       one per completion (prompts x n): arrival in the engine -> finished
        queue        waiting to be scheduled
        prefill      the prompt computed; an event per chunk (and per preemption before the first token)
        decode       first token -> finished; events: first_token, preemption (recomputed later)
      stream_end     the last completion finished -> the call's answer written

Configured only by the standard environment variables, read when the server starts (from_env):
OTEL_TRACES_EXPORTER (otlp, console or none), OTEL_EXPORTER_OTLP_ENDPOINT / _TRACES_ENDPOINT (OTLP over
HTTP/protobuf), OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER(_ARG), OTEL_BSP_*.
Off unless one of OTEL_TRACES_EXPORTER (not none) or an OTLP endpoint is set, or OTEL_SDK_DISABLED=true.
A caller's W3C traceparent (an HTTP header, or gRPC metadata) makes the call span its child.
"""
from __future__ import annotations

import logging
import time

log = logging.getLogger("pagoda.server")

SERVICE = "pagoda.v1.GenerationService"


def from_env(environ) -> Tracing | None:
    """Tracing as the OTEL_* variables in `environ` ask for it, or None (off)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if exporter == "none" or not (exporter or endpoint):
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    if exporter in ("", "otlp"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        span_exporter = OTLPSpanExporter()  # the endpoint, headers, timeout: from OTEL_EXPORTER_OTLP_*
    elif exporter == "console":
        span_exporter = ConsoleSpanExporter()
    else:
        raise ValueError(f"OTEL_TRACES_EXPORTER must be otlp, console or none, got {exporter!r}")
    # Resource.create() reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES; the sampler comes from
    # OTEL_TRACES_SAMPLER, the batching from OTEL_BSP_*
    resource = Resource.create({"service.name": environ.get("OTEL_SERVICE_NAME") or "pagoda"})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(span_exporter))
    log.info("tracing on: %s exporter%s", exporter or "otlp", f" to {endpoint}" if endpoint else "")
    return Tracing(provider)


class Tracing:
    """Builds a finished call's spans on `provider` (an SDK TracerProvider; tests give one with an
    in-memory exporter)."""

    def __init__(self, provider):
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer = provider.get_tracer("pagoda")
        self.propagator = TraceContextTextMapPropagator()

    def shutdown(self) -> None:
        """Exports what is left (the batch processor's queue)."""
        self.provider.shutdown()

    def parent(self, headers) -> object:
        """The caller's trace context from (name, value) pairs or a mapping (traceparent, tracestate)."""
        items = headers.items() if hasattr(headers, "items") else headers
        carrier = {k.lower(): v for k, v in items if isinstance(v, str) and k.lower() in ("traceparent", "tracestate")}
        return self.propagator.extract(carrier) if carrier else None

    def record_call(self, record, code: str) -> None:
        """The spans of a finished call (server/metrics.py RequestRecord), ended at record.t_end."""
        from opentelemetry.trace import SpanKind, Status, StatusCode

        ns = _clock(record)
        name = record.method if record.door == "http" else f"{SERVICE}/{record.method}"
        call = self.tracer.start_span(name, context=record.trace_parent, kind=SpanKind.SERVER,
                                      start_time=ns(record.t0), attributes=_call_attributes(record, code))
        if code != "OK":
            call.set_status(Status(StatusCode.ERROR, code))
        from opentelemetry.trace import set_span_in_context

        ctx = set_span_in_context(call)
        # validation ends where the engine stamped its sequences' arrival (the front-end's own stamp of the
        # hand-over can trail it by a scheduling delay on a busy machine: the spans would overlap)
        arrivals = [out.metrics.arrival_time for out in record.lasts.values()]
        t_admitted = min(arrivals) if arrivals else record.t_engine if record.t_engine is not None else record.t_end
        validate = self._span("validate", ctx, ns(record.t0), ns(t_admitted))
        for start, stop in record.grammar_compiles:
            self._span("grammar_compile", set_span_in_context(validate), ns(start), ns(stop))
        ends = [self._sequence(ctx, ns, i, out, record.t_end) for (i, _), out in sorted(record.lasts.items())]
        if ends:
            self._span("stream_end", ctx, ns(max(ends)), ns(record.t_end))
        call.end(end_time=ns(record.t_end))

    def _sequence(self, ctx, ns, i: int, out, t_end: float) -> float:
        """A completion's spans from its latest output's stamps; returns when it finished (or the call
        ended, for one that did not finish: cancelled, timed out)."""
        from opentelemetry.trace import set_span_in_context

        m = out.metrics
        end = m.finished_time if m.finished_time is not None else t_end
        attrs = {"pagoda.prompt_index": i, "pagoda.index": out.index, "pagoda.prompt_tokens": out.num_prompt_tokens,
                 "pagoda.cached_tokens": out.num_cached_tokens, "pagoda.completion_tokens": out.num_generated_tokens}
        if out.finished:
            attrs["pagoda.finish_reason"] = out.stop_reason or ""
        seq = self.tracer.start_span("sequence", ctx, start_time=ns(m.arrival_time), attributes=attrs)
        sctx = set_span_in_context(seq)
        scheduled, first = m.first_scheduled_time, m.first_token_time
        self._span("queue", sctx, ns(m.arrival_time), ns(scheduled if scheduled is not None else end))
        if scheduled is not None:
            prefill = self._span("prefill", sctx, ns(scheduled), ns(first if first is not None else end), end=False)
            for start, stop, tokens in m.prefill_chunks:
                prefill.add_event("prefill_chunk", {"pagoda.tokens": tokens, "pagoda.seconds": stop - start},
                                  timestamp=ns(stop))
            for t in m.preemption_times:
                if first is None or t < first:
                    prefill.add_event("preemption", timestamp=ns(t))
            prefill.end(end_time=ns(first if first is not None else end))
        if first is not None:
            decode = self.tracer.start_span("decode", sctx, start_time=ns(first))
            decode.add_event("first_token", timestamp=ns(first))
            for t in m.preemption_times:
                if t >= first:
                    decode.add_event("preemption", timestamp=ns(t))
            decode.end(end_time=ns(end))
        seq.end(end_time=ns(end))
        return end

    def _span(self, name: str, ctx, start: int, stop: int, end: bool = True):
        span = self.tracer.start_span(name, ctx, start_time=start)
        if end:
            span.end(end_time=max(start, stop))
        return span


def _clock(record):
    """time.monotonic() seconds -> the epoch nanoseconds OpenTelemetry wants (one offset per call)."""
    offset = time.time_ns() - time.monotonic_ns()
    return lambda t: int(t * 1e9) + offset


def _call_attributes(record, code: str) -> dict:
    lasts = record.lasts.values()
    reasons = [o.stop_reason or "" for o in lasts if o.finished]
    return {"pagoda.request_id": record.request_id, "pagoda.door": record.door, "pagoda.status": code,
            "pagoda.model": record.model, "pagoda.n": record.n, "pagoda.num_prompts": record.num_prompts,
            "pagoda.prompt_tokens": sum(o.num_prompt_tokens for o in lasts if o.index == 0),
            "pagoda.cached_tokens": sum(o.num_cached_tokens for o in lasts if o.index == 0),
            "pagoda.completion_tokens": sum(o.num_generated_tokens for o in lasts),
            "pagoda.finish_reasons": reasons}

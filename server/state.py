"""What both doors (gRPC, server/servicer.py; HTTP, server/openai/) share: the server's phase, the
admission of a call, the one map from exceptions to a status (a gRPC code; its HTTP status), and
the engine's figures under the names both report them by (GetStats, GET /stats)."""
from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from pagoda.engine.errors import (AdapterNotFoundError, DuplicateRequestError, EngineClosedError, EngineError,
                                  InvalidRequestError, QueueFullError)
from pagoda.server.options import ServerOptions

log = logging.getLogger("pagoda.server")

LOADING, SERVING, DRAINING = "loading", "serving", "draining"
RETRY_HINT = "retry after a short backoff"

HTTP_STATUS = {
    grpc.StatusCode.OK: 200, grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.ALREADY_EXISTS: 409, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499, grpc.StatusCode.INTERNAL: 500, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


class ServerError(Exception):
    """A status the server decided on (code, message); `reason`: a machine-readable word for it, where
    a protocol has one (OpenAI's error code, e.g. "model_not_found")."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason


def status_for(e: Exception) -> tuple[grpc.StatusCode, str]:
    """The one place exceptions become (status code, message); HTTP_STATUS gives the HTTP status."""
    if isinstance(e, ServerError):
        return e.code, e.message
    if isinstance(e, AdapterNotFoundError):
        return grpc.StatusCode.NOT_FOUND, str(e)
    if isinstance(e, DuplicateRequestError):
        return grpc.StatusCode.ALREADY_EXISTS, str(e)
    if isinstance(e, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    if isinstance(e, QueueFullError):
        msg = str(e) or "the waiting queue is full"
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"{msg.removesuffix('; retry later')}; {RETRY_HINT}"
    if isinstance(e, EngineClosedError):
        return grpc.StatusCode.UNAVAILABLE, str(e) or "the engine is shut down"
    if isinstance(e, EngineError):
        log.error("engine error: %s", e)
        return grpc.StatusCode.INTERNAL, f"engine error: {e}"
    log.error("unexpected error", exc_info=e)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"


def stats_dict(s) -> dict:
    """An EngineStats under GetStatsResponse's field names (GET /stats answers the same)."""
    return {"num_running": s.num_running, "num_waiting": s.num_waiting, "kv_blocks_total": s.num_total_blocks,
            "kv_blocks_free": s.num_free_blocks, "kv_blocks_used": s.num_used_blocks,
            "prompt_tokens_processed": s.num_prompt_tokens_processed, "generated_tokens": s.num_generated_tokens,
            "num_preemptions": s.num_preemptions, "uptime_seconds": s.uptime_s,
            "kv_blocks_cached": s.num_cached_blocks, "cached_prompt_tokens": s.num_cached_prompt_tokens,
            "prefix_cache_hit_rate": s.prefix_cache_hit_rate, "queue_wait_estimate_seconds": s.queue_wait_s(),
            "step_seconds": s.step_s, "finished_per_second": s.finished_per_s,
            "spec_proposed_tokens": s.spec_proposed_tokens,
            "spec_accepted_tokens": s.spec_accepted_tokens, "spec_mean_accepted_length": s.spec_mean_accepted_length,
            "adapter_requests": dict(s.adapter_requests), "adapter_generated_tokens": dict(s.adapter_tokens),
            "pooling_requests": s.num_pooling_requests, "pooling_tokens": s.num_pooling_tokens,
            "kv_groups": [vars(g) for g in s.kv_groups],
            "state_slots_total": s.num_state_slots, "state_slots_used": s.num_used_state_slots,
            "expert_load": [{"layer": layer, "tokens": tokens}
                            for layer, tokens in (s.expert_load.per_layer() if s.expert_load is not None else ())]}


class ServerState:
    """What the handlers share with server startup/shutdown: the engine once loaded, the phase, the
    calls in flight (draining waits for them), the options and limits, the metrics."""

    def __init__(self, options: ServerOptions | None = None, metrics=None):
        self.engine = None
        self.phase = LOADING
        self.inflight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.num_generations = 0  # generation calls in flight, both doors
        self.options = options or ServerOptions()
        self.limits = self.options.request_limits()
        self.metrics = metrics  # server.metrics.Metrics, or None
        self.tracing = None  # server.tracing.Tracing when the OTEL_* environment turns it on

    def served_model_names(self) -> list[str]:
        """The names requests may give the model (--served-model-name), the first one reported;
        by default the model as it was named at start (the demo: DEMO_MODEL_NAME)."""
        if self.options.served_model_names:
            return list(self.options.served_model_names)
        return [self.engine.model_info.model_id] if self.engine is not None else []

    def check_lora_loading(self) -> None:
        """Loading and unloading LoRA adapters at run time is a privilege: PERMISSION_DENIED without the flag."""
        if not (self.engine is not None and self.engine.config.allow_lora_loading):
            raise ServerError(grpc.StatusCode.PERMISSION_DENIED, "loading and unloading LoRA adapters at run time is "
                                                                 "off; start the server with --allow-lora-loading")

    def check_call_size(self, num_requests: int, field: str) -> None:
        """A call of more requests than the waiting queue can ever hold is refused outright (a 429
        would tell the client to retry what can never succeed)."""
        most = self.engine.model_info.max_queue_len
        if num_requests > most:
            raise InvalidRequestError(field, f"holds {num_requests} prompts; this server queues at most {most} "
                                             f"requests (--max-queue-len): send them in several calls")

    @contextlib.contextmanager
    def admit(self, generation: bool):
        """Admits a call: ServerError UNAVAILABLE unless serving, RESOURCE_EXHAUSTED past
        --max-concurrent-streams for a generation; yields the engine; counts the call while it runs."""
        if self.phase != SERVING or self.engine is None:
            why = "loading the model" if self.phase == LOADING else "shutting down"
            raise ServerError(grpc.StatusCode.UNAVAILABLE, f"server is {why}; retry later")
        if generation:
            limit = self.options.max_concurrent_streams
            if self.num_generations >= limit:
                raise ServerError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"too many generation calls in flight (this server's limit is {limit}, "
                                  f"--max-concurrent-streams); {RETRY_HINT}")
        self.inflight += 1
        self.idle.clear()
        self.num_generations += generation
        if generation and self.metrics is not None:
            self.metrics.inflight.inc()
        try:
            yield self.engine
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self.idle.set()
            self.num_generations -= generation
            if generation and self.metrics is not None:
                self.metrics.inflight.dec()

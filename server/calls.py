"""A generation call as both doors run it (gRPC: server/servicer.py; HTTP: server/http/serving.py):
its requests opened in the engine, the one --request-timeout, and their outputs as they come."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc

from pagoda.engine.frontend.async_engine import merge_streams
from pagoda.engine.outputs import RequestOutput
from pagoda.server.state import ServerError, ServerState


def open_requests(state: ServerState, engine, reqs: list, record, stack,
                  call_id: str) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Opens every request's stream (a refusal, such as a full queue, raises here) and starts the time
    limit; returns (request index, delta) pairs as they come, each booked in the call's record.
    `stack` (an AsyncExitStack) closes it all, aborting every request that has not finished."""
    streams = []
    for r in reqs:
        streams.append(engine.open(r))
        stack.push_async_callback(streams[-1].aclose)
    record.submitted(reqs)
    _time_limit(state, engine, reqs, record.t0, stack, call_id)
    merged = merge_streams(streams)
    stack.push_async_callback(merged.aclose)
    booked = _booked(merged, record)
    stack.push_async_callback(booked.aclose)
    return booked


async def _booked(outputs, record):
    async for i, out in outputs:
        record.output(out, i)
        yield i, out


def _time_limit(state: ServerState, engine, reqs: list, t0: float, stack, call_id: str) -> None:
    """--request-timeout: a timer, not a wait per output. It aborts the call's requests, and their
    streams raise DEADLINE_EXCEEDED at once (a wedged step included): no aborted choice reaches a
    door as if it had finished."""
    timeout = state.options.request_timeout
    if timeout <= 0:
        return
    error = ServerError(grpc.StatusCode.DEADLINE_EXCEEDED, f"request {call_id!r} ran past this server's time limit "
                                                           f"of {timeout:g}s (--request-timeout) and was aborted")

    def expire():
        for r in reqs:
            engine.abort(r.request_id, error)

    loop = asyncio.get_running_loop()
    timer = loop.call_at(loop.time() + max(0.0, t0 + timeout - time.monotonic()), expire)
    stack.callback(timer.cancel)

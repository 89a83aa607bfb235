"""pagoda.v1.GenerationService: thin grpc.aio handlers over engine.AsyncEngine.

Each handler: refuse while not serving, validate and convert (server/convert.py), hand the request
to the engine's asyncio front, convert back. Exceptions become status codes in one place
(status_for, applied by _call).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from pagoda.v1 import generation_pb2 as pb
from pagoda.v1 import generation_pb2_grpc as pb_grpc
from server import convert

log = logging.getLogger("pagoda.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name  # "pagoda.v1.GenerationService"

LOADING, SERVING, DRAINING = "loading", "serving", "draining"


class ServerState:
    """What the handlers share with server startup/shutdown: the engine once loaded, the phase, and
    the calls in flight (draining waits for them)."""

    def __init__(self):
        self.engine = None
        self.phase = LOADING
        self.inflight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.request_ids: set[str] = set()  # generation requests in flight

    def enter(self):
        self.inflight += 1
        self.idle.clear()

    def leave(self):
        self.inflight -= 1
        if self.inflight == 0:
            self.idle.set()


def status_for(e: Exception) -> tuple[grpc.StatusCode, str]:
    """The one place exceptions become (status code, message). The engine module is imported here,
    not at module level, so the server can listen before torch is loaded."""
    from engine.errors import EngineClosedError, EngineError, InvalidRequestError, QueueFullError

    if isinstance(e, convert.RequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    if isinstance(e, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, convert.engine_error_message(e.field, e.message)
    if isinstance(e, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(e) or "the waiting queue is full; retry later"
    if isinstance(e, EngineClosedError):
        return grpc.StatusCode.UNAVAILABLE, str(e) or "the engine is shut down"
    if isinstance(e, EngineError):
        log.error("engine error: %s", e)
        return grpc.StatusCode.INTERNAL, f"engine error: {e}"
    log.error("unexpected error", exc_info=e)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(self, state: ServerState):
        self.state = state

    @contextlib.asynccontextmanager
    async def _call(self, context: grpc.aio.ServicerContext):
        """Admits a call (UNAVAILABLE unless serving), yields the engine, and maps exceptions to
        status codes. context.abort raises, which ends the handler."""
        state = self.state
        if state.phase != SERVING or state.engine is None:
            why = "loading the model" if state.phase == LOADING else "shutting down"
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"server is {why}; retry later")
        state.enter()
        try:
            yield state.engine
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            await context.abort(*status_for(e))
        finally:
            state.leave()

    async def _generate(self, engine, request, context):
        """Yields (request_id, engine delta) until the request finishes. Leaving early (client cancel,
        deadline, error) aborts the request in the engine so its KV blocks are freed."""
        req = convert.to_engine_request(request, engine)
        if req.request_id in self.state.request_ids:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"request_id {req.request_id!r} is already used by a request in flight")
        self.state.request_ids.add(req.request_id)
        unfinished = req.params.n
        outputs = engine.generate(req.prompt, req.params, request_id=req.request_id, priority=req.priority)
        try:
            async for out in outputs:
                if out.finish_reason == "error":
                    from engine.errors import EngineError

                    raise EngineError(out.error or "the engine step running this request failed")
                unfinished -= out.finished
                yield req.request_id, out
        finally:
            self.state.request_ids.discard(req.request_id)
            if unfinished:
                engine.abort(req.request_id)
            aclose = getattr(outputs, "aclose", None)
            if aclose is not None:
                await aclose()

    async def Generate(self, request, context):
        async with self._call(context) as engine:
            choices: dict[int, list] = {}  # index -> [texts, token ids, logprobs, last output]
            rid = request.request_id
            async with contextlib.aclosing(self._generate(engine, request, context)) as outputs:
                async for rid, out in outputs:
                    c = choices.setdefault(out.index, [[], [], [], None])
                    c[0].append(out.text)
                    c[1].extend(out.token_ids)
                    c[2].extend(convert.logprobs(out.logprobs))
                    c[3] = out
            if not choices or not all(c[3].finished for c in choices.values()):
                raise RuntimeError("the engine ended the request without a final output")
            done = [pb.Choice(index=i, text="".join(c[0]), token_ids=c[1], finish_reason=convert.finish_reason(c[3]),
                              logprobs=c[2]) for i, c in sorted(choices.items())]
            first = choices[min(choices)][3]
            usage = convert.usage(first)
            usage.completion_tokens = sum(c[3].num_generated_tokens for c in choices.values())
            return pb.GenerateResponse(request_id=rid, text=done[0].text, token_ids=done[0].token_ids,
                                       finish_reason=done[0].finish_reason, usage=usage,
                                       logprobs=done[0].logprobs, choices=done)

    async def GenerateStream(self, request, context):
        async with self._call(context) as engine:
            async with contextlib.aclosing(self._generate(engine, request, context)) as outputs:
                async for rid, out in outputs:
                    if out.token_ids or out.text or out.finished:
                        yield convert.stream_response(rid, out)

    async def Tokenize(self, request, context):
        async with self._call(context) as engine:
            if not request.text:
                raise convert.RequestError("text", "must not be empty")
            return pb.TokenizeResponse(token_ids=engine.encode(request.text))

    async def GetModelInfo(self, request, context):
        async with self._call(context) as engine:
            return convert.model_info(engine.model_info)

    async def GetStats(self, request, context):
        async with self._call(context) as engine:
            return convert.stats(engine.stats())

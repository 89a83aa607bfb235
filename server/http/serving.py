"""The serving skeleton every generation endpoint shares: admit the call, make its requests (in a
thread when that takes a while), open them with the time limit (server/calls.py, as gRPC does),
then answer whole (whole outputs; the client leaving aborts) or as an event stream (deltas), every
error through the one status map. An endpoint gives only its requests and its answer's shapes."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from dataclasses import dataclass

import grpc
import orjson
from fastapi import Request
from fastapi.responses import Response

from pagoda.engine.frontend.async_engine import whole_outputs
from pagoda.engine.errors import InvalidRequestError
from pagoda.engine.validation import new_request_id
from pagoda.server.chat.answer import AnswerReader
from pagoda.server.calls import open_requests
from pagoda.server.http import dialects
from pagoda.server.openai.logprobs import Logprobs
from pagoda.server.openai.protocol import renamed, structured
from pagoda.server.state import ServerError, ServerState, status_for


@dataclass(frozen=True)
class Call:
    """A generation call as an endpoint answers it."""
    id: str
    created: int
    model: str
    engine: object
    reqs: list  # one EngineRequest per prompt
    reader: AnswerReader  # how a chat completion's text is read back (server/chat/answer.py)
    logprobs: Logprobs


class Serving:
    """The skeleton, answering in one API's dialect (OpenAI's by default)."""

    def __init__(self, state: ServerState, dialect: dialects.Dialect = dialects.OPENAI):
        self.state, self.dialect = state, dialect

    async def generate(self, body, request: Request, id_prefix: str, make, answer, chunks) -> Response:
        """make(engine, call id) -> the call's EngineRequests and their AnswerReader (a refusal is an error
        response with its status); then answer(call, whole outputs) -> the body, or with `stream`, the event stream of
        chunks(call, deltas), an async iterator of chunks."""
        from pagoda.server.metrics import RequestRecord

        record = RequestRecord(f"POST {request.url.path}", peer=request.client.host if request.client else "")
        if self.state.tracing is not None:
            record.trace_parent = self.state.tracing.parent(request.headers)
            record.model = self.model_id()
        stack = contextlib.AsyncExitStack()
        try:
            engine = stack.enter_context(self.state.admit(generation=True))
            adapter = self.check_model(body.model)
            record.request_id = rid = id_prefix + new_request_id()
            reqs, reader = await self._make(body, make, engine, rid)
            if adapter is not None:  # the model named is a LoRA adapter (engine/lora/adapters.py)
                reqs = [dataclasses.replace(r, adapter=adapter) for r in reqs]
            outputs = open_requests(self.state, engine, reqs, record, stack, rid)
        except Exception as e:
            self._finish(record, status_for(e)[0])
            await stack.aclose()
            return self.dialect.error_for(e)
        call = Call(rid, int(time.time()), adapter or self.model_id(), engine, reqs, reader,
                    Logprobs(engine.vocab))
        if getattr(body, "stream", None):  # an embeddings body has no stream
            return self._stream(chunks(call, outputs), record, stack, rid)
        return await self._whole(lambda outs: answer(call, outs), outputs, request, record, stack, rid)

    def _stream(self, chunks, record, stack, rid: str) -> Response:
        status = {"code": grpc.StatusCode.OK}

        async def close():  # the call's end, however it ends: even cancelled before its first chunk
            self._finish(record, status["code"])
            await stack.aclose()  # aborts every request that has not finished
        return dialects.EventStream(self.dialect.events(chunks, status), close, {"X-Request-Id": rid},
                               self.dialect.media_type)

    async def _whole(self, answer, outputs, request: Request, record, stack, rid: str) -> Response:
        """Every choice to its end, answered whole; a client that leaves first aborts them all."""
        code = grpc.StatusCode.OK
        try:
            outs = await _unless_disconnected(whole_outputs(outputs), request)
            return json_response(answer(outs), headers={"X-Request-Id": rid})
        except Exception as e:
            code = status_for(e)[0]
            return self.dialect.error_for(e)
        finally:
            self._finish(record, code)
            await stack.aclose()

    async def _make(self, body, make, engine, rid: str) -> tuple[list, AnswerReader]:
        try:
            return await asyncio.to_thread(make, engine, rid) if _big(body) else make(engine, rid)
        except InvalidRequestError as e:  # the compiler names the engine's field
            param = structured(body)[1]
            raise renamed(e, param) if param and e.field.startswith("structured_outputs") else e from None

    def _finish(self, record, code: grpc.StatusCode) -> None:
        metrics = self.state.metrics
        if metrics is not None:
            metrics.requests.labels(record.method, code.name).inc()
        record.finish(code.name, metrics, self.state.tracing)

    def plain(self, work) -> Response:
        """A call that is not a generation: admitted, work(engine) -> the body; an error response else."""
        try:
            with self.state.admit(generation=False) as engine:
                return json_response(work(engine))
        except Exception as e:
            return self.dialect.error_for(e)

    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter a request's "model" names (None: the base model); 404 model_not_found for
        a name that is neither."""
        names = self.state.served_model_names()
        if name is None or name in names:
            return None
        engine = self.state.engine
        if engine is not None and name in engine.adapters:
            engine.check_adapter(name)  # being unloaded: not found either
            return name
        served = names + (sorted(engine.adapters) if engine is not None else [])
        raise ServerError(grpc.StatusCode.NOT_FOUND, f"model {name!r} does not exist; this server serves "
                                                     f"{', '.join(map(repr, served))} (GET /v1/models)",
                          reason="model_not_found")

    def model_id(self) -> str:
        names = self.state.served_model_names()
        return names[0] if names else ""


def usage(lasts) -> dict:
    """OpenAI's usage from each choice's last (or whole) output: prompt tokens once per prompt,
    completion tokens of every choice."""
    lasts = list(lasts)
    prompt = sum(o.num_prompt_tokens for o in lasts if o.index == 0)
    cached = sum(o.num_cached_tokens for o in lasts if o.index == 0)
    completion = sum(o.num_generated_tokens for o in lasts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def json_response(body: dict, status: int = 200, headers: dict | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)


async def _unless_disconnected(work, request: Request):
    """`work`'s result; ServerError CANCELLED (and `work` cancelled) if the client leaves first."""
    work = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not work.done():
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
        raise ServerError(grpc.StatusCode.CANCELLED, "the client disconnected")
    return work.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (its request body has been read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _big(body) -> bool:
    """A prompt long enough that rendering and tokenizing it should leave the event loop, or a
    structured output (its compiling may take a while; Ollama's `format` too)."""
    if structured(body)[0] is not None or getattr(body, "tools", None) or getattr(body, "format", None):
        return True
    text = getattr(body, "prompt", None) or getattr(body, "input", None)  # an embeddings call's input
    if isinstance(text, str):
        return len(text) > 4096
    if isinstance(text, list) and text and isinstance(text[0], str):
        return sum(map(len, text)) > 4096
    msgs = getattr(body, "messages", None) or []
    return sum(len(m.content) if isinstance(m.content, str) else 64 for m in msgs) > 4096

"""pagoda.v1.GenerationService: thin grpc.aio handlers over engine.AsyncEngine.

Each handler: refuse while not serving (or past --max-concurrent-streams), validate and convert
(server/convert.py), open the requests as the HTTP door does (server/calls.py: the time limit),
convert back: whole outputs for Generate, deltas for GenerateStream. Exceptions become
status codes in one place (status_for, applied by _call), which also counts every call in the
metrics and, for generations, writes the structured request log line (server/metrics.py).

Status codes: OK; INVALID_ARGUMENT (a bad or undecodable request; the message names the field);
ALREADY_EXISTS (request_id in flight); RESOURCE_EXHAUSTED (waiting queue full, too many concurrent
generations; both say "retry after a short backoff"; a request over --max-message-bytes, refused unparsed);
UNAVAILABLE (loading, draining, engine shut down); DEADLINE_EXCEEDED (the client's deadline, or
--request-timeout); CANCELLED (the client cancelled); UNAUTHENTICATED (server/auth.py); INTERNAL
(an engine step failed, or a bug).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

import grpc

from pagoda.engine.frontend.async_engine import whole_outputs
from pagoda.engine.errors import InvalidRequestError
from pagoda.engine.validation import MAX_REQUEST_ID_LEN, new_request_id
from pagoda.server import convert
from pagoda.server.calls import open_requests
from pagoda.server.state import ServerState, stats_dict, status_for
from pagoda.v1 import generation_pb2 as pb
from pagoda.v1 import generation_pb2_grpc as pb_grpc

log = logging.getLogger("pagoda.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name  # "pagoda.v1.GenerationService"

REQUEST_ID_HEADER = "x-request-id"
LARGE_PROMPT_CHARS = 4096  # text/messages longer than this are tokenized in a thread, off the event loop


class Undecodable:
    """What the lenient deserializer hands the handler for bytes that are not a valid message (bad
    wire data, a string field that is not UTF-8): the handler answers INVALID_ARGUMENT instead of
    grpc's generic INTERNAL "Exception deserializing request!"."""

    def __init__(self, message_type: str, error: Exception):
        self.message_type = message_type
        self.error = error


class Oversized:
    """What the deserializer hands the handler for a request over --max-message-bytes, instead of parsing
    it (gRPC's own limit is set higher: ServerOptions.grpc_receive_limit)."""

    def __init__(self, size: int, limit: int):
        self.message = (f"the request is {size} bytes, larger than --max-message-bytes ({limit}): send a smaller one, "
                        f"or start the server with a larger --max-message-bytes")


def lenient_deserializer(cls, max_bytes: int | None = None):
    def deserialize(data: bytes):
        if max_bytes is not None and len(data) > max_bytes:
            return Oversized(len(data), max_bytes)
        try:
            return cls.FromString(data)
        except Exception as e:  # google.protobuf.message.DecodeError, and anything else a parser may raise
            return Undecodable(cls.DESCRIPTOR.full_name, e)
    return deserialize


def add_servicer_to_server(servicer, server) -> None:
    """As the generated add_GenerationServiceServicer_to_server, with lenient request deserializers that
    refuse a request over --max-message-bytes unparsed."""
    service = pb.DESCRIPTOR.services_by_name["GenerationService"]
    limit = servicer.state.options.max_message_bytes
    handlers = {}
    for m in service.methods:
        req_cls, resp_cls = getattr(pb, m.input_type.name), getattr(pb, m.output_type.name)
        make = grpc.unary_stream_rpc_method_handler if m.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[m.name] = make(getattr(servicer, m.name), request_deserializer=lenient_deserializer(req_cls, limit),
                                response_serializer=resp_cls.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def _header_safe(value: str) -> bool:
    return all(" " <= c <= "~" for c in value)


def _metadata_request_id(context) -> str:
    """The x-request-id metadata, checked; "" when absent."""
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_HEADER:
            if isinstance(value, bytes):
                raise InvalidRequestError("x-request-id metadata", "must be text")
            if len(value) > MAX_REQUEST_ID_LEN:
                raise InvalidRequestError("x-request-id metadata", f"must be at most {MAX_REQUEST_ID_LEN} "
                                                                   f"characters, got {len(value)}")
            return value
    return ""


def _prompt_chars(request) -> int:
    which = request.WhichOneof("prompt")
    if which == "text":
        return len(request.text)
    if which == "messages":
        return sum(len(m.content) + len(m.role) + 16 for m in request.messages.messages)  # + per-message markup
    if which == "prompts":
        return sum(map(_prompt_chars, request.prompts.prompts))
    return 0


class GrpcServicer(pb_grpc.GenerationServiceServicer):
    def __init__(self, state: ServerState):
        self.state = state

    @contextlib.asynccontextmanager
    async def _call(self, context: grpc.aio.ServicerContext, method: str, request, record=None):
        """Admits a call (UNAVAILABLE unless serving; RESOURCE_EXHAUSTED past --max-concurrent-streams
        for generations), yields the engine, maps exceptions to status codes, counts the call in the
        metrics and finishes its request record. context.abort raises, which ends the handler."""
        state, metrics = self.state, self.state.metrics
        code = grpc.StatusCode.OK
        try:
            if isinstance(request, Oversized):
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, request.message)
            if isinstance(request, Undecodable):
                raise InvalidRequestError("request", f"is not a valid {request.message_type} message "
                                                      f"({type(request.error).__name__}: {request.error}); strings "
                                                      f"must be UTF-8")
            with state.admit(generation=record is not None) as engine:
                yield engine
        except (asyncio.CancelledError, GeneratorExit):  # a stream closed at a yield ends with GeneratorExit
            remaining = context.time_remaining()
            code = (grpc.StatusCode.DEADLINE_EXCEEDED if remaining is not None and remaining <= 0
                    else grpc.StatusCode.CANCELLED)
            raise
        except grpc.aio.AbortError:
            code = context.code() or grpc.StatusCode.UNKNOWN
            raise
        except Exception as e:
            code, message = status_for(e)
            await context.abort(code, message)
        finally:
            if metrics is not None:
                metrics.requests.labels(method, code.name).inc()
            if record is not None:
                record.finish(code.name, metrics, state.tracing)

    async def _open(self, engine, request, context, record, stack):
        """The request's EngineRequests (one per prompt), their AnswerReader and their (prompt index, delta)
        pairs (server/calls.py: the time limit; `stack` aborts what has not finished)."""
        state = self.state
        rid = request.request_id or _metadata_request_id(context) or new_request_id()
        record.request_id = rid[:MAX_REQUEST_ID_LEN]
        if _header_safe(rid) and len(rid) <= MAX_REQUEST_ID_LEN:
            await context.send_initial_metadata(((REQUEST_ID_HEADER, rid),))
        # rendering and tokenizing a long text, or compiling a structured output, takes a while
        if _prompt_chars(request) > LARGE_PROMPT_CHARS or request.HasField("structured_output") or request.tools:
            reqs, reader = await asyncio.to_thread(convert.to_engine_requests, request, engine, state.limits, rid,
                                                   state.options)
        else:
            reqs, reader = convert.to_engine_requests(request, engine, state.limits, rid, state.options)
        state.check_call_size(len(reqs), "prompts")
        return reqs, reader, open_requests(state, engine, reqs, record, stack, rid)

    def _record(self, method: str, context):
        from pagoda.server.metrics import RequestRecord

        record = RequestRecord(method, peer=context.peer() or "")
        if self.state.tracing is not None:
            record.trace_parent = self.state.tracing.parent(context.invocation_metadata() or ())
            names = self.state.served_model_names()
            record.model = names[0] if names else ""
        return record

    async def Generate(self, request, context):
        record = self._record("Generate", context)
        async with self._call(context, "Generate", request, record) as engine, contextlib.AsyncExitStack() as stack:
            reqs, reader, outputs = await self._open(engine, request, context, record, stack)
            by_prompt: dict[int, list] = {}
            for i, out in await whole_outputs(outputs):
                by_prompt.setdefault(i, []).append(out)
            if len(by_prompt) != len(reqs):
                raise RuntimeError("the engine ended a request without a final output")
            responses = [convert.response(r, by_prompt[i], engine.prompt_text(r) if request.echo else None, reader)
                         for i, r in enumerate(reqs)]
            if request.WhichOneof("prompt") != "prompts":
                return responses[0]
            return pb.GenerateResponse(request_id=record.request_id, usage=convert.total_usage(responses),
                                       results=responses)

    async def GenerateStream(self, request, context):
        record = self._record("GenerateStream", context)
        async with self._call(context, "GenerateStream", request, record) as engine, \
                contextlib.AsyncExitStack() as stack:
            reqs, reader, outputs = await self._open(engine, request, context, record, stack)
            started: set[int] = set()  # prompts whose first message went out
            answers = {}  # (prompt, completion) -> its AnswerStream, when its calls or reasoning are read
            async for i, out in outputs:
                first = i not in started
                if (i, out.index) not in answers:
                    answers[i, out.index] = reader.stream()
                stream = answers[i, out.index]
                if out.token_ids or out.text or out.finished or (first and out.prompt_logprobs is not None):
                    msg = convert.stream_response(reqs[i].request_id, out, i, stream)
                    if first and request.echo:
                        msg.prompt_token_ids.extend(reqs[i].prompt_token_ids)
                        msg.prompt_text = engine.prompt_text(reqs[i])
                    if not first:
                        del msg.prompt_logprobs[:]  # every completion brings them; the prompt's first message has them
                    started.add(i)
                    yield msg

    async def Tokenize(self, request, context):
        async with self._call(context, "Tokenize", request) as engine:
            if not request.text:
                raise InvalidRequestError("text", "must not be empty")
            if len(request.text) > LARGE_PROMPT_CHARS:
                ids = await asyncio.to_thread(engine.encode, request.text)
            else:
                ids = engine.encode(request.text)
            return pb.TokenizeResponse(token_ids=ids)

    async def GetModelInfo(self, request, context):
        async with self._call(context, "GetModelInfo", request) as engine:
            o = self.state.options
            info = dataclasses.replace(engine.model_info, model_id=self.state.served_model_names()[0],
                                       adapters=tuple(a for _, a in sorted(engine.adapters.items())))
            c = engine.config
            return convert.model_info(info, limits=self.state.limits,
                                      max_message_bytes=o.max_message_bytes,
                                      max_concurrent_streams=o.max_concurrent_streams,
                                      request_timeout=o.request_timeout,
                                      max_queue_wait=engine.config.max_queue_wait_s,
                                      lora=(c.max_loras, c.max_lora_rank) if c.enable_lora else (0, 0))

    async def GetStats(self, request, context):
        async with self._call(context, "GetStats", request) as engine:
            return pb.GetStatsResponse(**stats_dict(engine.stats()))

    async def Embed(self, request, context):
        return await self._pooled("Embed", request, context, convert.embed_requests, "inputs",
                                  lambda engine, outs: convert.embed_response(outs))

    async def Rerank(self, request, context):
        return await self._pooled("Rerank", request, context, convert.rerank_requests, "documents",
                                  lambda engine, outs: convert.rerank_response(request, engine, outs))

    async def _pooled(self, method: str, request, context, make, field: str, answer):
        """A pooling call: make(request, engine, limits, rid) -> its requests (at most the call size, named by
        `field`), run whole; answer(engine, outputs) -> the response."""
        record = self._record(method, context)
        async with self._call(context, method, request, record) as engine, contextlib.AsyncExitStack() as stack:
            rid = request.request_id or _metadata_request_id(context) or new_request_id()
            record.request_id = rid[:MAX_REQUEST_ID_LEN]
            reqs = make(request, engine, self.state.limits, rid)
            self.state.check_call_size(len(reqs), field)
            outputs = open_requests(self.state, engine, reqs, record, stack, rid)
            return answer(engine, await whole_outputs(outputs))

    async def LoadLoRAAdapter(self, request, context):
        async with self._call(context, "LoadLoRAAdapter", request) as engine:
            self.state.check_lora_loading()
            await engine.load_adapter(request.name, request.path)
            return pb.LoadLoRAAdapterResponse()

    async def UnloadLoRAAdapter(self, request, context):
        async with self._call(context, "UnloadLoRAAdapter", request) as engine:
            self.state.check_lora_loading()
            await engine.unload_adapter(request.name)
            return pb.UnloadLoRAAdapterResponse()

"""The OpenAI-compatible HTTP door, beside gRPC: the same engine, the same front-end and the same
asyncio loop. POST /v1/completions and /v1/chat/completions (whole responses, or Server-Sent Events
with `stream`), GET /v1/models, /health and /stats.

As server/convert.py does for gRPC, a request is converted at the edge and judged by the engine's own
validation: an InvalidRequestError names the field, returned as OpenAI's `param`. Statuses come from
server/state.py's one map (status_for, HTTP_STATUS). An unknown request field is a 400 naming it.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Annotated, Literal

import grpc
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagoda.engine.async_engine import merge_streams
from pagoda.engine.errors import InvalidRequestError
from pagoda.engine.outputs import TokenLogprob
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.structured import StructuredOutputs
from pagoda.engine.validation import check_text, new_request_id
from pagoda.server import convert
from pagoda.server.auth import check_key, key_digest
from pagoda.server.state import HTTP_STATUS, SERVING, ServerError, ServerState, status_for

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_error", 503: "service_unavailable", 504: "timeout"}
# OpenAI's error.code (a string, or null) where an HTTP status has one word for every cause
ERROR_CODES = {400: "invalid_value", 401: "invalid_api_key", 429: "rate_limit_exceeded"}


# ---- requests (OpenAI's fields, vLLM's names for the extras) ----

def _whole_number(value):
    """JSON Schema's integer: 2.0 is one (strict types otherwise)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_whole_number)]


class _Fields(BaseModel):
    # OpenAI's types exactly ("16" is not an integer, true is not 1); null is each field's default;
    # an unknown field is refused by name
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Fields):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # accepted; chunks are not padded


class JsonSchemaFormat(_Fields):
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Fields):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_Fields):
    """vLLM's structured_outputs: exactly one of these."""
    json_: dict | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _Sampling(_Fields):
    model: str | None = None
    n: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, not used
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[Int] | None = None
    priority: Int | None = None
    return_token_ids: bool | None = None  # vLLM's name: each choice (and stream chunk) also carries its token ids
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    truncate_prompt_tokens: Int | None = None
    logit_bias: dict[str, float] | None = None  # token id (a string, as OpenAI's) -> bias in [-100, 100]
    bad_words: list[str] | None = None
    prompt_logprobs: Int | None = None  # vLLM's: each prompt token's logprob, with this many alternatives
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* names
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[Int] | list[list[Int]] | None
    max_tokens: Int | None = None  # null: 16 (OpenAI's default for completions)
    logprobs: Int | None = None
    echo: bool | None = None
    best_of: Int | None = None  # only its default: n
    suffix: str | None = None  # only its default: none


class ChatMessage(BaseModel):
    # one model for every role: what each role may carry is checked in _chat_messages, with the
    # message's index in the error
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["developer", "system", "user", "assistant", "tool", "function"]
    content: str | list[dict] | None = None
    name: str | None = None
    refusal: str | None = None  # an assistant message as the SDK returned it, sent back as is
    annotations: list | None = None
    audio: dict | None = None
    tool_calls: list | None = None
    function_call: dict | None = None
    tool_call_id: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: bool | None = None
    top_logprobs: Int | None = None
    # OpenAI's fields that only their default (or null) can mean here
    store: bool | None = None
    metadata: dict[str, str] | None = None  # accepted, not used (OpenAI keeps it with stored completions)
    service_tier: str | None = None
    modalities: list[str] | None = None
    moderation: dict | None = None
    prompt_cache_retention: str | None = None  # accepted, not used: prefix caching keeps what memory allows
    prompt_cache_options: dict | None = None  # likewise
    reasoning_effort: str | None = None
    verbosity: str | None = None
    safety_identifier: str | None = None  # accepted, not used
    prompt_cache_key: str | None = None  # accepted, not used: prefix caching needs no key
    audio: dict | None = None
    prediction: dict | None = None
    web_search_options: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    functions: list | None = None
    function_call: str | dict | None = None


class TokenizeRequest(_Fields):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None  # accepted: the prompt always ends ready for the reply
    return_token_strs: bool | None = None


class DetokenizeRequest(_Fields):
    model: str | None = None
    tokens: list[Int]


_OPEN_PATHS = {"/health", "/version", "/metrics"}

# Fields of OpenAI's that this server takes only at a value that changes nothing (besides null).
_ONLY_DEFAULTS = {"store": (False,), "service_tier": ("auto", "default"), "modalities": (["text"], []), "moderation": (),
                  "audio": (), "prediction": (), "web_search_options": (), "reasoning_effort": (), "verbosity": (),
                  "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
                  "suffix": ("",)}


def _check_unsupported(body: _Fields) -> None:
    """A field this server cannot honour: a 400 naming it, unless its value changes nothing."""
    for name, harmless in _ONLY_DEFAULTS.items():
        value = getattr(body, name, None)
        if value is not None and value not in harmless:
            raise InvalidRequestError(name, f"is not supported by this server (got {_short(value)})")
    best_of = getattr(body, "best_of", None)
    if best_of is not None and best_of != (body.n or 1):
        raise InvalidRequestError("best_of", f"other than n is not supported by this server (got {best_of})")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _params(body: _Sampling, max_tokens: int | None, logprobs: int | None,
            prompt_logprobs: int | None = None) -> SamplingParams:
    """The request's SamplingParams; InvalidRequestError (its field) for a bad value."""
    _check_unsupported(body)
    names = ("n", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
             "repetition_penalty", "min_tokens", "truncate_prompt_tokens", "prompt_logprobs")
    kw = {name: getattr(body, name) for name in names if getattr(body, name) is not None}
    if prompt_logprobs is not None:
        kw["prompt_logprobs"] = max(prompt_logprobs, kw.get("prompt_logprobs") or 0)
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    if body.logit_bias:
        try:
            kw["logit_bias"] = {int(t): b for t, b in body.logit_bias.items()}
        except ValueError:
            raise InvalidRequestError("logit_bias", "keys must be token ids (integers as strings)") from None
    so, param = _structured(body)
    try:
        kw["structured_outputs"] = so and StructuredOutputs(**so)
    except InvalidRequestError as e:
        raise _renamed(e, param) from None
    return SamplingParams(**kw, max_tokens=max_tokens, stop=stop, stop_token_ids=body.stop_token_ids or [],
                          ignore_eos=bool(body.ignore_eos), logprobs=logprobs is not None, top_logprobs=logprobs or 0,
                          skip_special_tokens=body.skip_special_tokens is not False, bad_words=body.bad_words or [],
                          include_stop_str_in_output=bool(body.include_stop_str_in_output))


def _structured(body: _Sampling) -> tuple[dict | None, str | None]:
    """The request's structured output, as StructuredOutputs' fields, and the field that gave it."""
    given = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        given.append(({"json_object": True}, "response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise InvalidRequestError("response_format.json_schema.schema", "is required with type json_schema")
        given.append(({"json": rf.json_schema.schema_}, "response_format.json_schema.schema"))
    so = body.structured_outputs
    if so is not None:
        fields = {"json" if k == "json_" else k: v for k, v in so.model_dump(exclude_none=True).items()}
        given.append((fields, "structured_outputs." + next(iter(fields), "json")))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{kind}")
        if value is not None:
            given.append(({kind: value}, f"guided_{kind}"))
    if len(given) > 1:
        raise InvalidRequestError(given[1][1], f"conflicts with {given[0][1]}: set one structured output")
    return given[0] if given else (None, None)


def _renamed(e: InvalidRequestError, param: str) -> InvalidRequestError:
    """A structured output's error under the field the request gave it in (an index kept)."""
    _, bracket, index = e.field.partition("[")
    return e.renamed(param + bracket + index)


def _prompts(prompt, start_of_text: list[int]) -> list:
    """The request's prompts; null (or "") is OpenAI's default, a document boundary: here the model's
    start-of-text token (BOS, else EOS)."""
    if prompt is None or prompt == "":
        return [start_of_text]
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise InvalidRequestError("prompt", "must not be empty")
    return list(prompt)


# Roles as the chat template knows them: "developer" is OpenAI's newer name for "system".
_TEMPLATE_ROLE = {"developer": "system", "system": "system", "user": "user", "assistant": "assistant"}


def _render_chat(engine, messages: list[ChatMessage]) -> list[int]:
    """A conversation's prompt token ids, through the model's chat template."""
    try:
        return engine.apply_chat_template(_chat_messages(messages))
    except InvalidRequestError:
        raise
    except Exception as e:  # no template, a role the template refuses, ...
        raise InvalidRequestError("messages", f"cannot be rendered with the model's chat template: {e}") from e


def _start_of_text(engine) -> list[int]:
    tok = engine.tokenizer
    token = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    return [token] if token is not None else []


def _chat_messages(messages: list[ChatMessage]) -> list[dict]:
    if not messages:
        raise InvalidRequestError("messages", "must not be empty")
    return [_chat_message(i, m) for i, m in enumerate(messages)]


def _chat_message(i: int, m: ChatMessage) -> dict:
    where = f"messages[{i}]"
    if m.role not in _TEMPLATE_ROLE:
        raise InvalidRequestError(f"{where}.role", f"{m.role!r} is not supported by this server: it serves no tools")
    if m.tool_calls or m.function_call is not None:
        field = "tool_calls" if m.tool_calls else "function_call"
        raise InvalidRequestError(f"{where}.{field}", "is not supported by this server: it serves no tools")
    if m.tool_call_id is not None or (m.role != "assistant" and (m.refusal, m.audio, m.annotations) != (None,) * 3):
        field = next(f for f in ("tool_call_id", "refusal", "audio", "annotations") if getattr(m, f) is not None)
        raise InvalidRequestError(f"{where}.{field}", f"is not a field of a {m.role} message")
    if m.content is None and m.role != "assistant":
        raise InvalidRequestError(f"{where}.content", "is required")
    return {"role": _TEMPLATE_ROLE[m.role], "content": _text_of(where, m.content)}


def _text_of(where: str, content) -> str:
    """A message's text: the string, or its text parts joined."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind != "text" or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
            what = f"a {kind!r} part is not supported: this server's models take text" if kind != "text" else \
                "must be {\"type\": \"text\", \"text\": STRING}"
            raise InvalidRequestError(f"{where}.content[{j}]", what)
        texts.append(part["text"])
    return "".join(texts)


# ---- responses ----

def _error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object: type from the status, code a string or null."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code or ERROR_CODES.get(status)}}


def _error(status: int, message: str, param: str | None = None, headers: dict | None = None,
           code: str | None = None) -> Response:
    return Response(orjson.dumps(_error_body(status, message, param, code)), status_code=status,
                    media_type="application/json", headers=headers)


def _error_for(e: Exception) -> Response:
    status, message, param, code = _error_parts(e)
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return _error(status, message, param, headers, code)


def _error_parts(e: Exception) -> tuple[int, str, str | None, str | None]:
    """(HTTP status, message, param, code) of an exception, through the one status map."""
    code, message = status_for(e)
    param = e.field if isinstance(e, InvalidRequestError) else None
    return HTTP_STATUS.get(code, 500), message, param, getattr(e, "reason", None)


def _json(body: dict, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


class _Choice:
    """One choice's text, tokens and logprobs, gathered from its outputs."""

    def __init__(self):
        self.text, self.token_ids, self.logprobs, self.last = [], [], [], None
        self.prompt_logprobs = None  # from the first output

    def add(self, out) -> None:
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.text.append(out.text)
        self.token_ids.extend(out.token_ids)
        self.logprobs.extend(out.logprobs or [])
        self.last = out


@dataclass(frozen=True)
class _Echo:
    """A prompt echoed before its completions (`echo`)."""
    text: str
    token_ids: list[int]


def _echoed(echo: _Echo | None, prompt_logprobs) -> list:
    """The echoed prompt's logprob entries (the first token has none: null logprob and top), before the
    completion's; none without echo."""
    if echo is None:
        return []
    lps = prompt_logprobs or [None] * len(echo.token_ids)
    return [lp or TokenLogprob(t, None, None) for t, lp in zip(echo.token_ids, lps)]


def _finish_reason(out) -> str | None:
    return None if out is None or not out.finished else ("length" if out.finish_reason == "length" else "stop")


class HttpDoor:
    """The routes, over the server's shared state."""

    def __init__(self, state: ServerState):
        self.state = state
        self._key = key_digest(state.options.api_key) if state.options.api_key else None
        # no redirect for a trailing slash: each route answers with and without one
        self.app = FastAPI(title="pagoda", openapi_url=None, docs_url=None, redoc_url=None, redirect_slashes=False)
        self.app.add_exception_handler(RequestValidationError, self._invalid_body)
        self.app.add_exception_handler(StarletteHTTPException, self._no_route)
        self.app.middleware("http")(self._guard)
        for method, path, handler in (
                ("POST", "/v1/completions", self.completions), ("POST", "/v1/chat/completions", self.chat_completions),
                ("GET", "/v1/models", self.models), ("GET", "/v1/models/{model_id:path}", self.model),
                ("POST", "/tokenize", self.tokenize), ("POST", "/detokenize", self.detokenize),
                ("GET", "/health", self.health), ("GET", "/stats", self.stats), ("GET", "/version", self.version),
                ("GET", "/metrics", self.metrics)):
            for route in (path, path + "/"):
                self.app.add_api_route(route, handler, methods=[method], include_in_schema=False)

    # ---- cross-cutting ----

    async def _guard(self, request: Request, call_next):
        """API key (all but /health, /version and /metrics, as vLLM) and request size, before a body is read."""
        if self._key is not None and request.url.path.rstrip("/") not in _OPEN_PATHS:
            auth = request.headers.get("authorization", "")
            token = auth[7:] if auth.lower().startswith("bearer ") else None
            if not check_key(token, self._key):
                return _error(401, "a valid API key is required: Authorization: Bearer KEY")
        size = request.headers.get("content-length")
        limit = self.state.options.max_message_bytes
        if size is not None and size.isdigit() and int(size) > limit:
            return _error(413, f"the request body is {size} bytes, more than this server's {limit} "
                               f"(--max-message-bytes)")
        return await call_next(request)

    async def _no_route(self, request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code in (404, 405):
            return _error(exc.status_code, f"no route {request.method} {request.url.path}")
        return _error(exc.status_code, str(exc.detail))

    async def _invalid_body(self, request: Request, exc: RequestValidationError) -> Response:
        err = exc.errors()[0] if exc.errors() else {}
        param = _param_of(err.get("loc", ()))
        kind = err.get("type", "")
        if kind == "extra_forbidden":
            return _error(400, f"unknown field {param!r}", param, code="unknown_parameter")
        if kind == "json_invalid":
            return _error(400, "the request body is not valid JSON", code="invalid_json")
        if kind == "missing":
            return _error(400, f"{param} is required", param, code="missing_required_parameter")
        code = "invalid_type" if kind.endswith("_type") or kind == "literal_error" else None
        return _error(400, f"{param or 'body'}: {err.get('msg', 'invalid')}", param, code=code)

    def _check_model(self, name: str | None) -> None:
        names = self.state.served_model_names()
        if name is not None and name not in names:
            raise ServerError(grpc.StatusCode.NOT_FOUND, f"model {name!r} does not exist; this server serves "
                                                         f"{', '.join(map(repr, names))} (GET /v1/models)",
                              reason="model_not_found")

    def _model_id(self) -> str:
        names = self.state.served_model_names()
        return names[0] if names else ""

    # ---- simple routes ----

    async def health(self) -> Response:
        if self.state.phase == SERVING and self.state.engine is not None:
            return _json({"status": "serving"})
        return _json({"status": self.state.phase}, 503)

    async def models(self) -> Response:
        try:
            with self.state.admit(generation=False) as engine:
                return _json({"object": "list", "data": [self._model_card(engine, name)
                                                         for name in self.state.served_model_names()]})
        except Exception as e:
            return _error_for(e)

    async def model(self, model_id: str) -> Response:
        """GET /v1/models/{id} (the SDK's models.retrieve)."""
        try:
            with self.state.admit(generation=False) as engine:
                self._check_model(model_id)
                return _json(self._model_card(engine, model_id))
        except Exception as e:
            return _error_for(e)

    def _model_card(self, engine, name: str) -> dict:
        loaded = int(time.time() - engine.stats().uptime_s)
        return {"id": name, "object": "model", "created": loaded, "owned_by": "pagoda",
                "max_model_len": engine.model_info.max_model_len}

    async def version(self) -> Response:
        from importlib.metadata import version
        return _json({"version": version("pagoda")})

    async def metrics(self) -> Response:
        """Prometheus' text format, on the HTTP port where scrapers look first (also --metrics-port)."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if self.state.metrics is None:
            return _error(404, "this server keeps no metrics")
        return Response(generate_latest(self.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def tokenize(self, body: TokenizeRequest) -> Response:
        """vLLM's /tokenize: a prompt's (or a conversation's) token ids."""
        try:
            with self.state.admit(generation=False) as engine:
                self._check_model(body.model)
                if (body.prompt is None) == (body.messages is None):
                    raise InvalidRequestError("prompt", "or messages: exactly one is required")
                if body.prompt is not None:
                    check_text("prompt", body.prompt)
                    ids = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
                else:
                    ids = _render_chat(engine, body.messages)
                info = engine.model_info
                strs = [engine.vocab.pieces[t].decode("utf-8", "replace") for t in ids] \
                    if body.return_token_strs else None
                return _json({"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids,
                              "token_strs": strs})
        except Exception as e:
            return _error_for(e)

    async def detokenize(self, body: DetokenizeRequest) -> Response:
        """vLLM's /detokenize: the text token ids spell."""
        try:
            with self.state.admit(generation=False) as engine:
                self._check_model(body.model)
                vocab = engine.model_info.vocab_size
                for i, t in enumerate(body.tokens):
                    if not 0 <= t < vocab:
                        raise InvalidRequestError(f"tokens[{i}]", f"must be a token id in [0, {vocab}), got {t}")
                return _json({"prompt": engine.decode(body.tokens, skip_special_tokens=False)})
        except Exception as e:
            return _error_for(e)

    async def stats(self) -> Response:
        try:
            with self.state.admit(generation=False) as engine:
                msg = convert.stats(engine.stats())  # GetStats' figures, under its names
                return _json({f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields})
        except Exception as e:
            return _error_for(e)

    # ---- generation ----

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        def make(engine, rid):
            # echo with logprobs: the prompt's tokens come with theirs (the first one's null)
            echoed = body.logprobs if body.echo and body.logprobs is not None else None
            max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default for completions
            params = _params(body, max_tokens, body.logprobs, prompt_logprobs=echoed)
            prompts = _prompts(body.prompt, _start_of_text(engine))
            self.state.check_call_size(len(prompts), "prompt")
            several = isinstance(body.prompt, list) and isinstance(body.prompt[0], (str, list))
            reqs = []
            for i, p in enumerate(prompts):
                try:
                    reqs.append(engine.make_request(p, params, f"{rid}-{i}", body.priority or 0,
                                                    limits=self.state.limits))
                except InvalidRequestError as e:  # the engine's prompt_token_ids[j] as this request spells it
                    if not e.field.startswith("prompt"):
                        raise
                    name = f"prompt[{i}]" if several else "prompt"
                    raise e.renamed(name + e.field.removeprefix("prompt_token_ids").removeprefix("prompt")) from None
            return reqs
        return await self._generate(body, request, make, chat=False)

    async def chat_completions(self, body: ChatRequest, request: Request) -> Response:
        def make(engine, rid):
            # max_completion_tokens (OpenAI's newer name) wins where both are given, as in vLLM
            max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            if body.top_logprobs and not body.logprobs:
                raise InvalidRequestError("top_logprobs", "needs logprobs: true")
            params = _params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
            ids = _render_chat(engine, body.messages)
            return [engine.make_request(ids, params, f"{rid}-0", body.priority or 0, limits=self.state.limits)]
        return await self._generate(body, request, make, chat=True)

    async def _generate(self, body: _Sampling, request: Request, make, chat: bool) -> Response:
        """Admits the call, checks and starts every prompt's request (a refusal is an error response
        with its status), then answers whole or as an event stream."""
        from pagoda.server.metrics import RequestRecord

        path = request.url.path
        record = RequestRecord(f"POST {path}", peer=request.client.host if request.client else "")
        stack = contextlib.AsyncExitStack()
        code = grpc.StatusCode.OK
        try:
            engine = stack.enter_context(self.state.admit(generation=True))
            self._check_model(body.model)
            rid = ("chatcmpl-" if chat else "cmpl-") + new_request_id()
            record.request_id = rid
            try:
                reqs = await asyncio.to_thread(make, engine, rid) if _big(body) else make(engine, rid)
            except InvalidRequestError as e:  # the compiler names the engine's field
                param = _structured(body)[1]
                raise _renamed(e, param) if param and e.field.startswith("structured_outputs") else e from None
            streams = []
            for r in reqs:  # refusals (queue full, ...) raise here, before any answer is sent
                streams.append(engine.open(r))
                stack.push_async_callback(streams[-1].aclose)
            record.submitted()
        except Exception as e:
            code = status_for(e)[0]
            self._finish(record, code)
            await stack.aclose()
            return _error_for(e)
        meta = {"id": rid, "created": int(time.time()), "model": self._model_id(), "n": body.n or 1, "chat": chat,
                "token_ids": body.return_token_ids, "expired": self._time_limit(engine, reqs, record, stack),
                "echo": [_Echo(engine.prompt_text(r), r.prompt_token_ids) for r in reqs] if getattr(
                    body, "echo", False) else None, "prompt_logprobs": body.prompt_logprobs is not None}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            status = {"code": grpc.StatusCode.OK}

            async def close():  # the call's end, however it ends: even cancelled before its first chunk
                self._finish(record, status["code"])
                await stack.aclose()  # closes every prompt's stream (aborting what has not finished) and the call
            events = self._events(streams, meta, include_usage, record, status)
            return _EventStream(events, close, media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Request-Id": rid})
        try:
            response = await self._whole(streams, meta, request, record)
            response.headers["X-Request-Id"] = rid
            return response
        except Exception as e:
            code = status_for(e)[0]
            return _error_for(e)
        finally:
            self._finish(record, code)
            await stack.aclose()

    def _time_limit(self, engine, reqs, record, stack) -> list[bool]:
        """--request-timeout: a timer that aborts the call's requests (their streams then end), not a
        wait per token; returns the flag it sets."""
        expired, timeout = [False], self.state.options.request_timeout
        if timeout > 0:
            def expire():
                expired[0] = True
                for r in reqs:
                    engine.abort(r.request_id)

            loop = asyncio.get_running_loop()
            timer = loop.call_at(loop.time() + max(0.0, record.t0 + timeout - time.monotonic()), expire)
            stack.callback(timer.cancel)
        return expired

    def _timed_out(self, meta) -> ServerError:
        timeout = self.state.options.request_timeout
        return ServerError(grpc.StatusCode.DEADLINE_EXCEEDED, f"request {meta['id']!r} ran past this server's time "
                                                              f"limit of {timeout:g}s (--request-timeout) and was "
                                                              f"aborted")

    def _finish(self, record, code: grpc.StatusCode) -> None:
        metrics = self.state.metrics
        if metrics is not None:
            metrics.requests.labels(record.method, code.name).inc()
        record.finish(code.name, metrics)

    async def _whole(self, streams, meta, request: Request, record) -> Response:
        """Every choice to its end; a client that disconnects first aborts them all."""
        async def gather():
            choices: dict[int, _Choice] = {}
            async for i, out in merge_streams(streams):
                record.output(out)
                k = i * meta["n"] + out.index
                if k not in choices:
                    choices[k] = _Choice()
                    choices[k].prompt = meta["echo"][i] if meta["echo"] else None
                choices[k].add(out)
            return choices

        work = asyncio.ensure_future(gather())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():  # the client left
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
            raise ServerError(grpc.StatusCode.CANCELLED, "the client disconnected")
        choices = work.result()
        if meta["expired"][0]:
            raise self._timed_out(meta)
        body = {"id": meta["id"], "object": "chat.completion" if meta["chat"] else "text_completion",
                "created": meta["created"], "model": meta["model"],
                "choices": [self._choice(k, c, meta) for k, c in sorted(choices.items())],
                "usage": _usage_of([c.last for c in choices.values()])}
        return _json(body)

    def _choice(self, index: int, c: _Choice, meta: dict) -> dict:
        text, finish = "".join(c.text), _finish_reason(c.last)
        if meta["chat"]:
            out = {"index": index, "message": {"role": "assistant", "content": text, "refusal": None},
                   "logprobs": self._chat_logprobs(c.logprobs) if c.last.logprobs is not None else None,
                   "finish_reason": finish}
        else:
            echo = c.prompt
            logprobs = None
            if c.last.logprobs is not None:
                logprobs = self._completion_logprobs(_echoed(echo, c.prompt_logprobs) + c.logprobs)[0]
            out = {"index": index, "text": (echo.text if echo else "") + text, "finish_reason": finish,
                   "logprobs": logprobs}
        if meta["prompt_logprobs"]:
            out["prompt_logprobs"] = self._prompt_logprobs(c.prompt_logprobs)
        if meta["token_ids"]:
            out["token_ids"] = c.token_ids
        return out

    async def _events(self, streams, meta, include_usage: bool, record, status: dict):
        """The SSE stream: a chunk per output (chat: the role first), the usage chunk if asked, [DONE];
        status["code"] says how it ended."""
        chat = meta["chat"]
        last: dict[int, object] = {}
        offsets: dict[int, int] = {}  # per choice: where its next logprob token starts in its text
        kind = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": meta["id"], "object": kind, "created": meta["created"], "model": meta["model"]}
        if include_usage and chat:  # every chunk has the field, null but in the last (chat's schema only)
            head["usage"] = None
        try:
            if chat:
                for k in range(len(streams) * meta["n"]):
                    yield _event({**head, "choices": [{"index": k, "delta": {"role": "assistant", "content": ""},
                                                       "logprobs": None, "finish_reason": None}]})
            async for i, out in merge_streams(streams):
                record.output(out)
                k = i * meta["n"] + out.index
                first = k not in last
                last[k] = out
                if not (out.text or out.finished or out.token_ids or first):
                    continue
                echo = meta["echo"][i] if first and meta["echo"] else None
                delta, offsets[k] = self._delta(k, out, meta, echo, offsets.get(k, 0))
                yield _event({**head, "choices": [delta]})
            if meta["expired"][0]:
                raise self._timed_out(meta)
            if include_usage:
                yield _event({**head, "choices": [], "usage": _usage_of(list(last.values()))})
        except (asyncio.CancelledError, GeneratorExit):
            status["code"] = grpc.StatusCode.CANCELLED
            raise
        except Exception as e:
            status["code"] = status_for(e)[0]
            http_status, message, param, code = _error_parts(e)
            yield _event(_error_body(http_status, message, param, code))
        yield b"data: [DONE]\n\n"

    def _delta(self, k: int, out, meta: dict, echo: "_Echo | None", offset: int) -> tuple[dict, int]:
        """One output as a chunk (a completion's first chunk also carries the echoed prompt), and
        where the choice's next logprob token starts in its text."""
        finish = _finish_reason(out)
        if meta["chat"]:
            logprobs = None
            if out.logprobs is not None:
                logprobs = self._chat_logprobs(out.logprobs)
            delta = {"index": k, "delta": {"content": out.text} if out.text else {}, "logprobs": logprobs,
                     "finish_reason": finish}
        else:
            logprobs = None
            if out.logprobs is not None:
                logprobs, offset = self._completion_logprobs(_echoed(echo, out.prompt_logprobs) + out.logprobs,
                                                             offset)
            delta = {"index": k, "text": (echo.text if echo else "") + out.text, "finish_reason": finish,
                     "logprobs": logprobs}
        if meta["prompt_logprobs"] and out.prompt_logprobs is not None:
            delta["prompt_logprobs"] = self._prompt_logprobs(out.prompt_logprobs)
        if meta["token_ids"]:
            delta["token_ids"] = out.token_ids
        return delta, offset

    # ---- logprobs, with each token's text from the bytes it spells ----

    def _piece(self, token_id: int) -> bytes:
        pieces = self.state.engine.vocab.pieces
        return pieces[token_id] if token_id < len(pieces) else b""

    def _token(self, token_id: int) -> str:
        return self._piece(token_id).decode("utf-8", "replace")

    def _chat_logprobs(self, items) -> dict:
        def entry(token_id, logprob):
            piece = self._piece(token_id)
            return {"token": piece.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(piece)}
        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, p) for t, p in lp.top]}
                            for lp in items], "refusal": None}

    def _completion_logprobs(self, items, start: int = 0) -> tuple[dict, int]:
        """OpenAI's completion logprobs, each token's text_offset counted from `start` (where this
        piece begins in the choice's whole text); and where the next token starts."""
        tokens = [self._token(lp.token_id) for lp in items]
        offsets, at = [], start
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in items],
                "top_logprobs": [None if lp.top is None else {self._token(t): p for t, p in lp.top} for lp in items],
                "text_offset": offsets}, at

    def _prompt_logprobs(self, items) -> list | None:
        """vLLM's prompt_logprobs: per prompt token (None for the first), {token id: {logprob, rank,
        decoded_token}} for the token itself and the top alternatives."""
        if items is None:
            return None

        def entries(lp):
            pairs = {lp.token_id: (lp.logprob, lp.rank), **{t: (p, r) for r, (t, p) in enumerate(lp.top, 1)}}
            return {str(t): {"logprob": p, "rank": r, "decoded_token": self._token(t)} for t, (p, r) in pairs.items()}
        return [None if lp is None else entries(lp) for lp in items]


class _EventStream(StreamingResponse):
    """A StreamingResponse that runs `close` when it ends, whatever ends it (a client that leaves
    before the first chunk included, when the body's generator never starts)."""

    def __init__(self, content, close, **kw):
        super().__init__(content, **kw)
        self._close = close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._close()


def _usage_of(lasts: list) -> dict:
    """OpenAI's usage from each choice's last output: prompt tokens once per prompt, completion
    tokens of every choice."""
    prompt = sum(o.num_prompt_tokens for o in lasts if o.index == 0)
    cached = sum(o.num_cached_tokens for o in lasts if o.index == 0)
    completion = sum(o.num_generated_tokens for o in lasts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _event(chunk: dict) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def _big(body) -> bool:
    """A prompt long enough that rendering and tokenizing it should leave the event loop, or a
    structured output (its compiling may take a while)."""
    if _structured(body)[0] is not None:
        return True
    text = getattr(body, "prompt", None)
    if isinstance(text, str):
        return len(text) > 4096
    if isinstance(text, list) and text and isinstance(text[0], str):
        return sum(map(len, text)) > 4096
    msgs = getattr(body, "messages", None) or []
    return sum(len(m.content) if isinstance(m.content, str) else 64 for m in msgs) > 4096


def _param_of(loc) -> str | None:
    """A pydantic error location as the field's name: messages[0].content, not body.messages.0.content."""
    parts = [p for p in loc if p != "body"]
    if not parts:
        return None
    # a union's member names (str, list[int], ...) say which type was tried, not where
    parts = [p for p in parts if not (isinstance(p, str) and ("[" in p or p in _TYPE_NAMES))]
    out = ""
    for i, p in enumerate(parts):
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p))
    return out


_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none", "function-after", "literal"}


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (its request body has been read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# ---- the server ----

class _ChunkedBodyLimit:
    """--max-message-bytes for a body sent without Content-Length (chunked), which the route would
    otherwise read whole: read here up to the limit (413 past it), then handed on."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and not any(k == b"content-length" for k, _ in scope["headers"]):
            limit, size, parts = self.state.options.max_message_bytes, 0, []
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    break
                size += len(message.get("body", b""))
                if size > limit:
                    response = _error(413, f"the request body is more than this server's {limit} bytes "
                                           f"(--max-message-bytes)")
                    return await response(scope, receive, send)
                parts.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
            whole = [{"type": "http.request", "body": b"".join(parts), "more_body": False}]

            async def replay():
                return whole.pop() if whole else await receive()
            return await self.app(scope, replay, send)
        return await self.app(scope, receive, send)


class _Uvicorn:
    """uvicorn on a socket bound here (so a port in use fails at start, with the port named), inside
    the server's own event loop; the server process keeps its own SIGTERM handling (drain)."""

    def __init__(self, app, sock, options):
        import ssl

        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # pagoda serve drains on SIGTERM itself
                yield

        tls = {}
        if options.tls_cert:
            tls = dict(ssl_certfile=options.tls_cert, ssl_keyfile=options.tls_key)
            if options.tls_client_ca:
                tls.update(ssl_ca_certs=options.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=1,
                                **tls)
        self.server = Server(config)
        self.port = sock.getsockname()[1]
        self.task = asyncio.ensure_future(self.server.serve(sockets=[sock]))

    async def stop(self) -> None:
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.task, 10)


def bind(host: str, port: int):
    """A listening TCP socket on host:port ("[::]" or "::": every interface, IPv4 too); OSError
    naming --http-port and the fix."""
    from pagoda.server.ports import bound_socket

    sock = bound_socket(host, port, "--http-port")
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def start(state: ServerState, host: str, port: int) -> _Uvicorn:
    return _Uvicorn(_ChunkedBodyLimit(HttpDoor(state).app, state), bind(host, port), state.options)

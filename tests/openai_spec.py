"""OpenAI's published OpenAPI specification (tests/data/openai-openapi.yaml, pinned: see
tests/data/README.md) as a checker of what the HTTP door sends: a whole response against its
operation's schema for that status (any 4xx/5xx against ErrorResponse), an SSE chunk against the
stream's schema.

The YAML is read once per process (about half a second with libyaml). Two readings of the
specification's schemas, for jsonschema (Draft 2020-12, as OpenAPI 3.1 is):
  - `nullable: true` (OpenAPI 3.0's, still in 112 places of this 3.1 file) means "or null": such a
    schema becomes {"anyOf": [schema, {"type": "null"}]};
  - keywords jsonschema does not know (x-oaiMeta, x-stainless-const, discriminator, ...) are
    annotations, and ignored; `format` is checked where jsonschema knows the format (unixtime, int64:
    not known, so not checked).
Fields pagoda adds (vLLM's token_ids, prompt_logprobs) pass wherever the schema does not close its
object (additionalProperties: false), which none of the completion, chat, model and error schemas
(nor any they refer to) does. Two allowances, where the letter of the specification cannot be
followed: CHUNK_ALLOWANCES, and ECHO_ALLOWANCE.

validate_response / validate_chunk raise AssertionError naming every problem; CheckingTransport
checks everything an httpx client (the openai SDK's included) receives from /v1/.
"""
from __future__ import annotations

import datetime
import functools
import json
from pathlib import Path

import httpx

SPEC_PATH = Path(__file__).resolve().parent / "data" / "openai-openapi.yaml"
SPEC_URI = "urn:openai-openapi"
STREAM_SCHEMAS = {"chat": "CreateChatCompletionStreamResponse",
                  # the specification streams completions as the whole response's type
                  "completion": "CreateCompletionResponse",
                  "responses": "ResponseStreamEvent"}
# Where a stream chunk cannot follow the specification, and what it may do instead: a completion
# chunk before a choice's last has no finish reason yet, but CreateCompletionResponse requires one and
# does not allow null (OpenAI's API sends null there, as chat chunks do by their schema).
CHUNK_ALLOWANCES = {"completion": "choices.items.finish_reason: null"}
# With echo and logprobs, the prompt's first token has no logprob (nothing comes before it): OpenAI's
# own API, and vLLM, send null for it in token_logprobs and top_logprobs, whose items the
# specification types as number and object only.
ECHO_ALLOWANCE = "CreateCompletionResponse choices.items.logprobs: token_logprobs and top_logprobs items may be null"
# A request with pagoda's time_limit_ms extra field that runs out of time ends with finish_reason
# "time_limit" (never "length": a client must be able to tell them apart); the specification's enums
# lack it, so it is added to the finish_reason enums of the completion and chat responses and chunks, and
# to a Response's incomplete_details.reason (its status is then "incomplete").
TIME_LIMIT_ALLOWANCE = "finish_reason may also be \"time_limit\" (pagoda's time_limit_ms)"
TIME_LIMIT_SCHEMAS = ("CreateCompletionResponse", "CreateChatCompletionResponse", "CreateChatCompletionStreamResponse")
TESTS_URI = "urn:pagoda-tests"


@functools.lru_cache(maxsize=None)
def raw_spec() -> dict:
    """The YAML as written (one example holds a YAML date; it stays a date here)."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(SPEC_PATH, encoding="utf-8") as f:
        return yaml.load(f, Loader=loader)


@functools.lru_cache(maxsize=None)
def spec() -> dict:
    """The specification as JSON data, each `nullable: true` read as "or null". Callers must not change it."""
    out = _json_schema(raw_spec())
    _allow_echoed_first_token(out["components"]["schemas"]["CreateCompletionResponse"])
    for name in TIME_LIMIT_SCHEMAS:
        _allow_time_limit(out["components"]["schemas"][name])
    _allow_incomplete_time_limit(out["components"]["schemas"]["Response"])
    return out


def _allow_time_limit(schema: dict) -> None:
    """TIME_LIMIT_ALLOWANCE, in place: "time_limit" joins the choices' finish_reason enum, nothing else."""
    reason = schema["properties"]["choices"]["items"]["properties"]["finish_reason"]
    string = next(s for s in reason.get("anyOf", [reason]) if s.get("type") == "string")
    string["enum"] = [*string["enum"], "time_limit"]


def _allow_incomplete_time_limit(schema: dict) -> None:
    """TIME_LIMIT_ALLOWANCE for the Responses API, in place: "time_limit" joins incomplete_details.reason."""
    details = next(part["properties"]["incomplete_details"] for part in schema["allOf"]
                   if "incomplete_details" in part.get("properties", {}))
    reason = next(s for s in details["anyOf"] if s.get("type") == "object")["properties"]["reason"]
    reason["enum"] = [*reason["enum"], "time_limit"]


def _allow_echoed_first_token(schema: dict) -> None:
    """ECHO_ALLOWANCE, in place."""
    logprobs = schema["properties"]["choices"]["items"]["properties"]["logprobs"]
    entry = next(s for s in logprobs["anyOf"] if s.get("type") == "object")["properties"]
    for name in ("token_logprobs", "top_logprobs"):
        entry[name]["items"] = {"anyOf": [entry[name]["items"], {"type": "null"}]}


def _json_schema(node):
    if isinstance(node, dict):
        out = {k: _json_schema(v) for k, v in node.items() if not (k == "nullable" and isinstance(v, bool))}
        if node.get("nullable") is True:
            return {"anyOf": [out, {"type": "null"}]}
        return out
    if isinstance(node, list):
        return [_json_schema(v) for v in node]
    if isinstance(node, (datetime.date, datetime.datetime)):
        return node.isoformat()
    return node


@functools.lru_cache(maxsize=None)
def _registry():
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT202012

    return Registry().with_resources([
        (SPEC_URI, Resource.from_contents(spec(), default_specification=DRAFT202012)),
        (TESTS_URI, Resource.from_contents({"$defs": {"CompletionChunk": _completion_chunk()}},
                                           default_specification=DRAFT202012))])


def _completion_chunk() -> dict:
    """CreateCompletionResponse with CHUNK_ALLOWANCES["completion"]: a choice's finish_reason may be null.
    Its references point into the specification."""
    schema = _absolute_refs(spec()["components"]["schemas"]["CreateCompletionResponse"])
    choice = schema["properties"]["choices"]["items"]
    choice["properties"]["finish_reason"] = {"anyOf": [choice["properties"]["finish_reason"], {"type": "null"}]}
    return schema


def _absolute_refs(node):
    if isinstance(node, dict):
        return {k: SPEC_URI + v if k == "$ref" and isinstance(v, str) and v.startswith("#") else _absolute_refs(v)
                for k, v in node.items()}
    if isinstance(node, list):
        return [_absolute_refs(v) for v in node]
    return node


def chunk_pointer(kind: str, chunk) -> str:
    """The schema a stream chunk is checked against (its full URI): an error sent in the stream
    ({"error": {...}}), ErrorResponse; a completion chunk, CreateCompletionResponse with
    CHUNK_ALLOWANCES; a chat chunk, CreateChatCompletionStreamResponse."""
    if isinstance(chunk, dict) and "error" in chunk and "choices" not in chunk:
        return schema_pointer("ErrorResponse")
    if kind == "completion":
        return TESTS_URI + "#/$defs/CompletionChunk"
    return schema_pointer(STREAM_SCHEMAS[kind])


@functools.lru_cache(maxsize=None)
def validator(pointer: str):
    """A validator for the schema at this JSON pointer into the specification ('#/components/...')."""
    from jsonschema import Draft202012Validator

    ref = pointer if pointer.startswith("urn:") else SPEC_URI + pointer
    return Draft202012Validator({"$ref": ref}, registry=_registry(),
                                format_checker=Draft202012Validator.FORMAT_CHECKER)


def schema_pointer(name: str) -> str:
    if name not in spec()["components"]["schemas"]:
        raise KeyError(f"no schema {name!r} in the specification")
    return f"#/components/schemas/{name}"


def _escape(part: str) -> str:
    return part.replace("~", "~0").replace("/", "~1")


def _operation_path(path: str) -> str:
    """The specification's path for one of pagoda's (its servers' URL ends in /v1; a templated one,
    /models/{model}, where no literal path matches)."""
    path = path.split("?", 1)[0]
    path = path[len("/v1"):] if path.startswith("/v1/") else path
    if path in spec()["paths"]:
        return path
    parts = path.strip("/").split("/")
    for candidate in spec()["paths"]:
        pattern = candidate.strip("/").split("/")
        if len(pattern) == len(parts) and all(p == q or (p.startswith("{") and p.endswith("}"))
                                              for p, q in zip(pattern, parts)):
            return candidate
    return path


def response_pointer(path: str, method: str, status: int, media_type: str = "application/json") -> str:
    """The JSON pointer of an operation's response schema for a status (a 4xx/5xx: ErrorResponse,
    whether or not the operation lists that status: the specification lists few)."""
    if status >= 400:
        return schema_pointer("ErrorResponse")
    op_path = _operation_path(path)
    ops = spec()["paths"].get(op_path)
    if ops is None or method.lower() not in ops:
        raise KeyError(f"the specification has no operation {method.upper()} {op_path}")
    responses = ops[method.lower()]["responses"]
    if str(status) not in responses:
        raise KeyError(f"{method.upper()} {op_path} has no response {status} in the specification "
                       f"(it lists {sorted(responses)})")
    response = responses[str(status)]
    base = f"#/paths/{_escape(op_path)}/{method.lower()}/responses/{status}"
    if "$ref" in response:  # a components/responses entry (OpenAPI's reference, not a schema's)
        base = response["$ref"]
        response = _at(base)
    if media_type not in response.get("content", {}):
        raise KeyError(f"{method.upper()} {op_path} {status} has no {media_type} body in the specification")
    return f"{base}/content/{_escape(media_type)}/schema"


def request_properties(name: str) -> dict[str, list[str]]:
    """A request schema's properties, through its allOf and $refs: {field: the JSON pointers of its
    schemas} (more than one where parts of an allOf each have it: a value must pass them all)."""
    out: dict[str, list[str]] = {}

    def walk(pointer: str) -> None:
        node = _at(pointer)
        if "$ref" in node:
            walk(node["$ref"])
        for i, _ in enumerate(node.get("allOf", ())):
            walk(f"{pointer}/allOf/{i}")
        for field in node.get("properties", {}):
            out.setdefault(field, []).append(f"{pointer}/properties/{_escape(field)}")

    walk(schema_pointer(name))
    return out


def field_accepts(schema_name: str, field: str, value) -> bool:
    """Whether the request schema's field takes this value (every schema the field has there)."""
    return all(validator(p).is_valid(value) for p in request_properties(schema_name)[field])


def _at(pointer: str):
    node = spec()
    for part in pointer.lstrip("#/").split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def problems(pointer: str, instance) -> list[str]:
    """Every place the instance breaks the schema: 'where: what (schema: its path)'. Of an anyOf or
    oneOf that nothing matched, the errors of the branch that matched furthest (a null branch's
    "is not of type 'null'" says little)."""
    out = []
    for error in validator(pointer).iter_errors(instance):
        for leaf in _leaves(error):
            where = "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in leaf.absolute_path) or "(root)"
            schema_at = "/".join(str(p) for p in leaf.absolute_schema_path)
            out.append(f"{where}: {leaf.message} (schema: {schema_at})")
    return out


def _leaves(error) -> list:
    if not error.context:
        return [error]
    branches: dict = {}
    for e in error.context:
        branches.setdefault(e.schema_path[0], []).append(e)
    best = max(branches.values(), key=lambda errs: (max(len(e.absolute_path) for e in errs), -len(errs)))
    return [leaf for e in best for leaf in _leaves(e)]


def _check(pointer: str, instance, what: str) -> None:
    found = problems(pointer, instance)
    if found:
        body = json.dumps(instance)
        raise AssertionError(f"{what} breaks the OpenAI specification ({pointer}):\n  " + "\n  ".join(found) +
                             f"\nbody: {body[:2000]}{'...' if len(body) > 2000 else ''}")


def validate_response(path: str, method: str, status: int, body) -> None:
    """body (parsed JSON) against the specification's schema for this operation and status."""
    _check(response_pointer(path, method, status), body, f"{method.upper()} {path} -> {status}")


def validate_chunk(kind: str, chunk: dict) -> None:
    """One parsed SSE `data:` chunk of a stream (kind 'chat' or 'completion'), against chunk_pointer's schema."""
    _check(chunk_pointer(kind, chunk), chunk, f"a {kind} stream chunk")


def sse_chunks(text: str) -> list[dict]:
    """The parsed `data:` chunks of an event stream's text, up to its closing `data: [DONE]` (which
    must be there, last, once)."""
    events = [e for e in text.replace("\r\n", "\n").split("\n\n") if e.strip()]
    assert events and events[-1].strip() == "data: [DONE]", \
        f"the stream does not end with data: [DONE]: {text[-300:]!r}"
    chunks = []
    for event in events[:-1]:
        data = [line[len("data:"):].lstrip(" ") for line in event.split("\n") if line.startswith("data:")]
        assert data, f"an event without data: {event!r}"
        payload = "\n".join(data)
        assert payload != "[DONE]", "data: [DONE] before the stream's end"
        chunks.append(json.loads(payload))
    return chunks


def _event_data(event: bytes) -> str | None:
    lines = [line[len(b"data:"):].lstrip(b" ") for line in event.replace(b"\r\n", b"\n").split(b"\n")
             if line.startswith(b"data:")]
    return b"\n".join(lines).decode() if lines else None


class CheckingTransport(httpx.BaseTransport):
    """An httpx transport that checks every /v1/ answer passing through it against the specification
    (a whole JSON body when it arrives; an event stream chunk by chunk, as far as it is read) and
    keeps what it finds in `found`, for the test to assert on (raising inside a client, such as
    openai's, would come out as a connection error). Wire it in with
    httpx.Client(transport=CheckingTransport()), e.g. as openai.OpenAI(http_client=...)."""

    def __init__(self, inner: httpx.BaseTransport | None = None):
        self.inner = inner or httpx.HTTPTransport()
        self.found: list[str] = []
        self.checked = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        path, method = request.url.path, request.method
        ctype = response.headers.get("content-type", "")
        if not path.startswith("/v1/") or response.headers.get("content-encoding"):
            return response
        if ctype.startswith("text/event-stream"):
            end = path.rstrip("/")
            kind = "chat" if end.endswith("/chat/completions") else "responses" if end.endswith("/responses") else \
                "completion"
            response.stream = _CheckedEvents(response.stream, kind, self)
        elif ctype.startswith("application/json"):
            data = b"".join(response.stream)
            response.stream.close()
            self._check(lambda: validate_response(path, method, response.status_code, json.loads(data)))
            response = httpx.Response(response.status_code, headers=response.headers, stream=httpx.ByteStream(data),
                                      request=request, extensions=response.extensions)
        return response

    def _check(self, check) -> None:
        self.checked += 1
        try:
            check()
        except (AssertionError, KeyError, ValueError) as e:
            self.found.append(str(e))

    def assert_clean(self) -> None:
        assert not self.found, f"{len(self.found)} answers broke the specification:\n" + "\n".join(self.found)

    def close(self) -> None:
        self.inner.close()


class _CheckedEvents(httpx.SyncByteStream):
    """An event stream's bytes, passed on as they come, each complete event's chunk checked."""

    def __init__(self, stream, kind: str, owner: CheckingTransport):
        self.stream, self.kind, self.owner, self.buffer = stream, kind, owner, b""

    def __iter__(self):
        for part in self.stream:
            self.buffer += part
            while True:
                normalized = self.buffer.replace(b"\r\n", b"\n")
                if b"\n\n" not in normalized:
                    break
                event, _, self.buffer = normalized.partition(b"\n\n")
                payload = _event_data(event)
                if payload is not None and payload != "[DONE]":
                    self.owner._check(lambda: validate_chunk(self.kind, json.loads(payload)))
            yield part

    def close(self) -> None:
        self.stream.close()

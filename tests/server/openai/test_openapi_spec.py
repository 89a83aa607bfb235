"""The HTTP door against OpenAI's own OpenAPI specification (tests/data/openai-openapi.yaml, pinned;
tests/openai_spec.py reads it): every response body and every SSE chunk of a realistic request
matrix validated against the specification's schemas, errors included; the request fields the
specification declares nullable taking null; wrongly typed fields refused; and a bounded, seeded
schemathesis fuzz of the specification's createCompletion and createChatCompletion operations
against pagoda (no 5xx, every body valid, every KV block free afterwards)."""
from __future__ import annotations

import collections
import json

import httpx
import pytest

from grpc_fixtures import InProcessServer, engine_config, slow_steps, tiny_checkpoint, wait_all_blocks_free
from openai_spec import CheckingTransport, chunk_pointer, field_accepts, problems, request_properties, \
    response_pointer, schema_pointer, spec, sse_chunks, validate_chunk, validate_response
from pagoda.client.client import Client
from pagoda.server.options import ServerOptions

pytestmark = pytest.mark.timeout(300)

MAX_MESSAGE_BYTES = 2**20  # small, so that the 413 case sends little


@pytest.fixture(scope="module")
def srv():
    s = InProcessServer.for_config(engine_config(tiny_checkpoint()),
                                   ServerOptions(http_port=0, max_message_bytes=MAX_MESSAGE_BYTES)).wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def model(srv):
    return httpx.get(srv.http_url + "/v1/models", timeout=30).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def grpc_client(srv):
    with Client(srv.target, timeout=60) as c:
        yield c


def call(srv, method: str, path: str, body=None, **kw):
    """One request; its body (or each of its SSE chunks) checked against the specification. Returns
    (response, parsed JSON body or the list of chunks)."""
    r = httpx.request(method, srv.http_url + path, json=body, timeout=60, **kw)
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        assert r.status_code == 200, r.status_code
        chunks = sse_chunks(r.text)
        kind = "chat" if path.endswith("/chat/completions") else "completion"
        for chunk in chunks:
            validate_chunk(kind, chunk)
        return r, chunks
    assert r.headers.get("content-type", "").startswith("application/json"), (r.status_code, r.headers, r.text[:500])
    parsed = r.json()
    validate_response(path, method, r.status_code, parsed)
    return r, parsed


# ---- the request matrix: every answer valid ----

COMPLETIONS = {
    "string prompt": dict(prompt="Hello world", max_tokens=8),
    "list of prompts": dict(prompt=["one", "two"], max_tokens=4),
    "token id prompts": dict(prompt=[[72, 105], [72]], max_tokens=4),
    "n=2": dict(prompt="Hello", n=2, max_tokens=4, temperature=0.8, seed=3),
    "logprobs=2": dict(prompt="Hello", max_tokens=6, logprobs=2),
    "logprobs=0": dict(prompt="Hello", max_tokens=3, logprobs=0),
    "echo": dict(prompt="Hello", max_tokens=4, echo=True),
    "echo with logprobs": dict(prompt="Hello", max_tokens=4, echo=True, logprobs=1),
    "stop": dict(prompt="Hello world", max_tokens=16, stop=["\n", "xyz"], temperature=0),
    "sampling fields": dict(prompt="Hello", max_tokens=4, temperature=1.2, top_p=0.9, presence_penalty=0.5,
                            frequency_penalty=-0.5, logit_bias={"70": 5}, user="someone"),
    "stream": dict(prompt="Hello", max_tokens=6, stream=True),
    "stream with include_usage": dict(prompt=["Hello", "Hi"], max_tokens=4, stream=True,
                                      stream_options={"include_usage": True}),
    "stream with include_usage false": dict(prompt="Hello", max_tokens=3, stream=True,
                                            stream_options={"include_usage": False}),
    "stream with logprobs": dict(prompt="Hello", max_tokens=6, stream=True, logprobs=2),
    "stream with echo": dict(prompt="Hello", max_tokens=3, stream=True, echo=True),
    "stream with n=2": dict(prompt="Hello", max_tokens=3, stream=True, n=2, temperature=1.0, seed=1),
    # pagoda's extras (vLLM's names): allowed where the schema leaves the object open
    "token_ids and prompt_logprobs": dict(prompt="Hello", max_tokens=3, return_token_ids=True, prompt_logprobs=1),
    "stream with token_ids": dict(prompt="Hello", max_tokens=3, stream=True, return_token_ids=True),
}

CHAT = {
    "plain": dict(messages=[{"role": "user", "content": "hi"}], max_tokens=6),
    "system and user": dict(messages=[{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": "hi"}], max_completion_tokens=6),
    "content parts": dict(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}], max_tokens=4),
    "developer and assistant turns": dict(messages=[{"role": "developer", "content": "be brief"},
                                                    {"role": "user", "content": "hi"},
                                                    {"role": "assistant", "content": "hello"},
                                                    {"role": "user", "content": "again"}], max_tokens=4),
    "logprobs and top_logprobs": dict(messages=[{"role": "user", "content": "hi"}], max_tokens=6, logprobs=True,
                                      top_logprobs=2),
    "logprobs without top_logprobs": dict(messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          logprobs=True),
    "n=2": dict(messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2, temperature=0.9, seed=5),
    "json_object": dict(messages=[{"role": "user", "content": "a JSON object"}], max_tokens=12,
                        response_format={"type": "json_object"}),
    "json_schema": dict(messages=[{"role": "user", "content": "a point"}], max_tokens=12,
                        response_format={"type": "json_schema", "json_schema": {
                            "name": "point", "strict": True,
                            "schema": {"type": "object", "properties": {"x": {"type": "integer"}},
                                       "required": ["x"], "additionalProperties": False}}}),
    "response_format text": dict(messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                 response_format={"type": "text"}),
    "stop and seed": dict(messages=[{"role": "user", "content": "hi"}], max_tokens=8, stop="\n", seed=7,
                          temperature=0.7),
    "stream": dict(messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True),
    "stream with include_usage": dict(messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
                                      stream_options={"include_usage": True}),
    "stream with logprobs": dict(messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
                                 logprobs=True, top_logprobs=1),
    "stream with n=2": dict(messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True, n=2,
                            temperature=1.0, seed=2),
    "token_ids": dict(messages=[{"role": "user", "content": "hi"}], max_tokens=3, return_token_ids=True),
}


@pytest.mark.parametrize("name", list(COMPLETIONS))
def test_completions_answers_follow_the_specification(srv, model, name):
    body = {"model": model, **COMPLETIONS[name]}
    r, out = call(srv, "POST", "/v1/completions", body)
    assert r.status_code == 200, out
    if body.get("stream"):
        assert_usage_chunk_last(body, out)


def assert_usage_chunk_last(body: dict, chunks: list) -> None:
    """With stream_options.include_usage, exactly one chunk carries usage: the last, with no choices."""
    usage = [c for c in chunks if c.get("usage")]
    want_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    assert len(usage) == want_usage and (not usage or usage[0] is chunks[-1] and chunks[-1]["choices"] == [])


@pytest.mark.parametrize("name", list(CHAT))
def test_chat_answers_follow_the_specification(srv, model, name):
    body = {"model": model, **CHAT[name]}
    r, out = call(srv, "POST", "/v1/chat/completions", body)
    assert r.status_code == 200, out
    if body.get("stream"):
        assert all(c["object"] == "chat.completion.chunk" for c in out)
        assert_usage_chunk_last(body, out)


def test_models_follow_the_specification(srv, model):
    r, out = call(srv, "GET", "/v1/models")
    assert r.status_code == 200 and out["data"][0]["id"] == model
    r = httpx.get(f"{srv.http_url}/v1/models/{model}", timeout=30)  # retrieveModel
    assert r.status_code == 200, r.text
    validate_response("/v1/models/{model}", "GET", 200, r.json())


def test_streamed_completion_logprobs_add_up_to_the_whole_ones(srv, model):
    """Beyond the schema (text_offset is any list of integers there): a stream's logprobs, chunk
    after chunk, are the whole response's, text_offset counting from the start of the choice's text,
    not of each chunk."""
    body = {"model": model, "prompt": "Hello", "max_tokens": 8, "temperature": 0, "logprobs": 1, "ignore_eos": True}
    _, whole = call(srv, "POST", "/v1/completions", body)
    _, chunks = call(srv, "POST", "/v1/completions", {**body, "stream": True})
    streamed = collections.defaultdict(list)
    for c in chunks:
        for choice in c["choices"]:
            if choice["logprobs"]:
                for key, values in choice["logprobs"].items():
                    streamed[key].extend(values)
    lp = whole["choices"][0]["logprobs"]
    assert streamed["tokens"] == lp["tokens"] and streamed["token_logprobs"] == lp["token_logprobs"]
    assert streamed["text_offset"] == lp["text_offset"], \
        f"a streamed completion's logprobs.text_offset must count from the start of the text, as the whole " \
        f"response's do: streamed {streamed['text_offset']}, whole {lp['text_offset']}"


def test_the_official_client_through_a_checking_transport(srv, model):
    """The `openai` client as test_http.py uses it, every answer checked on its way in
    (CheckingTransport): the same checks, wherever a test talks to the HTTP door."""
    import openai

    transport = CheckingTransport()
    with httpx.Client(transport=transport, timeout=60) as http:
        oai = openai.OpenAI(base_url=srv.http_url + "/v1", api_key="none", max_retries=0, http_client=http)
        assert oai.models.list().data[0].id == model
        out = oai.completions.create(model=model, prompt="Hello", max_tokens=4, logprobs=1)
        assert out.choices[0].logprobs.tokens
        streamed = list(oai.completions.create(model=model, prompt=["a", "b"], max_tokens=3, stream=True))
        chat = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           logprobs=True, top_logprobs=1)
        assert chat.choices[0].message.role == "assistant"
        chunks = list(oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=4, stream=True,
                                                  stream_options={"include_usage": True}))
        with pytest.raises(openai.NotFoundError):
            oai.completions.create(model="no-such-model", prompt="hi")
        with pytest.raises(openai.BadRequestError):
            oai.chat.completions.create(model=model, messages=[], max_tokens=2)
    assert transport.checked == 5 + len(streamed) + len(chunks), transport.checked  # every answer and chunk seen
    transport.assert_clean()


# ---- errors: every status an ErrorResponse ----

ERRORS = {
    "unknown field": (400, "POST", "/v1/completions", {"prompt": "hi", "bogus": 1}),
    "bad value": (400, "POST", "/v1/completions", {"prompt": "hi", "top_p": 1.5}),
    "missing field": (400, "POST", "/v1/chat/completions", {}),
    "empty messages": (400, "POST", "/v1/chat/completions", {"messages": []}),
    "chat unknown field": (400, "POST", "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "hi"}], "bogus": []}),
    "chat bad message": (400, "POST", "/v1/chat/completions", {"messages": [{"role": "user"}]}),
    "unknown model id": (404, "GET", "/v1/models/no-such-model", None),
    "unknown model": (404, "POST", "/v1/completions", {"model": "no-such-model", "prompt": "hi"}),
    "unknown model (chat)": (404, "POST", "/v1/chat/completions",
                             {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}),
    "no route": (404, "POST", "/v1/images/generations", {"prompt": "hi"}),
    "embeddings of a generation model": (400, "POST", "/v1/embeddings", {"input": "hi"}),
    "no route (GET)": (404, "GET", "/v1/no-such-thing", None),
    "wrong method": (405, "GET", "/v1/completions", None),
    "wrong method (chat)": (405, "DELETE", "/v1/chat/completions", None),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_errors_follow_the_specification(srv, model, name):
    status, method, path, body = ERRORS[name]
    if body is not None and "model" not in body and name != "missing field":
        body = {"model": model, **body}
    r, out = call(srv, method, path, body)
    assert r.status_code == status, (r.status_code, out)
    assert out["error"]["message"]


def test_invalid_json_is_a_valid_400(srv):
    r = httpx.post(srv.http_url + "/v1/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    validate_response("/v1/completions", "POST", 400, r.json())


def test_a_body_past_the_limit_is_a_valid_413(srv, model):
    r, out = call(srv, "POST", "/v1/completions", {"model": model, "prompt": "x" * (MAX_MESSAGE_BYTES + 1)})
    assert r.status_code == 413, out


def test_api_key_and_full_queue_errors_follow_the_specification():
    """401 without the key; 429 when one request runs and the queue's one place is taken."""
    s = InProcessServer.for_config(engine_config(tiny_checkpoint(), num_kv_blocks=32, max_num_seqs=1,
                                                 max_queue_len=1),
                                   ServerOptions(http_port=0, api_key="sekret")).wait_ready()
    try:
        for headers in ({}, {"authorization": "Bearer wrong"}):
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions")):
                r, out = call(s, method, path, {"prompt": "hi"} if method == "POST" else None, headers=headers)
                assert r.status_code == 401, out
        key = {"authorization": "Bearer sekret"}
        _, models = call(s, "GET", "/v1/models", headers=key)
        body = {"model": models["data"][0]["id"], "prompt": "hi", "max_tokens": 300, "ignore_eos": True,
                "stream": True}
        with slow_steps(s.engine, 0.02), httpx.Client(base_url=s.http_url, headers=key, timeout=60) as h:
            with h.stream("POST", "/v1/completions", json=body) as running:
                lines = running.iter_lines()  # kept: a dropped iterator closes the connection (an abort)
                assert next(lines).startswith("data: {")  # it has a token: running, not waiting
                with h.stream("POST", "/v1/completions", json=body) as waiting:  # admitted: its headers came
                    assert waiting.status_code == 200
                    r, out = call(s, "POST", "/v1/completions", body, headers=key)
                    assert r.status_code == 429, out
                    chat = {k: v for k, v in body.items() if k != "prompt"}
                    r, out = call(s, "POST", "/v1/chat/completions",
                                  {**chat, "messages": [{"role": "user", "content": "hi"}]}, headers=key)
                    assert r.status_code == 429, out
        with Client(s.target, timeout=30, api_key="sekret") as c:
            wait_all_blocks_free(c)
    finally:
        s.stop()


# ---- request fields as the specification types them ----

REQUESTS = {"/v1/completions": "CreateCompletionRequest", "/v1/chat/completions": "CreateChatCompletionRequest"}


def _ids(cases) -> list[str]:
    return ["-".join(["chat" if "/chat/" in c[0] else "completions", *(repr(v) if i > 1 else str(v)
                                                                      for i, v in enumerate(c) if i)])
            for c in cases]


def _nullable_fields(path: str) -> list[str]:
    name = REQUESTS[path]
    # prompt: required, yet nullable (null meaning its default, "<|endoftext|>"): not a field to leave out
    return [f for f in request_properties(name) if f not in ("model", "prompt") and field_accepts(name, f, None)]


def _small_request(model: str, path: str, field: str) -> dict:
    body = {"model": model, "max_tokens": 3} if field != "max_tokens" else {"model": model}
    if path == "/v1/completions":
        return {**body, "prompt": "hi"}
    if field == "max_tokens":
        body["max_completion_tokens"] = 3
    return {**body, "messages": [{"role": "user", "content": "hi"}]}


NULLABLE = [(path, f) for path in REQUESTS for f in _nullable_fields(path)]


@pytest.mark.parametrize("path,field", NULLABLE, ids=_ids(NULLABLE))
def test_null_for_a_nullable_field_is_its_default(srv, model, path, field):
    """The specification lets these fields be null (meaning: not given). A field pagoda does not take
    at all may be refused as unknown (a 400 naming it); one it takes must take null too."""
    r, out = call(srv, "POST", path, {**_small_request(model, path, field), field: None})
    if r.status_code == 400 and out["error"]["message"].startswith("unknown field"):
        assert out["error"]["param"] == field
        return
    assert r.status_code == 200, f"{field}: null (the specification's 'not given') was refused: {out}"


WRONG_TYPES = [
    ("/v1/completions", "max_tokens", "16"), ("/v1/completions", "n", "2"), ("/v1/completions", "logprobs", "1"),
    ("/v1/completions", "temperature", "0.5"), ("/v1/completions", "echo", "true"),
    ("/v1/completions", "stream", 1), ("/v1/completions", "seed", 1.5),
    ("/v1/chat/completions", "max_completion_tokens", "4"), ("/v1/chat/completions", "logprobs", "true"),
    ("/v1/chat/completions", "top_logprobs", "2"), ("/v1/chat/completions", "n", True),
]


@pytest.mark.parametrize("path,field,value", WRONG_TYPES, ids=_ids(WRONG_TYPES))
def test_a_wrongly_typed_field_is_a_400_naming_it(srv, model, path, field, value):
    """The specification's types are JSON's: a string is not an integer, nor 1 a boolean (pydantic's
    lax coercion would take "16" as 16)."""
    assert not field_accepts(REQUESTS[path], field, value), "the test's premise: the specification refuses it"
    body = _small_request(model, path, field)
    r, out = call(srv, "POST", path, {**body, field: value})
    assert r.status_code == 400 and out["error"]["param"] == field, \
        f"{field}: {json.dumps(value)} is not what the specification types it as, and must be refused: {out}"


ALLOWED = [
    ("/v1/completions", "n", 1.0),  # JSON Schema's integer: any number with no fractional part
    ("/v1/completions", "logprobs", 2.0), ("/v1/chat/completions", "max_completion_tokens", 3.0),
    ("/v1/completions", "top_p", 0), ("/v1/chat/completions", "top_p", 0.0),  # minimum 0
    ("/v1/completions", "seed", -1), ("/v1/chat/completions", "seed", -(2**63)),  # int64
    ("/v1/completions", "temperature", 2), ("/v1/completions", "logit_bias", {}),
    ("/v1/completions", "stop", ["a", "b", "c", "d"]),  # maxItems 4
]


@pytest.mark.parametrize("path,field,value", ALLOWED, ids=_ids(ALLOWED))
def test_a_value_the_specification_allows_is_taken(srv, model, path, field, value):
    """Values at the edges of the specification's types and ranges are valid requests."""
    assert field_accepts(REQUESTS[path], field, value), "the test's premise: the specification allows it"
    r, out = call(srv, "POST", path, {**_small_request(model, path, field), field: value})
    assert r.status_code == 200, f"{field}: {json.dumps(value)} is within the specification and was refused: {out}"


def test_max_tokens_zero_is_allowed(srv, model):
    """CreateCompletionRequest.max_tokens has minimum 0."""
    assert field_accepts("CreateCompletionRequest", "max_tokens", 0)
    for echo in (False, True):
        r, out = call(srv, "POST", "/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": 0,
                                                       "echo": echo})
        assert r.status_code == 200, f"max_tokens: 0 is within the specification (minimum 0): {out}"
        assert out["usage"]["completion_tokens"] == 0 and out["choices"][0]["text"] == ("Hello" if echo else "")


def test_the_checker_itself():
    """openai_spec reads nullable as "or null" and finds what it should."""
    chunk = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"content": "a"}, "logprobs": None, "finish_reason": None}],
             "usage": None}
    assert problems(schema_pointer("CreateChatCompletionStreamResponse"), chunk) == []  # nullable: true fields
    bad = {**chunk, "choices": [{**chunk["choices"][0], "finish_reason": "eos"}]}
    assert any("finish_reason" in p for p in problems(schema_pointer("CreateChatCompletionStreamResponse"), bad))
    assert problems(schema_pointer("ErrorResponse"), {"error": {"message": "m", "type": "t", "param": None,
                                                                "code": None}}) == []
    assert problems(schema_pointer("ErrorResponse"), {"error": {"message": "m", "type": "t", "param": None,
                                                                "code": 400}})
    assert response_pointer("/v1/completions", "POST", 429).endswith("/ErrorResponse")
    assert spec()["info"]["version"] == "2.3.0"
    bad_error = {"error": {"message": "m", "type": "t", "param": None, "code": 400}}
    bad_chunk = {"id": "x", "object": "text_completion", "created": 1, "model": "m", "choices": [{"index": 0}]}

    class Parts(httpx.SyncByteStream):  # arriving as a server sends it, an event split across parts
        def __iter__(self):
            text = f"data: {json.dumps(bad_chunk)}\n\ndata: [DONE]\n\n".encode()
            yield from (text[:20], text[20:])

    def answer(request):
        if request.url.path == "/v1/completions":
            return httpx.Response(200, stream=Parts(), headers={"content-type": "text/event-stream"})
        return httpx.Response(400, json=bad_error)

    transport = CheckingTransport(httpx.MockTransport(answer))
    with httpx.Client(transport=transport, base_url="http://test") as client:
        assert client.get("/v1/models").status_code == 400
        assert len(client.post("/v1/completions").text) > 10
    assert transport.checked == 2 and len(transport.found) == 2, transport.found
    assert "error.code" in transport.found[0] and "finish_reason" in transport.found[1]
    with pytest.raises(AssertionError):
        transport.assert_clean()
    assert "n" in _nullable_fields("/v1/completions") and "n" in _nullable_fields("/v1/chat/completions")
    assert not field_accepts("CreateChatCompletionRequest", "top_logprobs", None)  # one part of its allOf says so


# ---- the fuzz ----

FUZZ_EXAMPLES = 600  # requests: about 15 s on two cores
FUZZ_SEED = 24
CAP_TOKENS, CAP_N, CAP_PROMPTS = 4, 2, 4


def _cheap(body, path: str):
    """Caps what a generated body asks to generate (max tokens, n, prompts): a request stays a few
    milliseconds of the tiny model's time. Types and other values are left as generated."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for key in ("max_tokens", "max_completion_tokens"):
        if type(body.get(key)) in (int, float) and body[key] > CAP_TOKENS:
            body[key] = CAP_TOKENS
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = CAP_TOKENS  # chat's default is the rest of the context
    if type(body.get("n")) in (int, float) and body["n"] > CAP_N:
        body["n"] = CAP_N
    prompt = body.get("prompt")
    if path.endswith("/completions") and isinstance(prompt, list) and len(prompt) > CAP_PROMPTS:
        body["prompt"] = prompt[:CAP_PROMPTS]
    return body


def test_fuzz_the_specification_operations_against_pagoda(srv, model, grpc_client):
    """schemathesis draws createCompletion and createChatCompletion requests from the specification,
    seeded: valid ones (from its objects closed: _closed_spec), with the served model, half of them
    without the top-level fields pagoda does not take, a third streamed; and invalid ones. Each is made
    cheap (_cheap: a few tokens, n <= 2, 4 prompts at most). Pagoda answers none with a 5xx, every
    answer is valid (errors as ErrorResponse, streams chunk by chunk), and no KV block is left taken.
    Valid requests refused (a 400 naming the field) are not failures: pagoda takes a subset."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, seed, settings
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    # valid requests from the specification with its objects closed (no fields it does not declare,
    # which pagoda would refuse as unknown), invalid ones from the specification as it is
    sources = {GenerationMode.POSITIVE: schemathesis.openapi.from_dict(_closed_spec()),
               GenerationMode.NEGATIVE: schemathesis.openapi.from_dict(spec())}
    operations = ("/completions", "/chat/completions")
    taken = {"/completions": _fields_pagoda_takes("CompletionRequest"),
             "/chat/completions": _fields_pagoda_takes("ChatRequest")}
    strategies = {(path, mode): source[path]["POST"].as_strategy(generation_mode=mode)
                  for path in operations for mode, source in sources.items()}
    failures: dict[str, tuple[int, str]] = {}  # one example per kind of failure
    statuses = collections.Counter()
    accepted = []  # requests the specification calls invalid that pagoda answered (not a failure: shown)

    def fail(kind: str, case, status: int) -> None:
        if kind not in failures:
            failures[kind] = (status, json.dumps(case.body, default=repr)[:600])

    @seed(FUZZ_SEED)
    @settings(max_examples=FUZZ_EXAMPLES, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(st.data())
    def run(data):
        path = data.draw(st.sampled_from(operations), label="operation")
        mode = data.draw(st.sampled_from([GenerationMode.POSITIVE, GenerationMode.POSITIVE,
                                          GenerationMode.NEGATIVE]), label="mode")
        case = data.draw(strategies[(path, mode)], label="case")
        if mode is GenerationMode.POSITIVE and isinstance(case.body, dict):
            case.body = dict(case.body, model=model)
            if data.draw(st.booleans(), label="only fields pagoda takes"):
                # the specification's fields pagoda does not take (and, in chat's allOf, fields it does not
                # declare) are refused as unknown: leave them out, and go further
                case.body = {k: v for k, v in case.body.items() if k in taken[path]}
            if data.draw(st.integers(0, 2), label="streamed") == 0:  # a third of the valid ones streamed
                case.body["stream"] = True
        case.body = _cheap(case.body, path)
        response = case.call(base_url=srv.http_url + "/v1", timeout=60)
        status = response.status_code
        headers = {k.lower(): v[0] if isinstance(v, list) else v for k, v in response.headers.items()}
        streamed = headers.get("content-type", "").startswith("text/event-stream")
        statuses[(path, mode.value, status, "stream" if streamed else "json")] += 1
        if mode is GenerationMode.NEGATIVE and status < 300:
            accepted.append(json.dumps(case.body, default=repr)[:300])
        if status >= 500:
            fail(f"{status} {path}: {response.content[:300]!r}", case, status)
            return
        try:
            if streamed:
                text = response.content.decode()
                if response.stream_cut_short and not text.rstrip().endswith("data: [DONE]"):
                    text += "\n\ndata: [DONE]\n\n"  # schemathesis reads 20 events at most: check those
                kind = "chat" if path == "/chat/completions" else "completion"
                for chunk in sse_chunks(text):
                    for p in problems(chunk_pointer(kind, chunk), chunk):
                        fail(f"{status} {path} stream chunk: {_general(p)}", case, status)
            else:
                body = json.loads(response.content)
                for p in problems(response_pointer("/v1" + path, "POST", status), body):
                    fail(f"{status} {path}: {_general(p)}", case, status)
        except (AssertionError, ValueError, KeyError) as e:
            fail(f"{status} {path}: {type(e).__name__}: {str(e)[:200]}", case, status)

    run()
    wait_all_blocks_free(grpc_client, timeout=30)
    summary = ", ".join(f"{p} {m} {s} {k}: {n}" for (p, m, s, k), n in sorted(statuses.items()))
    print(f"fuzz statuses: {summary}")
    print("invalid requests answered:" + "".join(f"\n  {body}" for body in accepted))
    assert not failures, f"{len(failures)} kinds of failure in {FUZZ_EXAMPLES} requests (statuses: {summary}):\n" + \
        "\n".join(f"- {kind}\n    request: {body}" for kind, (_, body) in failures.items())
    for path in operations:  # the fuzz went as far as generating, whole and streamed
        for kind in ("json", "stream"):
            assert statuses[(path, "positive", 200, kind)] > 0, f"no {kind} 200 for {path}: {summary}"


def _closed_spec() -> dict:
    """The specification with every object schema that lists its properties closed to others
    (additionalProperties: false), an allOf of objects first merged into one object (closing its
    parts apart would leave nothing valid; a property two parts have must pass both): what this
    generates is valid under the specification as it is."""
    doc = spec()
    schemas = doc["components"]["schemas"]

    def resolve(node):
        while isinstance(node, dict) and "$ref" in node and len(node) == 1:
            node = schemas[node["$ref"].rsplit("/", 1)[1]]
        return node

    def merged(node) -> dict | None:
        """An allOf of object schemas as one object schema; None where a part is something else."""
        parts = [flat(resolve(p)) for p in node["allOf"]]
        if not all(isinstance(p, dict) and isinstance(p.get("properties"), dict) and
                   not {"$ref", "allOf", "anyOf", "oneOf", "not"} & set(p) for p in parts):
            return None
        out = {k: v for k, v in node.items() if k != "allOf"}
        properties, required = dict(out.get("properties", {})), list(out.get("required", []))
        for p in parts:
            for name, schema in p["properties"].items():
                properties[name] = {"allOf": [properties[name], schema]} if name in properties else schema
            required += [r for r in p.get("required", []) if r not in required]
        return {**out, "type": "object", "properties": properties, **({"required": required} if required else {})}

    def flat(node):
        if isinstance(node, dict) and isinstance(node.get("allOf"), list):
            return merged(node) or node
        return node

    def close(node):
        if isinstance(node, list):
            return [close(v) for v in node]
        if not isinstance(node, dict):
            return node
        node = flat(node)
        out = {}
        for k, v in node.items():
            if k == "properties" and isinstance(v, dict):
                out[k] = {name: close(schema) for name, schema in v.items()}
            elif k == "allOf" and isinstance(v, list):  # not merged: its parts stay open
                out[k] = [close_inside(part) for part in v]
            else:
                out[k] = close(v)
        if isinstance(node.get("properties"), dict) and "additionalProperties" not in node:
            out["additionalProperties"] = False
        return out

    def close_inside(part):
        closed = close(part)
        if isinstance(part, dict) and "additionalProperties" not in part and isinstance(closed, dict):
            closed.pop("additionalProperties", None)
        return closed

    return {**doc, "components": {**doc["components"], "schemas": {n: close(s) for n, s in schemas.items()}}}


def _general(problem: str) -> str:
    """A problem without its list indexes, so that one kind of failure is reported once."""
    import re

    return re.sub(r"\[\d+\]", "[i]", problem.split(" (schema")[0])


def _fields_pagoda_takes(model_name: str) -> set[str]:
    from pagoda.server.openai import protocol

    return set(getattr(protocol, model_name).model_fields)

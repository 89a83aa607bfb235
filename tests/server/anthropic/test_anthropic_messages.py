"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API) through the `anthropic` SDK
and raw HTTP: text whole and streamed alike, in Anthropic's event order; tool_use blocks (their input
valid, streamed as input_json_delta) and the tool_result turn back; thinking blocks (a reasoning
template); usage and count_tokens; stop sequences; errors naming the field; the API key; Claude
Code's habits (?beta=true, its headers, beta fields)."""
import asyncio
import json
import re

import anthropic
import httpx
import jsonschema
import pytest

from grpc_fixtures import InProcessServer, engine_config, wait_all_blocks_free
from pagoda.client.client import Client
from pagoda.engine.errors import EngineError, InvalidRequestError, QueueFullError
from pagoda.engine.outputs import RequestOutput
from pagoda.server.anthropic.convert import to_chat
from pagoda.server.anthropic.errors import ANTHROPIC
from pagoda.server.anthropic.messages import _matched_stop, _stop_reason
from pagoda.server.anthropic.protocol import MessagesRequest
from pagoda.server.chat.tools import ToolCall
from pagoda.server.options import ServerOptions
from tool_templates import build_tool_checkpoint, tool_server

pytestmark = pytest.mark.timeout(300)

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]
HI = [{"role": "user", "content": "Grüß dich, 東京"}]
GREEDY = {"temperature": 0}  # this SDK has no sampling arguments: they go as extra fields
# Anthropic's stream: message_start, a ping, each block's start, deltas and stop, message_delta, message_stop
EVENT_ORDER = re.compile(r"message_start ping (content_block_start (content_block_delta )*content_block_stop )*"
                         r"message_delta message_stop")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with tool_server(tmp_path_factory, "qwen", num_kv_blocks=256) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return anthropic.Anthropic(base_url=srv.http_url, api_key="x", max_retries=0, timeout=120)


def raw_events(srv, body: dict, path: str = "/v1/messages", headers: dict | None = None) -> list[tuple[str, dict]]:
    """A streamed call's (event name, data) pairs, read off the wire."""
    events, name = [], None
    with httpx.Client(base_url=srv.http_url, timeout=120) as h, \
            h.stream("POST", path, json={**body, "stream": True}, headers=headers) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name
                events.append((name, data))
    return events


def check_order(events) -> None:
    assert EVENT_ORDER.fullmatch(" ".join(name for name, _ in events)), [n for n, _ in events]
    starts = [d["index"] for n, d in events if n == "content_block_start"]
    assert starts == list(range(len(starts)))


def test_a_request_as_the_chat_request_it_means():
    """system a system message; tool_use blocks the assistant's tool_calls; a user turn's tool_results tool
    messages (named after their call), before its text; thinking left out; tools and tool_choice OpenAI's."""
    args = {"city": "Köln", "unit": "c"}
    turns = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": [
                 {"type": "thinking", "thinking": "hm", "signature": ""}, {"type": "text", "text": "Let me see."},
                 {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": args}]},
             {"role": "user", "content": [
                 {"type": "text", "text": "Thanks."},
                 {"type": "tool_result", "tool_use_id": "toolu_1", "content": "12°C", "is_error": True}]}]
    body = MessagesRequest(model="m", max_tokens=8, messages=turns, stop_sequences=["END"],
                           system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B"}], tools=TOOLS,
                           tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                           thinking={"type": "disabled"})
    chat, thinking = to_chat(body)
    written = json.dumps(args, ensure_ascii=False)
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "A\nB"}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me see.", "tool_calls": [{"id": "toolu_1", "type": "function",
                                                                         "function": {"name": "get_weather",
                                                                                      "arguments": written}}]},
        {"role": "tool", "content": "12°C", "tool_call_id": "toolu_1", "name": "get_weather"},
        {"role": "user", "content": "Thanks."}]
    assert chat.tools == [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                                            "description": "Weather in a city"}}]
    assert (chat.tool_choice, chat.parallel_tool_calls) == ({"type": "function", "function": {"name": "get_weather"}},
                                                            False)
    assert (chat.stop, chat.include_stop_str_in_output, chat.max_tokens, thinking) == (["END"], True, 8, False)
    with pytest.raises(InvalidRequestError) as e:
        to_chat(MessagesRequest(model="m", max_tokens=8, messages=[{"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}]))
    assert e.value.field == "messages[0].content[0].input"


def test_stop_reasons():
    """The engine's finish as Anthropic's stop reason; the time limit cuts short as max_tokens does; the
    context's end before max_tokens is model_context_window_exceeded."""
    body = MessagesRequest(model="m", max_tokens=8, messages=HI)

    def out(finish, reason, text="abcEND", n=8):
        return RequestOutput("r", [], text, finished=True, finish_reason=finish, stop_reason=reason,
                             num_generated_tokens=n)
    call = [ToolCall("f", "{}")]
    assert [_stop_reason(body, out(*r), calls) for r, calls in [
        (("stop", "eos"), []), (("stop", "grammar"), call), (("length", "length"), call),
        (("time_limit", "time_limit"), []), (("stop", "stop_string"), []), (("length", "length", "a", 3), [])]] == \
        ["end_turn", "tool_use", "max_tokens", "max_tokens", "stop_sequence", "model_context_window_exceeded"]
    assert _matched_stop(out("stop", "stop_string"), "abcEND", ["ND", "END", "x"]) == "END"
    assert _matched_stop(out("stop", "eos"), "abcEND", ["END"]) is None


def test_a_full_queue_and_a_failed_stream_in_anthropics_shapes():
    """A full queue is Anthropic's 529 overloaded_error; an error after the stream began, an `error` event."""
    r = ANTHROPIC.error_for(QueueFullError("the queue is full", retry_after=2))
    assert (r.status_code, r.headers["retry-after"]) == (529, "2")
    assert json.loads(r.body)["error"]["type"] == "overloaded_error"

    async def chunks():
        yield {"type": "ping"}
        raise EngineError("the step failed")

    async def events():
        return [e async for e in ANTHROPIC.events(chunks(), {})]
    ping, error = asyncio.run(events())
    assert ping == b'event: ping\ndata: {"type":"ping"}\n\n'
    name, data = error.decode().strip().split("\n")
    assert name == "event: error" and json.loads(data.removeprefix("data: "))["type"] == "error"


def test_text_whole_and_streamed(client, srv):
    kw = dict(model="m", max_tokens=12, system="Be brief.", messages=HI, extra_body=GREEDY)
    whole = client.messages.create(**kw)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_") and whole.model == "m"
    assert whole.stop_reason == "max_tokens" and whole.stop_sequence is None
    assert [b.type for b in whole.content] == ["text"] and whole.usage.output_tokens == 12
    assert whole.usage.cache_creation_input_tokens == 0
    events = list(client.messages.create(**kw, stream=True))
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == whole.content[0].text
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 12
    raw = raw_events(srv, {"model": "m", "max_tokens": 12, "system": "Be brief.", "messages": HI, **GREEDY})
    check_order(raw)
    start = raw[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"] == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    with client.messages.stream(**kw) as stream:
        assert stream.get_final_text() == whole.content[0].text
    final = stream.get_final_message()
    assert final.stop_reason == "max_tokens" and [b.text for b in final.content] == [whole.content[0].text]
    wait_all_blocks_free(Client(srv.target, timeout=30))


def tool_calls(client, srv, choice: dict, extra: dict):
    """A call of get_weather whole and streamed (seeded alike), valid; stop_reason tool_use."""
    kw = dict(model="m", max_tokens=300, messages=[{"role": "user", "content": "Weather in Köln?"}], tools=TOOLS,
              tool_choice={**choice, "disable_parallel_tool_use": True}, extra_body={"temperature": 1.0, **extra})
    whole = client.messages.create(**kw)
    uses = [b for b in whole.content if b.type == "tool_use"]
    assert whole.stop_reason == "tool_use" and len(uses) == 1, whole
    assert uses[0].name == "get_weather" and re.fullmatch("toolu_[0-9a-f]+", uses[0].id)
    jsonschema.validate(uses[0].input, WEATHER)
    raw = raw_events(srv, {**{k: v for k, v in kw.items() if k != "extra_body"}, **kw["extra_body"]})
    check_order(raw)
    blocks = [d["content_block"] for n, d in raw if n == "content_block_start"]
    assert blocks[-1]["type"] == "tool_use" and blocks[-1]["input"] == {}
    partial = [d["delta"]["partial_json"] for n, d in raw if n == "content_block_delta"
               and d["delta"]["type"] == "input_json_delta"]
    assert len(partial) >= 3 and json.loads("".join(partial)) == uses[0].input  # in pieces, as they come
    assert raw[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(uses[0].name, uses[0].input)]
    return whole


@pytest.mark.parametrize("choice", ["any", "tool", "auto"])
def test_tool_use_whole_and_streamed(client, srv, choice):
    """any and a named tool constrain the answer to a call; auto is pushed into one (the trigger's bias)."""
    tc = {"type": choice, **({"name": "get_weather"} if choice == "tool" else {})}
    trigger = str(srv.engine.tokenizer.convert_tokens_to_ids("<tool_call>"))
    for seed in range(2):
        tool_calls(client, srv, tc, {"seed": seed, **({"logit_bias": {trigger: 100}} if choice == "auto" else {})})


def test_tool_result_round_trip(client, srv):
    """The SDK's own content sent back (its objects, and dumped), then the result as a tool_result."""
    whole = tool_calls(client, srv, {"type": "any"}, {"seed": 5})
    use = whole.content[-1]

    def conversation(content, result: dict) -> list:
        return [{"role": "user", "content": "Weather in Köln?"}, {"role": "assistant", "content": content},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, **result},
                                             {"type": "text", "text": "Und morgen?"}]}]
    for content in (whole.content, [b.model_dump() for b in whole.content]):
        messages = conversation(content, {"content": [{"type": "text", "text": "12°C"}]})
        nxt = client.messages.create(model="m", max_tokens=4, messages=messages, tools=TOOLS,
                                     tool_choice={"type": "none"})
        assert nxt.stop_reason in ("max_tokens", "end_turn") and all(b.type == "text" for b in nxt.content)
        counted = client.messages.count_tokens(model="m", messages=messages, tools=TOOLS).input_tokens
        assert counted == nxt.usage.input_tokens + nxt.usage.cache_read_input_tokens
        # the result is rendered: a longer one makes a longer prompt
        longer = conversation(content, {"content": "12°C, sunny and warm", "is_error": False})
        assert client.messages.count_tokens(model="m", messages=longer, tools=TOOLS).input_tokens > counted
    wait_all_blocks_free(Client(srv.target, timeout=30))


def test_count_tokens_and_the_prefix_cache(client, srv):
    """count_tokens is the prompt a call renders: input_tokens plus those read from the cache (Anthropic's
    input_tokens leave those out); a repeated long prompt is read from the prefix cache."""
    long = [{"role": "user", "content": "Erzähl mir von Köln und 東京. " * 40}]
    counted = client.messages.count_tokens(model="m", messages=long, system=[{"type": "text", "text": "Be brief."}])
    assert counted.input_tokens > 300
    usages = [client.messages.create(model="m", max_tokens=2, messages=long, system="Be brief.").usage
              for _ in range(2)]
    assert all(u.input_tokens + u.cache_read_input_tokens == counted.input_tokens for u in usages)
    assert usages[1].cache_read_input_tokens > 0 and usages[1].input_tokens < counted.input_tokens
    with_tools = client.messages.count_tokens(model="m", messages=long, tools=TOOLS).input_tokens
    assert with_tools > counted.input_tokens
    r = client.messages.create(model="m", max_tokens=2, messages=long, tools=TOOLS, tool_choice={"type": "auto"})
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == with_tools


def test_stop_sequences(client, srv):
    kw = dict(model="m", max_tokens=16, messages=HI, extra_body=GREEDY)
    text = client.messages.create(**kw).content[0].text
    stop = next(text[i:i + 2] for i in range(3, len(text)) if "\ufffd" not in text[i:i + 2])  # whole characters
    cut = text[:text.find(stop)]
    r = client.messages.create(**kw, stop_sequences=["§never§", stop])
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", stop)
    assert "".join(b.text for b in r.content) == cut
    raw = raw_events(srv, {"model": "m", "max_tokens": 16, "messages": HI, "stop_sequences": ["§never§", stop],
                           **GREEDY})
    check_order(raw)
    assert "".join(d["delta"]["text"] for n, d in raw if n == "content_block_delta") == cut
    assert raw[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}
    r = client.messages.create(**kw, stop_sequences=["§never§"])
    assert (r.stop_reason, r.stop_sequence) == ("max_tokens", None)


def error_of(call) -> dict:
    with pytest.raises(anthropic.APIStatusError) as e:
        call()
    body = e.value.body
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    return e.value


def test_max_tokens_past_the_context_is_cut_to_it(tmp_path_factory):
    """Claude Code asks for 32,000 tokens whatever the model: the answer runs to the context's end and says so."""
    with tool_server(tmp_path_factory, "qwen", num_kv_blocks=16, max_model_len=64) as small:
        c = anthropic.Anthropic(base_url=small.http_url, api_key="x", max_retries=0, timeout=120)
        eos = small.engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
        r = c.messages.create(model="m", max_tokens=32000, messages=HI, extra_body={"logit_bias": {str(eos): -100}})
        assert r.stop_reason == "model_context_window_exceeded"
        assert r.usage.input_tokens + r.usage.cache_read_input_tokens + r.usage.output_tokens == 64


@pytest.mark.parametrize("kw, field", [
    ({"messages": [*HI, {"role": "system", "content": "x"}]}, "messages[1].role"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {
        "type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
     "messages[0].content[1]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"messages": []}, "messages"),
    ({"tools": TOOLS, "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": [{"name": "bad name", "input_schema": WEATHER}]}, "tools[0].name"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, "tools[0].input_schema"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop_sequences": [""]}, "stop_sequences[0]"),
])
def test_bad_requests_are_400s_naming_the_field(client, srv, kw, field):
    e = error_of(lambda: client.messages.create(**{"model": "m", "max_tokens": 4, "messages": HI, **kw}))
    assert isinstance(e, anthropic.BadRequestError) and e.body["error"]["type"] == "invalid_request_error"
    assert re.match(re.escape(field) + "[: ]", e.body["error"]["message"]), e.body
    assert srv.engine.num_in_flight == 0


def test_errors_in_raw_http(client, srv):
    with httpx.Client(base_url=srv.http_url, timeout=60) as h:
        r = h.post("/v1/messages", json={"model": "m", "messages": HI})
        assert r.status_code == 400
        assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                       "message": "max_tokens is required"}}
        r = h.post("/v1/messages", json={"model": "m", "max_tokens": "4", "messages": HI})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("max_tokens: ")
        r = h.post("/v1/messages/count_tokens", json={"model": "m", "messages": [{"role": "bot", "content": "x"}]})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages[0].role: ")
    e = error_of(lambda: client.messages.create(model="nope", max_tokens=4, messages=HI))
    assert isinstance(e, anthropic.NotFoundError) and e.body["error"]["type"] == "not_found_error"
    e = error_of(lambda: client.messages.count_tokens(model="nope", messages=HI))
    assert e.status_code == 404 and "'nope'" in e.body["error"]["message"]


def test_claude_code_habits(srv):
    """?beta=true, anthropic-version / anthropic-beta, beta fields, cache_control and metadata, as Claude Code
    sends them; a thinking block sent back is taken."""
    headers = {"anthropic-version": "2023-06-01", "x-api-key": "x",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"}
    cached = {"type": "ephemeral"}
    body = {"model": "m", "max_tokens": 6, "metadata": {"user_id": "u"}, "context_management": {"edits": []},
            "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": cached}],
            "tools": [{**TOOLS[0], "cache_control": cached,
                       "input_schema": {**WEATHER, "$schema": "http://json-schema.org/draft-07/schema#"}}],
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": cached}]},
                         {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                           {"type": "text", "text": "Hello."}]},
                         {"role": "user", "content": "Weather?"}], **GREEDY}
    with httpx.Client(base_url=srv.http_url, timeout=60, headers=headers) as h:
        r = h.post("/v1/messages?beta=true", json=body)
        assert r.status_code == 200 and r.json()["type"] == "message", r.text
        counted = h.post("/v1/messages/count_tokens?beta=true", json={k: v for k, v in body.items()
                                                                      if k != "max_tokens"})
        usage = r.json()["usage"]
        assert counted.json() == {"input_tokens": usage["input_tokens"] + usage["cache_read_input_tokens"]}
    check_order(raw_events(srv, body, "/v1/messages?beta=true", headers))


def test_blocks_are_free_after(srv):
    wait_all_blocks_free(Client(srv.target, timeout=30))


# ---- a reasoning template (Qwen3's) ----

@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    with tool_server(tmp_path_factory, "qwen3", num_kv_blocks=128) as s:
        yield s


def test_thinking_blocks(thinker):
    """The model's <think> part as a thinking block, whole and streamed (thinking_delta, then its
    signature_delta); sent back, it is taken; thinking disabled switches the template's enable_thinking."""
    client = anthropic.Anthropic(base_url=thinker.http_url, api_key="x", max_retries=0, timeout=120)
    bias = {str(thinker.engine.tokenizer.convert_tokens_to_ids("<think>")): 100}  # a reasoning that never ends
    kw = dict(model="m", max_tokens=5, messages=HI, extra_body={"logit_bias": bias, **GREEDY})
    whole = client.messages.create(**kw)
    assert [(b.type, getattr(b, "thinking", None), getattr(b, "signature", None)) for b in whole.content] == [
        ("thinking", "<think>" * 4, "")], whole
    assert whole.stop_reason == "max_tokens"
    raw = raw_events(thinker, {"model": "m", "max_tokens": 5, "messages": HI, "logit_bias": bias, **GREEDY})
    check_order(raw)
    deltas = [d["delta"] for n, d in raw if n == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "<think>" * 4
    assert deltas[-1] == {"type": "signature_delta", "signature": ""}
    # a reasoning, then a call (constrained only after </think>): a thinking block, then a tool_use block
    tok = thinker.engine.tokenizer
    bias = {str(tok.convert_tokens_to_ids("<think>")): 100, str(tok.convert_tokens_to_ids("</think>")): 6}
    body = {"model": "m", "max_tokens": 120, "messages": HI, "tools": TOOLS, "logit_bias": bias, "temperature": 0.8,
            "seed": 2, "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    extras = ("logit_bias", "temperature", "seed")
    called = client.messages.create(**{k: v for k, v in body.items() if k not in extras},
                                    extra_body={k: body[k] for k in extras})
    assert [b.type for b in called.content] == ["thinking", "tool_use"] and called.stop_reason == "tool_use"
    raw = raw_events(thinker, body)
    check_order(raw)
    assert [d["content_block"]["type"] for n, d in raw if n == "content_block_start"] == ["thinking", "tool_use"]
    assert "".join(d["delta"].get("thinking", "") for n, d in raw if n == "content_block_delta") == \
        called.content[0].thinking
    nxt = client.messages.create(model="m", max_tokens=2, messages=[
        *HI, {"role": "assistant", "content": whole.content}, {"role": "user", "content": "Und?"}])
    assert nxt.type == "message"

    def count(**kw):
        return client.messages.count_tokens(model="m", messages=HI, **kw).input_tokens
    assert count(thinking={"type": "disabled"}) > count() == count(thinking={"type": "enabled", "budget_tokens": 2048})
    wait_all_blocks_free(Client(thinker.target, timeout=30))


# ---- the API key ----

def test_api_key(tmp_path_factory):
    """x-api-key (the SDK's way) or a Bearer token (Claude Code's ANTHROPIC_AUTH_TOKEN); a wrong key is a 401
    authentication_error."""
    path = build_tool_checkpoint(str(tmp_path_factory.mktemp("keyed")), "qwen")
    options = ServerOptions(http_port=0, api_key="sekret", served_model_names=("m",))
    s = InProcessServer.for_config(engine_config(path, num_kv_blocks=32), options).wait_ready()
    try:
        for kw in ({"api_key": "sekret"}, {"auth_token": "sekret"}):
            ok = anthropic.Anthropic(base_url=s.http_url, max_retries=0, **kw)
            assert ok.messages.create(model="m", max_tokens=2, messages=HI).type == "message"
        bad = anthropic.Anthropic(base_url=s.http_url, api_key="wrong", max_retries=0)
        for call in (lambda: bad.messages.create(model="m", max_tokens=2, messages=HI),
                     lambda: bad.messages.count_tokens(model="m", messages=HI)):
            e = error_of(call)
            assert isinstance(e, anthropic.AuthenticationError) and e.body["error"]["type"] == "authentication_error"
        with Client(s.target, timeout=30, api_key="sekret") as c:
            wait_all_blocks_free(c)
    finally:
        s.stop()

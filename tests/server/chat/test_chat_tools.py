"""Chat with tools over HTTP, as the `openai` client sends it, for the three call formats (Qwen2.5's
Hermes, Llama 3.1's JSON, Mistral's): the prompt is the template's own rendering with the tools; with
tool_choice required, a named function, or auto pushed into a call (logit_bias on the trigger), every
call the random model writes parses and validates against its function's schema, over seeds,
temperatures and schemas, in a mixed batch; the stream equals the unary answer; bad input is a 400
naming the field; a tool-result turn goes round."""
import concurrent.futures
import json

import jsonschema
import openai
import pytest

from grpc_fixtures import InProcessServer, engine_config, openai_client, tiny_checkpoint, wait_all_blocks_free
from pagoda.client.client import Client
from pagoda.server.openai.chat import render_chat
from pagoda.server.openai.protocol import ChatMessage
from pagoda.server.options import ServerOptions
from tool_templates import build_tool_checkpoint, tool_server

pytestmark = pytest.mark.timeout(600)

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "items": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}, "qty": {"type": "integer", "minimum": 1,
                                                                       "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}},
    "address": {"$ref": "#/$defs/Address"}, "gift": {"type": "boolean"}},
    "required": ["items", "address"], "additionalProperties": False,
    "$defs": {"Address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                                           "country": {"enum": ["FR", "DE", "JP"]}},
                          "required": ["zip", "country"], "additionalProperties": False}}}
NOTHING = {"type": "object", "properties": {}, "additionalProperties": False}
# every schema closed and bounded: a random model fills an open one until max_tokens (a call cut short,
# finish_reason length)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "place_order", "parameters": ORDER}},
         {"type": "function", "function": {"name": "ping", "parameters": NOTHING}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "Wetter in Zürich? 東京も"}]
TRIGGERS = {"qwen": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama": "{"}


@pytest.fixture(scope="module", params=["qwen", "llama", "mistral"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def srv(family, tmp_path_factory):
    # room for the whole batch: the Llama-style template renders the tools into ~3,500 prompt tokens, and
    # with less the mixed batch would thrash on preemptions (tested apart, below)
    with tool_server(tmp_path_factory, family, num_kv_blocks=1024, max_num_seqs=8) as s:
        yield s


@pytest.fixture(scope="module")
def oai(srv):
    return openai_client(srv)


def check_calls(message, allowed=None, finish_reason="tool_calls"):
    """Every call parses and validates (but for the last one of an answer cut short: finish_reason length,
    which is as far as it was written, a prefix of a valid call); returns them as (name, arguments)."""
    assert message.tool_calls, message
    calls = []
    for k, c in enumerate(message.tool_calls):
        assert c.type == "function" and c.id.startswith("call_")
        assert c.function.name in (allowed or SCHEMAS)
        calls.append((c.function.name, c.function.arguments))
        if finish_reason == "length" and k == len(message.tool_calls) - 1:
            try:
                json.loads(c.function.arguments)
            except ValueError:
                continue
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMAS[c.function.name])
    return calls


def test_prompt_is_the_templates_rendering_with_the_tools(srv):
    tok = srv.engine.tokenizer
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Köln"}'}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "12°C", "tool_call_id": "call_1"}]
    ids = render_chat(srv.engine, [ChatMessage(**m) for m in messages], TOOLS)
    for_template = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": {"city": "Köln"}}}]},
        {"role": "tool", "content": "12°C", "tool_call_id": "call_1"}]
    expected = tok.apply_chat_template(for_template, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    assert ids == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert "get_weather" in tok.decode(ids) and "Köln" in tok.decode(ids)


@pytest.mark.parametrize("temperature", [0.0, 0.8, 1.5])
def test_required_calls_always_parse_and_validate(oai, srv, family, temperature):
    """A busy mixed batch: required, each named function, auto pushed into a call, and free text."""
    tok = srv.engine.tokenizer
    bias = {str(tok.convert_tokens_to_ids(TRIGGERS[family])): 100}
    kinds = [("required", {}), ("required", {"parallel_tool_calls": False}), *((({"type": "function", "function": {"name": n}}), {}) for n in SCHEMAS),
             ("auto", {"logit_bias": bias}), (None, {})]

    def one(seed, choice, extra):
        kw = {"tools": TOOLS, "tool_choice": choice, **extra} if choice is not None else {}
        return choice, extra.get("parallel_tool_calls"), oai.chat.completions.create(model="m", messages=MESSAGES, max_tokens=300, seed=seed,
                                                   temperature=temperature, **kw)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda a: one(*a), [(s, c, e) for s in range(3) for c, e in kinds]))
    for choice, parallel, r in results:
        choice_out = r.choices[0]
        if choice is None:
            assert choice_out.message.tool_calls is None and choice_out.finish_reason in ("stop", "length")
            continue
        named = choice["function"]["name"] if isinstance(choice, dict) else None
        calls = check_calls(choice_out.message, [named] if named else None, choice_out.finish_reason)
        if named or parallel is False:
            assert len(calls) == 1 and choice_out.finish_reason == "tool_calls", choice_out
        else:  # parallel calls: a random model may go on calling until max_tokens (the last one cut short
            # then, finish_reason length)
            assert choice_out.finish_reason in ("tool_calls", "length")
    wait_all_blocks_free(Client(srv.target, timeout=30))


def test_stream_equals_unary(oai, srv, family):
    tok = srv.engine.tokenizer
    bias = {str(tok.convert_tokens_to_ids(TRIGGERS[family])): 100}
    for choice, extra in (("required", {"parallel_tool_calls": False}), ("auto", {"logit_bias": bias}),
                          ("auto", {}), ("required", {"max_tokens": 24})):  # the last: cut inside its call
        kw = dict(model="m", messages=MESSAGES, tools=TOOLS, tool_choice=choice, seed=7, temperature=0.9,
                  **{"max_tokens": 300, **extra})
        whole = oai.chat.completions.create(**kw).choices[0]
        content, calls, finish, pieces = "", {}, None, {}
        for chunk in oai.chat.completions.create(**kw, stream=True):
            for c in chunk.choices:
                content += c.delta.content or ""
                for d in c.delta.tool_calls or []:
                    if d.id:  # a call's first piece: its id, type and name, no arguments yet
                        assert d.index == len(calls) and d.type == "function" and d.function.arguments == ""
                        calls[d.index] = [d.id, d.function.name, ""]
                    else:
                        assert d.function.name is None and d.function.arguments
                        pieces[d.index] = pieces.get(d.index, 0) + 1
                    calls[d.index][2] += d.function.arguments or ""
                finish = c.finish_reason or finish
        # the arguments come in pieces as the tokens come (a call's arguments are several tokens)
        assert all(pieces.get(k, 0) >= 2 for k, (_, _, a) in calls.items() if len(a) >= 16)
        assert not calls or "max_tokens" in extra or max(pieces.values()) >= 3
        assert finish == whole.finish_reason
        assert (content or None) == whole.message.content
        assert all(t not in content for t in tok.all_special_tokens if t != TRIGGERS[family])  # EOS: no text
        got = [(n, a) for _, n, a in (calls[i] for i in sorted(calls))]
        assert got == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
        if choice == "required":
            assert got and all(i.startswith("call_") for i, _, _ in calls.values())
        if extra.get("max_tokens"):  # cut short: the call as far as written, on both, finish_reason length
            assert whole.finish_reason == "length" and whole.message.content is None
            with pytest.raises(ValueError):
                json.loads(whole.message.tool_calls[-1].function.arguments)


def test_tool_result_round_trip(oai, family):
    """The SDK's own message appended as is, then the tool's result: the next turn renders and answers."""
    first = oai.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message = first.choices[0].message
    (name, _), = check_calls(message, ["get_weather"])
    history = [*MESSAGES, message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "21°C"}]
    second = oai.chat.completions.create(model="m", messages=history, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert second.choices[0].message.tool_calls is None and second.choices[0].finish_reason in ("stop", "length")


def test_tool_choice_none_renders_tools_and_parses_nothing(oai, srv, family):
    tok = srv.engine.tokenizer
    bias = {str(tok.convert_tokens_to_ids(TRIGGERS[family])): 100}
    r = oai.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=6,
                                    logit_bias=bias, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
    with_tools = r.usage.prompt_tokens
    plain = oai.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1).usage.prompt_tokens
    assert with_tools > plain  # the tools are in the prompt


@pytest.mark.parametrize("kw, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "bogus"}}}}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0]"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": [*MESSAGES, {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
    ({"messages": [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_input_is_a_400_naming_the_field(oai, srv, kw, param):
    kw = {"model": "m", "messages": MESSAGES, "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(**kw)
    assert e.value.body["param"] == param, e.value.body
    assert srv.engine.num_in_flight == 0


def test_tools_with_a_template_without_tools_is_a_400():
    s = InProcessServer.for_config(engine_config(tiny_checkpoint()),
                                   ServerOptions(http_port=0, served_model_names=("m",))).wait_ready()
    try:
        with pytest.raises(openai.BadRequestError) as e:
            openai_client(s).chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, max_tokens=4)
        assert e.value.body["param"] == "tools" and "chat template" in e.value.body["message"]
    finally:
        s.stop()


# ---- the same over gRPC ----

def grpc_tools(tools=TOOLS):
    from pagoda.v1 import generation_pb2 as pb

    return [pb.Tool(name=t["function"]["name"], description=t["function"].get("description", ""),
                    parameters_json=json.dumps(t["function"]["parameters"])) for t in tools]


def grpc_request(stream=False, **kw):
    from pagoda.v1 import generation_pb2 as pb

    cls = pb.GenerateStreamRequest if stream else pb.GenerateRequest
    req = cls(messages=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in MESSAGES]), tools=grpc_tools(), **kw)
    req.stopping.max_tokens = 300
    return req


def test_grpc_calls_validate_and_the_stream_equals_the_unary_answer(srv):
    from pagoda.v1 import generation_pb2 as pb

    with Client(srv.target, timeout=60) as c:
        for seed, choice in enumerate([pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED),
                                       pb.ToolChoice(function_name="place_order")]):
            req = grpc_request(tool_choice=choice, parallel_tool_calls=False)
            req.sampling.seed, req.sampling.temperature = seed, 1.0
            whole = c.stub.Generate(req, timeout=60)
            assert whole.finish_reason == pb.FINISH_REASON_TOOL_CALLS and len(whole.tool_calls) == 1
            call = whole.tool_calls[0]
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            assert call.id.startswith("call_") and whole.choices[0].tool_calls == whole.tool_calls
            stream_req = grpc_request(stream=True, tool_choice=choice, parallel_tool_calls=False)
            stream_req.sampling.seed, stream_req.sampling.temperature = seed, 1.0
            msgs = list(c.stub.GenerateStream(stream_req, timeout=60))
            assert "".join(m.text for m in msgs) == whole.text
            assert [(t.name, t.arguments) for m in msgs for t in m.tool_calls] == [(call.name, call.arguments)]
            deltas = [d for m in msgs for d in m.tool_call_deltas]  # id and name, then the arguments in pieces
            assert deltas[0].id == next(t.id for m in msgs for t in m.tool_calls) and deltas[0].name == call.name
            assert all(d.index == 0 and not d.id and not d.name for d in deltas[1:]) and len(deltas) >= 3
            assert "".join(d.arguments for d in deltas) == call.arguments
            assert msgs[-1].finish_reason == pb.FINISH_REASON_TOOL_CALLS
        # the call and its result sent back: the next turn renders
        history = [pb.ChatMessage(**m) for m in MESSAGES] + [
            pb.ChatMessage(role="assistant", tool_calls=[call]),
            pb.ChatMessage(role="tool", content="ok", tool_call_id=call.id)]
        nxt = pb.GenerateRequest(messages=pb.ChatMessages(messages=history), tools=grpc_tools(),
                                 tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NONE))
        nxt.stopping.max_tokens = 4
        assert not c.stub.Generate(nxt, timeout=60).tool_calls
        wait_all_blocks_free(c)


def test_grpc_bad_tools_are_invalid_argument_naming_the_field(srv):
    import grpc

    from pagoda.v1 import generation_pb2 as pb

    bad = [
        (dict(tools=[pb.Tool(name="f", parameters_json="{nope")]), "tools[0].parameters_json"),
        (dict(tools=[pb.Tool(name="f", parameters_json='{"type": "object", "properties": {"x": {"type": "bogus"}}}')]),
         "tools"),
        (dict(tool_choice=pb.ToolChoice(function_name="nope")), "tool_choice.function_name"),
        (dict(tools=[pb.Tool(name="bad name")]), "tools[0].name"),
    ]
    with Client(srv.target, timeout=60) as c:
        for kw, field in bad:
            req = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in MESSAGES]),
                                     **{"tools": grpc_tools(), **kw})
            with pytest.raises(grpc.RpcError) as e:
                c.stub.Generate(req, timeout=60)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(field + " "), \
                e.value.details()
        no_id = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(**MESSAGES[0]),
                                                                      pb.ChatMessage(role="tool", content="x")]))
        with pytest.raises(grpc.RpcError) as e:
            c.stub.Generate(no_id, timeout=60)
        assert e.value.details().startswith("messages.messages[1].tool_call_id "), e.value.details()
        text = pb.GenerateRequest(text="hi", tools=grpc_tools())
        with pytest.raises(grpc.RpcError) as e:
            c.stub.Generate(text, timeout=60)
        assert e.value.details().startswith("tools "), e.value.details()
        assert srv.engine.num_in_flight == 0


def test_calls_stay_valid_under_preemption_and_chunked_prefill(tmp_path):
    """A KV cache too small for the batch (sequences preempted and recomputed) and prompts prefilled in
    chunks: every call still parses and validates, and every block comes back."""
    path = build_tool_checkpoint(str(tmp_path), "qwen")
    s = InProcessServer.for_config(engine_config(path, num_kv_blocks=120, max_num_seqs=6, max_num_batched_tokens=128),
                                   ServerOptions(http_port=0, served_model_names=("m",))).wait_ready()
    try:
        oai = openai_client(s)

        def one(i):
            messages = [{"role": "user", "content": f"Anfrage {i}: " + "天気 " * (i * 7)}]
            return oai.chat.completions.create(model="m", messages=messages, tools=TOOLS[:1], tool_choice="required",
                                               parallel_tool_calls=False, max_tokens=150, temperature=1.0, seed=i)
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            results = list(pool.map(one, range(6)))
        for r in results:
            assert r.choices[0].finish_reason == "tool_calls"
            check_calls(r.choices[0].message)
        assert s.engine.stats().num_preemptions > 0
        wait_all_blocks_free(Client(s.target, timeout=30))
    finally:
        s.stop()

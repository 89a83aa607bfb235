"""Ollama's API (server/ollama) through the `ollama` library and raw NDJSON: the model list, show and
ps; chat and generate, whole and streamed alike, with their counts and timings; NAME:latest; tools,
their calls' arguments as objects, and the next turn; format json and a JSON schema; think (a
reasoning template); and every field's bad value refused in Ollama's error shape, naming the field."""
import json

import httpx
import jsonschema
import ollama
import pytest

from grpc_fixtures import InProcessServer, engine_config, wait_all_blocks_free
from pagoda.client.client import Client
from pagoda.engine.errors import InvalidRequestError
from pagoda.server.ollama.models import resolve, tagged
from pagoda.server.ollama.protocol import ChatBody, Message, Options, chat_messages, template_kwargs
from tool_templates import QWEN3, build_tool_tokenizer, tool_server

pytestmark = pytest.mark.timeout(300)

HI = [{"role": "user", "content": "Grüß dich, 東京"}]
GREEDY = {"temperature": 0, "num_predict": 12}
# what the ollama library keeps of a tool's parameters (its Tool model drops other keywords, maxLength too)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Köln", "Paris"]},
                                            "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}}]
DURATIONS = ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with tool_server(tmp_path_factory, "qwen", num_kv_blocks=256, allow_lora_loading=True, max_loras=1) as s:
        yield s
        wait_all_blocks_free(Client(s.target, timeout=30))


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """Qwen3's template, its reasoning opened in the prompt with think: true (as DeepSeek-R1's does):
    a random model's answer is then reasoning until it writes </think>."""
    from pagoda.engine.demo import build_tiny_checkpoint
    from pagoda.server.options import ServerOptions

    tok = build_tool_tokenizer("qwen3")
    end = "{%- endif %}{%- endif %}"
    assert tok.chat_template.endswith(end) and QWEN3.strip().endswith(end)
    tok.chat_template = tok.chat_template.removesuffix(end) + (
        "{%- elif enable_thinking is defined and enable_thinking %}{{- '<think>\\n' }}" + end)
    path = build_tiny_checkpoint(str(tmp_path_factory.mktemp("thinker")), "qwen3", initializer_range=0.3,
                                 tokenizer=tok, max_position_embeddings=4096)
    s = InProcessServer.for_config(engine_config(path, num_kv_blocks=128),
                                   ServerOptions(http_port=0, served_model_names=("m",))).wait_ready()
    try:
        yield s
        wait_all_blocks_free(Client(s.target, timeout=30))
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return ollama.Client(host=srv.http_url, timeout=60)


def assert_done(last, prompt_tokens=None):
    """The last chunk's counts and nanosecond timings: integers that add up to the call's wall clock."""
    assert last.done is True and last.done_reason in ("stop", "length")
    for name in DURATIONS + ("prompt_eval_count", "eval_count"):
        assert isinstance(last[name], int) and last[name] >= 0, name
    assert last.total_duration == pytest.approx(last.load_duration + last.prompt_eval_duration
                                                + last.eval_duration, abs=10)
    assert last.total_duration > 0 and last.prompt_eval_count > 0
    if prompt_tokens is not None:
        assert last.prompt_eval_count == prompt_tokens


def test_names_options_and_messages():
    assert [tagged(n) for n in ("m", "org/m:7b", "host:5000/m")] == ["m:latest", "org/m:7b", "host:5000/m:latest"]
    assert [resolve(n, ["m"]) for n in ("m:latest", "m", "m:7b", "x:latest")] == ["m", "m", "m:7b", "x:latest"]
    opts = Options(ChatBody(model="m", options={"repeat_penalty": 1.2, "num_predict": -1, "stop": "x", "num_thread": 4,
                                                "num_ctx": 100}), {"json_object": True})
    p = opts.params
    assert (p.repetition_penalty, p.stop, p.max_tokens, p.structured_outputs.kind) == (1.2, ["x"], None, "json_object")
    assert opts.max_tokens(40, 4096) == 60 and Options(ChatBody(model="m"), None).max_tokens(40, 4096) is None
    calls = [{"function": {"name": n, "arguments": {"a": 1}}} for n in ("f", "g")]
    messages = chat_messages([Message(role="assistant", content="", tool_calls=calls),
                              Message(role="tool", content="G", tool_name="g"), Message(role="tool", content="F")])
    assert messages[0]["tool_calls"][1] == {"id": "call_0_1", "type": "function",
                                            "function": {"name": "g", "arguments": {"a": 1}}}
    assert [m["tool_call_id"] for m in messages[1:]] == ["call_0_1", "call_0_0"] and messages[1]["name"] == "g"


class _Tokenizer:
    def __init__(self, template):
        self.chat_template = template

    def decode(self, ids, skip_special_tokens=False):
        return ""


@pytest.mark.parametrize("template, kwargs", [
    ("{% if enable_thinking %}<think></think>{% endif %}", {"enable_thinking": True}),
    ("{% if thinking %}<think></think>{% endif %}", {"thinking": True}),
    ("<think></think>", {}),
])
def test_think_reaches_the_template_by_the_name_it_reads(template, kwargs):
    engine = type("Engine", (), {"tokenizer": _Tokenizer(template)})()
    assert template_kwargs(engine, True, None) == kwargs and template_kwargs(engine, None, None) == {}
    with pytest.raises(InvalidRequestError) as e:
        template_kwargs(type("Engine", (), {"tokenizer": _Tokenizer("plain")})(), True, None)
    assert e.value.field == "think"


def test_heartbeat_and_version(srv):
    assert httpx.get(srv.http_url + "/").text == "Ollama is running"
    assert httpx.head(srv.http_url + "/").status_code == 200
    assert httpx.get(srv.http_url + "/api/version").json() == {"version": "0.12.0"}


def test_list_show_and_ps(client, srv):
    listed = client.list().models
    assert [m.model for m in listed] == ["m:latest"]
    m = listed[0]
    assert m.size > 0 and len(m.digest) == 64 and m.modified_at is not None
    assert m.details.format == "safetensors" and m.details.family == "llama" and m.details.parameter_size
    assert m.details.quantization_level == "F32"
    raw = httpx.get(srv.http_url + "/api/tags").json()["models"][0]
    assert raw["name"] == raw["model"] == "m:latest"
    for name in ("m", "m:latest"):
        shown = client.show(name)
        assert shown.modelinfo["general.architecture"] == "llama"
        assert shown.modelinfo["llama.context_length"] == srv.engine.model_info.max_model_len
        assert shown.capabilities == ["completion", "tools"] and "<tool_call>" in shown.template
        assert shown.details.family == "llama" and "FROM" in shown.modelfile
    assert httpx.post(srv.http_url + "/api/show", json={"name": "m"}).status_code == 200  # the CLI's field
    (running,) = client.ps().models
    assert running.model == "m:latest" and running.expires_at.year > 2100
    assert running.context_length == srv.engine.model_info.max_model_len and running.size_vram == m.size


def test_a_lora_adapter_is_a_model(client, srv, tmp_path):
    """A LoRA adapter loaded at run time is listed as NAME:latest with its base as parent, and served."""
    from oracle import make_adapter

    path = make_adapter(srv.engine.model_info.model_id, str(tmp_path / "tuned"), 3)
    assert httpx.post(srv.http_url + "/v1/load_lora_adapter", json={"lora_name": "tuned", "lora_path": path},
                      timeout=60).status_code == 200
    try:
        listed = {m.model: m for m in client.list().models}
        assert sorted(listed) == ["m:latest", "tuned:latest"]
        assert listed["tuned:latest"].details.parent_model == "m" and listed["tuned:latest"].size > 0
        assert client.show("tuned:latest").details.parent_model == "m"
        assert len(client.ps().models) == 2
        tuned = client.chat(model="tuned:latest", messages=HI, options=GREEDY)
        base = client.chat(model="m", messages=HI, options=GREEDY)
        assert tuned.model == "tuned:latest" and tuned.message.content != base.message.content
    finally:
        httpx.post(srv.http_url + "/v1/unload_lora_adapter", json={"lora_name": "tuned"}, timeout=60)
    assert [m.model for m in client.list().models] == ["m:latest"]


def test_chat_whole_and_streamed_agree(client, srv):
    whole = client.chat(model="m", messages=HI, options=GREEDY)
    assert whole.model == "m" and whole.message.role == "assistant" and whole.message.content
    assert whole.done_reason == "length" and whole.eval_count == 12
    assert_done(whole)
    parts = list(client.chat(model="m", messages=HI, options=GREEDY, stream=True))
    assert len(parts) > 1 and all(not p.done for p in parts[:-1])
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert_done(parts[-1], whole.prompt_eval_count)
    assert parts[-1].eval_count == 12 and parts[-1].done_reason == "length"
    wait_all_blocks_free(Client(srv.target, timeout=30))


def test_latest_names_the_model_and_unknown_is_404(client):
    r = client.chat(model="m:latest", messages=HI, options=GREEDY)
    assert r.model == "m:latest" and r.done
    for call in (lambda: client.chat(model="nope", messages=HI), lambda: client.show("nope:latest"),
                 lambda: client.generate(model="nope", prompt="x")):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 404 and "'nope" in e.value.error


def test_loading_call_answers_at_once(client):
    """The ollama CLI loads a model with an empty chat (and generate): answered done, reason "load"."""
    r = client.chat(model="m", messages=[])
    assert r.done and r.done_reason == "load" and r.message.content == ""
    g = client.generate(model="m:latest", prompt="", keep_alive=0)
    assert g.done and g.done_reason == "load" and g.response == ""


def test_the_ollama_clis_bodies(srv):
    """The Go client's requests carry every field without omitempty: empty strings, null options, a
    call's index, _debug_render_only's underscore."""
    url = srv.http_url
    shown = httpx.post(url + "/api/show", json={"model": "m", "system": "", "template": "", "verbose": False,
                                                "options": None, "name": ""})
    assert shown.status_code == 200 and "completion" in shown.json()["capabilities"]
    load = httpx.post(url + "/api/generate", json={"model": "m", "prompt": "", "suffix": "", "system": "",
                                                   "template": "", "options": None, "keep_alive": "5m0s"})
    assert load.json()["done_reason"] == "load"
    call = {"id": "call_1", "function": {"index": 0, "name": "get_weather", "arguments": {"city": "Köln"}}}
    messages = [*HI, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "12°C", "tool_name": "get_weather", "tool_call_id": "call_1"}]
    r = httpx.post(url + "/api/chat", json={"model": "m", "messages": messages, "options": {}, "tools": TOOLS,
                                            "stream": False, "_debug_render_only": False, "think": False})
    assert r.status_code == 200 and r.json()["done"] is True
    # fields this server does not know (a newer Ollama's, a client's own) are ignored, as Ollama's decoding does
    r = httpx.post(url + "/api/chat", json={"model": "m", "messages": HI, "stream": False, "options": GREEDY,
                                            "a_newer_field": {"x": 1}})
    assert r.status_code == 200 and r.json()["done"] is True


def test_raw_ndjson_stream(srv):
    with httpx.stream("POST", srv.http_url + "/api/chat", json={"model": "m", "messages": HI, "options": GREEDY}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert all(isinstance(x, dict) and x["model"] == "m" and x["created_at"].endswith("Z") for x in lines)
    assert all(x["done"] is False and set(x["message"]) == {"role", "content"} for x in lines[:-1])
    last = lines[-1]
    assert last["done"] is True and last["done_reason"] == "length"
    assert all(type(last[k]) is int for k in DURATIONS + ("prompt_eval_count", "eval_count"))
    whole = httpx.post(srv.http_url + "/api/chat", json={"model": "m", "messages": HI, "options": GREEDY,
                                                         "stream": False})
    assert whole.headers["content-type"] == "application/json"
    assert whole.json()["message"]["content"] == "".join(x["message"]["content"] for x in lines)


def test_leaving_a_stream_frees_its_blocks(srv):
    with httpx.stream("POST", srv.http_url + "/api/generate",
                      json={"model": "m", "prompt": "on and on", "options": {"num_predict": 2000}}) as r:
        next(r.iter_lines())
    wait_all_blocks_free(Client(srv.target, timeout=30))


def test_generate_context_and_raw(client, srv):
    whole = client.generate(model="m", prompt="Once upon", system="Be brief.", options=GREEDY)
    assert whole.response and whole.done_reason == "length"
    assert_done(whole)
    parts = list(client.generate(model="m", prompt="Once upon", system="Be brief.", options=GREEDY, stream=True))
    assert "".join(p.response for p in parts) == whole.response and parts[-1].context == whole.context
    assert len(whole.context) == whole.prompt_eval_count + whole.eval_count
    again = client.generate(model="m", prompt="and then", context=whole.context, options=GREEDY)
    assert again.context[:len(whole.context)] == whole.context and again.prompt_eval_count > len(whole.context)
    raw = client.generate(model="m", prompt="Once upon", raw=True, options=GREEDY)
    assert raw.prompt_eval_count < whole.prompt_eval_count  # no template around it
    assert raw.context[:raw.prompt_eval_count] == srv.engine.tokenizer.encode("Once upon")


def test_options_reach_the_sampler(client):
    a = client.chat(model="m", messages=HI, options={"temperature": 1, "seed": 7, "num_predict": 16, "top_k": 40,
                                                     "top_p": 0.9, "min_p": 0.01, "repeat_penalty": 1.1,
                                                     "presence_penalty": 0.5, "frequency_penalty": 0.5,
                                                     "num_thread": 8, "mirostat": 0})
    b = client.chat(model="m", messages=HI, options={"temperature": 1, "seed": 7, "num_predict": 16, "top_k": 40,
                                                     "top_p": 0.9, "min_p": 0.01, "repeat_penalty": 1.1,
                                                     "presence_penalty": 0.5, "frequency_penalty": 0.5})
    assert a.message.content == b.message.content and a.eval_count == 16
    greedy = client.chat(model="m", messages=HI, options=GREEDY).message.content
    stop = next(c for c in greedy[1:] if c.isascii() and c.isalnum())
    stopped = client.chat(model="m", messages=HI, options={**GREEDY, "stop": [stop]})
    assert stopped.done_reason == "stop" and stopped.message.content == greedy[:greedy.index(stop)]
    fitted = client.chat(model="m", messages=HI, options={"temperature": 0, "num_ctx": a.prompt_eval_count + 5})
    assert fitted.eval_count == 5 and fitted.done_reason == "length"


def test_logprobs(client):
    r = client.chat(model="m", messages=HI, options=GREEDY, logprobs=True, top_logprobs=2)
    assert len(r.logprobs) == 12 and all(len(lp.top_logprobs) == 2 for lp in r.logprobs)
    assert all(lp.logprob >= lp.top_logprobs[1].logprob for lp in r.logprobs)


def test_tool_calls_are_objects_valid_against_the_schema(client):
    """No tool_choice in Ollama's API: at temperature 1, among fixed seeds, calls come; every one is
    whole, its arguments an object valid against the tool's parameters, streamed as returned whole."""
    kw = dict(model="m", messages=[{"role": "user", "content": "Weather in Köln?"}], tools=TOOLS)
    seen = 0
    for seed in range(12):
        options = {"temperature": 1, "seed": seed, "num_predict": 300}
        r = client.chat(**kw, options=options)
        for call in r.message.tool_calls or []:
            assert call.function.name == "get_weather" and isinstance(call.function.arguments, dict)
            jsonschema.validate(call.function.arguments, WEATHER)
        if r.message.tool_calls:
            seen += 1
            parts = list(client.chat(**kw, options=options, stream=True))
            streamed = [c for p in parts for c in p.message.tool_calls or []]
            assert [c.function for c in streamed] == [c.function for c in r.message.tool_calls]
            assert "".join(p.message.content for p in parts) == r.message.content
    assert seen >= 1


def test_a_tool_turn_is_rendered(client):
    """An assistant's calls with arguments as objects, and the tool's result (tool_name, no id) next."""
    call = {"function": {"name": "get_weather", "arguments": {"city": "Köln", "unit": "c"}}}
    turn = [*HI, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "12°C", "tool_name": "get_weather"}]
    before = client.chat(model="m", messages=HI, tools=TOOLS, options=GREEDY).prompt_eval_count
    after = client.chat(model="m", messages=turn, tools=TOOLS, options=GREEDY)
    rendered = '{"name": "get_weather", "arguments": {"city": "Köln", "unit": "c"}}'
    assert after.prompt_eval_count >= before + len(rendered.encode())


def test_format_json_and_schema(client):
    stopped = 0
    for seed in range(4):
        r = client.chat(model="m", messages=HI, format="json", options={"temperature": 1, "seed": seed,
                                                                        "num_predict": 200})
        if r.done_reason == "stop":
            stopped += 1
            assert isinstance(json.loads(r.message.content), dict)
    assert stopped >= 1
    schema = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "n": {"type": "integer",
                                                                                  "minimum": 0, "maximum": 99}},
              "required": ["unit", "n"], "additionalProperties": False}
    for seed in range(2):
        r = client.chat(model="m", messages=HI, format=schema, options={"temperature": 1, "seed": seed,
                                                                        "num_predict": 100})
        assert r.done_reason == "stop"
        jsonschema.validate(json.loads(r.message.content), schema)
        g = client.generate(model="m", prompt="x", format=schema, options={"temperature": 1, "seed": seed,
                                                                           "num_predict": 100})
        jsonschema.validate(json.loads(g.response), schema)


def test_think(thinker):
    client = ollama.Client(host=thinker.http_url, timeout=60)
    assert client.show("m").capabilities == ["completion", "tools", "thinking"]
    plain = client.chat(model="m", messages=HI, options=GREEDY)
    off = client.chat(model="m", messages=HI, options=GREEDY, think=False)
    assert off.prompt_eval_count > plain.prompt_eval_count  # the template wrote its empty <think></think>
    assert off.message.thinking is None and off.message.content
    on = client.chat(model="m", messages=HI, options=GREEDY, think=True)
    assert on.message.thinking and on.message.content == "" and on.done_reason == "length"
    parts = list(client.chat(model="m", messages=HI, options=GREEDY, think=True, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == on.message.thinking
    g = client.generate(model="m", prompt="Grüß dich, 東京", options=GREEDY, think=True)
    assert g.thinking == on.message.thinking and g.response == ""
    # the answer after </think> constrained to the format, the reasoning free
    r = client.chat(model="m", messages=HI, think=True, format={"type": "object", "properties": {"u": {"enum": [1]}},
                                                                "required": ["u"]},
                    options={"temperature": 0, "num_predict": 200})
    assert r.message.thinking is not None


BAD = [  # (path, body fields, the field named)
    ("chat", {"options": {"temperature": -1}}, "options.temperature"),
    ("chat", {"options": {"top_k": 1.5}}, "options.top_k"),
    ("chat", {"options": {"top_p": 2}}, "options.top_p"),
    ("chat", {"options": {"min_p": -0.1}}, "options.min_p"),
    ("chat", {"options": {"seed": "x"}}, "options.seed"),
    ("chat", {"options": {"stop": [1]}}, "options.stop[0]"),
    ("chat", {"options": {"stop": 5}}, "options.stop"),
    ("chat", {"options": {"repeat_penalty": 0}}, "options.repeat_penalty"),
    ("chat", {"options": {"presence_penalty": 3}}, "options.presence_penalty"),
    ("chat", {"options": {"frequency_penalty": -3}}, "options.frequency_penalty"),
    ("chat", {"options": {"num_predict": -5}}, "options.num_predict"),
    ("generate", {"options": {"num_predict": "ten"}}, "options.num_predict"),
    ("chat", {"options": {"num_predict": 10 ** 6}}, "options.num_predict"),
    ("chat", {"options": {"num_ctx": 10 ** 6}}, "options.num_ctx"),
    ("chat", {"options": {"num_ctx": 4}}, "options.num_ctx"),
    ("chat", {"options": {"num_ctx": 64, "num_predict": 60}}, "options.num_predict"),
    ("chat", {"options": {"num_ctx": 0}}, "options.num_ctx"),
    ("chat", {"options": {"bogus": 1}}, "options.bogus"),
    ("chat", {"options": []}, "options"),
    ("chat", {"format": "xml"}, "format"),
    ("chat", {"format": {"type": "nope"}}, "format"),
    ("generate", {"format": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "format"),
    ("chat", {"format": "json", "tools": TOOLS}, "format"),
    ("chat", {"messages": [*HI, {"role": "robot", "content": "x"}]}, "messages[1].role"),
    ("chat", {"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, "messages[0].images"),
    ("chat", {"messages": [{"role": "user", "content": "x", "tool_name": "f"}]}, "messages[0].tool_name"),
    ("chat", {"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"function": {"name": "f", "arguments": {}}}]}]}, "messages[0].tool_calls"),
    ("chat", {"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls[0].function.arguments"),
    ("chat", {"messages": [{"role": "user", "content": "x" * 5000}]}, "messages"),
    ("chat", {"tools": [{"type": "x"}]}, "tools[0]"),
    ("chat", {"think": True}, "think"),
    ("chat", {"think": "high"}, "think"),
    ("chat", {"stream": "yes"}, "stream"),
    ("chat", {"top_logprobs": 3}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ("chat", {"_debug_render_only": True}, "_debug_render_only"),
    ("chat", {"model": None}, "model"),
    ("generate", {"suffix": "end"}, "suffix"),
    ("generate", {"template": "{{ .Prompt }}"}, "template"),
    ("generate", {"images": ["aGk="]}, "images"),
    ("generate", {"context": [-1, 5]}, "context[0]"),
    ("generate", {"context": [1, 10 ** 6]}, "context[1]"),
    ("generate", {"raw": True, "system": "x"}, "system"),
    ("generate", {"raw": True, "think": False}, "think"),
    ("generate", {"think": True}, "think"),
    ("show", {"model": None}, "model"),
]


@pytest.mark.parametrize("path, fields, field", BAD, ids=[f"{p}-{f}" for p, _, f in BAD])
def test_bad_values_name_their_field(srv, path, fields, field):
    body = {"model": "m", **({"messages": HI} if path == "chat" else {"prompt": "x"} if path == "generate" else {}),
            **fields}
    body = {k: v for k, v in body.items() if v is not None}
    for stream in (True, False):
        r = httpx.post(f"{srv.http_url}/api/{path}", json=body if path == "show" else {"stream": stream, **body})
        assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
        assert list(r.json()) == ["error"]
        assert r.json()["error"].startswith((field + " ", field + ":")), r.json()


def test_errors_reach_the_library_as_response_errors(client):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="m", messages=HI, options={"num_ctx": 10 ** 6})
    assert e.value.status_code == 400 and e.value.error.startswith("options.num_ctx ")
    with pytest.raises(ollama.ResponseError) as e:
        list(client.chat(model="m", messages=HI, options={"bogus": 1}, stream=True))
    assert e.value.status_code == 400 and e.value.error.startswith("options.bogus ")


def test_model_management_is_refused_saying_what_is_served(client):
    for call in (lambda: client.pull("m"), lambda: client.delete("m"), lambda: client.copy("m", "n")):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 501 and "serves the model it was started with ('m')" in e.value.error

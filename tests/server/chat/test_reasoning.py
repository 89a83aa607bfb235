"""server/chat/reasoning.py: a reasoning model's <think>...</think> read apart from the answer (whole and
streamed alike, the tag opened in the answer or by the template), chat_template_kwargs' allow-list,
and over HTTP (a Qwen3-style template): reasoning_content, and tool calls or a structured output
constrained only after </think>."""
import json

import llguidance
import llguidance.hf
import openai
import pytest

from grpc_fixtures import openai_client
from pagoda.engine.errors import InvalidRequestError
from pagoda.server.chat.reasoning import Reasoning, ReasoningStream, check_template_kwargs, reasoning_for
from pagoda.server.chat.tools import check_tools, FORMATS, token_spelling
from tool_templates import build_tool_tokenizer, tool_server

TEXTS = ["<think>\nLet me see: 東京.\n</think>\n\nIt is 12°C.", "<think>\ncut short", "Just an answer.", "",
         "<think></think>Answer"]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"], "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "Warum? 为什么"}]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("opened", [False, True])
def test_split_and_its_stream_agree(text, opened):
    r = Reasoning(opened)
    text = text.removeprefix("<think>") if opened else text
    whole = r.split(text)
    for step in (1, 4):
        s, got = ReasoningStream(r), ["", ""]
        pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
        for i, p in enumerate(pieces):
            a, b = s.feed(p, final=i == len(pieces) - 1)
            got = [got[0] + a, got[1] + b]
        assert tuple(got) == whole


def test_split_reads_the_reasoning_apart():
    assert Reasoning().split(TEXTS[0]) == ("Let me see: 東京.\n", "It is 12°C.")
    assert Reasoning().split(TEXTS[1]) == ("cut short", "")
    assert Reasoning().split(TEXTS[2]) == ("", TEXTS[2])
    assert Reasoning(opened=True).split("thinking</think>\n\nanswer") == ("thinking", "answer")


def test_detected_from_the_template_and_opened_by_the_prompt():
    tok = build_tool_tokenizer("qwen3")
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert reasoning_for(tok, list(ids)) == Reasoning(opened=False)
    assert reasoning_for(tok, list(ids) + [tok.convert_tokens_to_ids("<think>")]) == Reasoning(opened=True)
    assert reasoning_for(build_tool_tokenizer("qwen"), list(ids)) is None
    assert reasoning_for(build_tool_tokenizer("qwen"), list(ids), "qwen3") == Reasoning(opened=False)


def test_template_kwargs_are_allow_listed():
    assert check_template_kwargs({"enable_thinking": False}) == {"enable_thinking": False}
    for bad, field in [({"tools": []}, "chat_template_kwargs.tools"), ({"enable_thinking": "no"},
                       "chat_template_kwargs.enable_thinking"), ([], "chat_template_kwargs")]:
        with pytest.raises(InvalidRequestError) as e:
            check_template_kwargs(bad)
        assert e.value.field == field


@pytest.mark.parametrize("family", ["qwen3", "qwen"])
def test_calls_are_constrained_only_after_the_reasoning(family):
    """With the tags as tokens (Qwen3) and as plain text (a template whose tokenizer lacks them)."""
    tok = build_tool_tokenizer(family)
    token = token_spelling(tok)
    grammar = Reasoning().wrap(check_tools(TOOLS, "required").grammar(FORMATS["hermes"], token), token)
    ltok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=[tok.eos_token_id])
    call = '<tool_call>\n{"name": "f", "arguments": {"x": 2}}\n</tool_call>'

    def accepts(text):
        m = llguidance.LLMatcher(ltok, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
        return m.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.is_accepting()
    assert accepts(call) and accepts("<think>\nfree {text\n</think>\n\n" + call)
    assert not accepts("<think>\nfree text\n</think>\n\nno call") and not accepts("free text " + call)
    assert not accepts("<think>x</think>\n\n" + call.replace('"x": 2', '"x": 3'))


@pytest.mark.parametrize("family", ["qwen3", "qwen"])
@pytest.mark.parametrize("kind, value, good, bad", [
    ("json", {"type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"]}, '{"x":2}', '{"x":3}'),
    ("regex", r"[0-9]{2}/[a-z]", "42/q", "4/q"),
    ("choice", ["東京", "}"], "}", "Köln"),
    ("grammar", 'start: "a" B\nB: /[0-9]+/', "a12", "b12"),
])
def test_a_structured_output_is_constrained_only_after_the_reasoning(family, kind, value, good, bad):
    """response_format (any constraint) of a reasoning request: the reasoning free, the answer after
    </think> constrained (tags as tokens, Qwen3, and as plain text)."""
    from pagoda.server.chat.reasoning import after_reasoning
    from pagoda.engine.structured.manager import StructuredOutputs

    tok = build_tool_tokenizer(family)
    so = after_reasoning(StructuredOutputs(**{kind: value}), Reasoning(), token_spelling(tok))
    ltok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=[tok.eos_token_id])

    def accepts(text):
        m = llguidance.LLMatcher(ltok, llguidance.LLMatcher.grammar_from_lark(so.grammar), log_level=0)
        return m.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.is_accepting()
    assert accepts(good) and accepts("<think>\nfree {text: 東京\n</think>\n\n" + good)
    assert not accepts("<think>\nfree\n</think>\n\n" + bad) and not accepts("free text " + good)
    assert after_reasoning(StructuredOutputs(**{kind: value}), None, token_spelling(tok)).kind == kind
    with pytest.raises(InvalidRequestError) as e:  # a bad constraint still names its own field
        after_reasoning(StructuredOutputs(json={"type": "object", "properties": {"x": {"type": "nope"}}}),
                        Reasoning(), token_spelling(tok))
    assert e.value.field == "structured_outputs.json"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with tool_server(tmp_path_factory, "qwen3", num_kv_blocks=128) as s:
        yield s


def test_http_reasoning_then_a_call(srv):
    oai = openai_client(srv)
    tok = srv.engine.tokenizer
    bias = {str(tok.convert_tokens_to_ids("<think>")): 100, str(tok.convert_tokens_to_ids("</think>")): 100}
    kw = dict(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=60, logit_bias=bias,
              temperature=0.7, seed=3, parallel_tool_calls=False)
    whole = oai.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and json.loads(whole.message.tool_calls[0].function.arguments)["x"] in (1, 2)
    assert whole.message.model_extra.get("reasoning_content") is None  # opened and closed at once (the bias)
    assert whole.message.content is None
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    args = "".join(d.function.arguments or "" for c in chunks for ch in c.choices for d in ch.delta.tool_calls or [])
    assert args == whole.message.tool_calls[0].function.arguments


def test_http_reasoning_then_a_json_answer(srv):
    """response_format json_schema of a reasoning request: the reasoning free (some text before
    </think>), the content after it valid; the stream equals the unary answer."""
    oai = openai_client(srv)
    tok = srv.engine.tokenizer
    schema = {"type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"], "additionalProperties": False}
    bias = {str(tok.convert_tokens_to_ids("<think>")): 100, str(tok.convert_tokens_to_ids("</think>")): 6}
    kw = dict(model="m", messages=MESSAGES, max_tokens=80, logit_bias=bias, temperature=0.8, seed=1,
              response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    whole = oai.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "stop" and json.loads(whole.message.content)["x"] in (1, 2)
    assert whole.message.model_extra["reasoning_content"]  # free text before </think>
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    deltas = [ch.delta for c in chunks for ch in c.choices]
    assert "".join(d.content or "" for d in deltas) == whole.message.content
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == \
        whole.message.model_extra["reasoning_content"]
    with pytest.raises(openai.BadRequestError) as e:  # a bad schema still names its field
        oai.chat.completions.create(**{**kw, "response_format": {"type": "json_schema", "json_schema": {
            "name": "a", "schema": {"type": "object", "properties": {"x": {"type": "nope"}}}}}})
    assert e.value.body["param"] == "response_format.json_schema.schema"


def test_responses_reasoning_item(srv):
    """The Responses API: the reasoning as a `reasoning` item (its text the content) before the message,
    whole and streamed alike (response.reasoning_text.delta / .done)."""
    oai = openai_client(srv)
    tok = srv.engine.tokenizer
    schema = {"type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"], "additionalProperties": False}
    bias = {str(tok.convert_tokens_to_ids("<think>")): 100, str(tok.convert_tokens_to_ids("</think>")): 6}
    kw = dict(model="m", input=MESSAGES[0]["content"], max_output_tokens=80, temperature=0.8,
              extra_body={"seed": 1, "logit_bias": bias},
              text={"format": {"type": "json_schema", "name": "a", "schema": schema}})
    r = oai.responses.create(**kw)
    assert [o.type for o in r.output] == ["reasoning", "message"] and r.status == "completed"
    thought = r.output[0].content[0].text
    assert thought and r.output[0].summary == [] and json.loads(r.output[1].content[0].text)["x"] in (1, 2)
    events = list(oai.responses.create(**kw, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    done = events[-1].response
    assert [o.type for o in done.output] == ["reasoning", "message"]
    assert done.output[0].content[0].text == thought and done.output[1].content[0].text == r.output[1].content[0].text
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    # a reasoning item sent back as input is taken (and not rendered)
    nxt = oai.responses.create(model="m", max_output_tokens=2, input=[
        {"role": "user", "content": "Warum?"}, *[o.model_dump(exclude_none=True) for o in r.output],
        {"role": "user", "content": "Und?"}])
    assert nxt.status in ("completed", "incomplete")


def test_http_reasoning_content_and_template_kwargs(srv):
    oai = openai_client(srv)
    tok = srv.engine.tokenizer
    # a reasoning that never ends (the bias keeps the answer in it): all of it is reasoning_content
    bias = {str(tok.convert_tokens_to_ids("<think>")): 100}
    r = oai.chat.completions.create(model="m", messages=MESSAGES, max_tokens=5, logit_bias=bias, temperature=0)
    m = r.choices[0].message
    assert m.content == "" and m.model_extra["reasoning_content"] == "<think>" * 4
    streamed = list(oai.chat.completions.create(model="m", messages=MESSAGES, max_tokens=5, logit_bias=bias,
                                                temperature=0, stream=True))
    assert "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in streamed) == "<think>" * 4
    on = oai.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1).usage.prompt_tokens
    off = oai.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1,
                                      extra_body={"chat_template_kwargs": {"enable_thinking": False}}).usage
    assert off.prompt_tokens > on  # the empty <think></think> block the template adds
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1,
                                    extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    assert e.value.body["param"] == "chat_template_kwargs.add_generation_prompt"


def test_grpc_reasoning_content(srv):
    from pagoda.client.client import Client
    from pagoda.v1 import generation_pb2 as pb

    tok = srv.engine.tokenizer
    req = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in MESSAGES]))
    req.stopping.max_tokens, req.sampling.temperature = 5, 0
    req.sampling.logit_bias[tok.convert_tokens_to_ids("<think>")] = 100
    with Client(srv.target, timeout=60) as c:
        whole = c.stub.Generate(req, timeout=60)
        assert whole.reasoning_content == "<think>" * 4 and whole.text == ""
        stream = pb.GenerateStreamRequest.FromString(req.SerializeToString())
        assert "".join(m.reasoning_content for m in c.stub.GenerateStream(stream, timeout=60)) == "<think>" * 4
        # a structured output after the reasoning: free reasoning, then the answer valid (stream == unary)
        req.structured_output.regex = "[0-9]{3}"
        req.stopping.max_tokens, req.sampling.temperature, req.sampling.seed = 60, 0.8, 2
        req.sampling.logit_bias[tok.convert_tokens_to_ids("</think>")] = 6
        whole = c.stub.Generate(req, timeout=60)
        assert whole.reasoning_content and whole.text.isdigit() and len(whole.text) == 3
        stream = pb.GenerateStreamRequest.FromString(req.SerializeToString())
        msgs = list(c.stub.GenerateStream(stream, timeout=60))
        assert "".join(m.text for m in msgs) == whole.text
        assert "".join(m.reasoning_content for m in msgs) == whole.reasoning_content

"""server/chat/tools.py: each format's grammar takes its own calls (fixed separators, no free whitespace)
and refuses anything else; scanning returns the calls of a tool (one cut short last, not complete,
as far as it was written), and scanning a stream piece by piece gives what scanning the whole does,
each call's id and name first and its arguments in pieces; tools,
tool_choice and parallel_tool_calls are checked by field; formats are detected from the template."""
import json

import llguidance
import llguidance.hf
import pytest

from pagoda.engine.errors import InvalidRequestError
from pagoda.server.chat.tools import FORMATS, ToolStream, check_tools, detect, ends_in_calls, token_spelling, tool_format
from tool_templates import FAMILIES, build_tool_tokenizer

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "tags": {"type": "array", "items": {
    "enum": ["a", "b"]}}, "where": {"$ref": "#/$defs/P"}}, "required": ["city"], "additionalProperties": False,
    "$defs": {"P": {"type": "object", "properties": {"lat": {"type": "number"}}, "additionalProperties": False}}}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "g"}}]
NAMES = {"f", "g"}
FAMILY = {"hermes": "qwen", "llama3_json": "llama", "mistral": "mistral"}
# each format's own writing of: text "Zürich ", then f(city="東京", where={lat: 1.5}), then g()
F_ARGS = '{"city": "東京", "where": {"lat": 1.5}}'
CALLS = {
    "hermes": 'Zürich <tool_call>\n{"name": "f", "arguments": ' + F_ARGS + '}\n</tool_call>\n'
              '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',
    "llama3_json": '{"name": "f", "parameters": ' + F_ARGS + '}; {"name": "g", "parameters": {}}',
    "mistral": 'Zürich [TOOL_CALLS][{"name": "f", "arguments": ' + F_ARGS + '}, {"name": "g", "arguments": {}}]',
}


def matcher(tok, grammar: str):
    ltok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=[tok.eos_token_id])
    return llguidance.LLMatcher(ltok, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)


def accepts(tok, grammar: str, text: str) -> bool:
    m = matcher(tok, grammar)
    return m.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.is_accepting()


@pytest.mark.parametrize("name", FORMATS)
def test_the_grammar_takes_the_formats_calls_and_nothing_else(name):
    fmt, tok = FORMATS[name], build_tool_tokenizer(FAMILY[name])
    token = token_spelling(tok)
    calls_only = CALLS[name].removeprefix("Zürich ")
    auto = check_tools(TOOLS, "auto").grammar(fmt, token)
    required = check_tools(TOOLS, "required").grammar(fmt, token)
    single = check_tools(TOOLS, "required", parallel_tool_calls=False).grammar(fmt, token)
    named = check_tools(TOOLS, {"type": "function", "function": {"name": "g"}}).grammar(fmt, token)
    assert accepts(tok, required, calls_only) and accepts(tok, auto, CALLS[name])
    assert accepts(tok, auto, "Just text, no call: 東京") and accepts(tok, auto, "")
    end = {"hermes": "</tool_call>", "llama3_json": "; ", "mistral": ", {"}[name]
    first = calls_only[:calls_only.index(end) + (len(end) if name == "hermes" else 0)] + "]" * (name == "mistral")
    assert not accepts(tok, single, calls_only) and accepts(tok, single, first)
    assert not accepts(tok, named, first)  # only g may be called
    assert not accepts(tok, required, "Zürich")  # required: no text
    assert not accepts(tok, required, calls_only.replace('": ', '":', 1))  # fixed separators
    assert not accepts(tok, required, calls_only.replace('"city": "東京"', '"city": 1'))  # the schema
    assert not accepts(tok, required, calls_only.replace('{"lat": 1.5}', '{"lat": 1.5, "x": 1}'))  # $defs kept
    assert not accepts(tok, required, calls_only.replace(", ", ",  ", 1))


@pytest.mark.parametrize("name", FORMATS)
def test_scan_returns_the_calls_and_the_rest_as_content(name):
    fmt, text = FORMATS[name], CALLS[name]
    scan = fmt.scan(text, NAMES)
    assert [(c.name, c.arguments, c.complete) for c in scan.calls] == [("f", F_ARGS, True), ("g", "{}", True)]
    assert scan.content == ("" if name == "llama3_json" else "Zürich ")
    cut = text[:text.index('{"city"') + 12]  # cut inside f's arguments (max_tokens): f as far as written
    scan = fmt.scan(cut, NAMES)
    assert [(c.name, c.arguments, c.complete) for c in scan.calls] == [("f", '{"city": "東京', False)]
    assert scan.content == ("" if name == "llama3_json" else "Zürich ")
    cut = text[:text.index('"name": "g"') + 8]  # cut before g's name is whole: the call syntax is no content
    assert [(c.name, c.complete) for c in fmt.scan(cut, NAMES).calls] == [("f", True)]
    assert fmt.scan(cut, NAMES).content == fmt.scan(text, NAMES).content
    assert fmt.scan(text, {"g"}).calls == []  # a call of an unknown function: all content
    assert fmt.scan(text, {"g"}).content == text
    assert fmt.scan("plain text", NAMES).content == "plain text"
    assert ends_in_calls(fmt.scan(text, NAMES).calls) and not ends_in_calls(fmt.scan(text[:-3], NAMES).calls)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("cut", [None, -1, -5, -30])
def test_streamed_scan_equals_the_whole(name, cut):
    """Each call's id and name first, then its arguments in pieces; joined, the whole answer's calls."""
    fmt, text = FORMATS[name], CALLS[name][:cut]
    whole = fmt.scan(text, NAMES)
    for step in (1, 3, 7):
        stream, content, calls, ended = ToolStream(fmt, NAMES), "", {}, []
        pieces = [text[i:i + step] for i in range(0, len(text), step)]
        for i, piece in enumerate(pieces):
            c, deltas = stream.feed(piece, final=i == len(pieces) - 1)
            content += c
            for d in deltas:
                assert d.first == (d.index not in calls) and d.index == len(calls) - (not d.first)
                if d.first:
                    assert d.call.id.startswith("call_") and d.index == len(ended)
                    calls[d.index] = [d.call.id, d.call.name, ""]
                calls[d.index][2] += d.arguments
                if d.ended:
                    ended.append(d.call)
        assert content == whole.content
        got = [tuple(calls[k][1:]) for k in sorted(calls)]
        assert got == [(c.name, c.arguments) for c in whole.calls] == [(c.name, c.arguments) for c in ended]
        assert [c.complete for c in ended] == [c.complete for c in whole.calls]
        assert [c.id for c in ended] == [calls[k][0] for k in sorted(calls)]
        if step == 1 and whole.calls and len(whole.calls[0].arguments) > 8:
            assert len([d for d in stream_deltas(fmt, text) if d.index == 0 and d.arguments]) > 8  # pieces


def stream_deltas(fmt, text):
    stream = ToolStream(fmt, NAMES)
    return [d for i, ch in enumerate(text) for d in stream.feed(ch, final=i == len(text) - 1)[1]]


def test_content_before_a_call_streams_at_once():
    stream = ToolStream(FORMATS["hermes"], NAMES)
    assert stream.feed("Hello <tool") == ("Hello ", [])  # "<tool" may begin the trigger: held
    assert stream.feed("_call>\n{") == ("", [])
    content, (d,) = stream.feed('"name": "f", "arguments": {"c')  # the name whole: id and name go out
    assert content == "" and d.first and d.call.name == "f" and d.arguments == '{"c' and not d.ended


@pytest.mark.parametrize("tools, choice, parallel, field", [
    ("f", None, None, "tools"),
    ([{"type": "retrieval"}], None, None, "tools[0]"),
    ([{"type": "function", "function": {"name": ""}}], None, None, "tools[0].function.name"),
    ([TOOLS[0], TOOLS[0]], None, None, "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "h", "parameters": {"type": "array"}}}], None, None,
     "tools[0].function.parameters"),
    (TOOLS, "maybe", None, "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, None, "tool_choice.function.name"),
    (TOOLS, {"type": "function"}, None, "tool_choice"),
    (None, "required", None, "tool_choice"),
    (TOOLS, "auto", "yes", "parallel_tool_calls"),
    ([{"type": "function", "function": {"name": "h", "description": "\ud800"}}], None, None, "tools"),
])
def test_bad_tools_name_the_field(tools, choice, parallel, field):
    with pytest.raises(InvalidRequestError) as e:
        check_tools(tools, choice, parallel)
    assert e.value.field == field


def test_formats_are_detected_from_the_template():
    assert {family: detect(FAMILIES[family][0]).name for family in FAMILIES} == {
        "qwen": "hermes", "qwen3": "hermes", "llama": "llama3_json", "mistral": "mistral"}
    assert detect("{{ messages }}") is None and detect(None) is None
    tok = build_tool_tokenizer("qwen")
    assert tool_format(tok).name == "hermes" and tool_format(tok, "mistral").name == "mistral"
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(InvalidRequestError) as e:
        tool_format(tok)
    assert e.value.field == "tools"


class _Seq:  # what the manager reads and writes on a sequence
    matcher = watch = None
    is_finished = False


@pytest.mark.parametrize("trigger_is_token", [True, False])
def test_auto_watches_for_the_trigger_unmasked_then_constrains_the_call(trigger_is_token):
    """auto's grammar is lazy: no matcher and no mask while the model writes text (with the trigger a
    token, and with it plain text spread over tokens); from the trigger on the call is constrained,
    and the text before it is content."""
    from pagoda.engine.sampling_params import SamplingParams
    from pagoda.engine.outputs import FinishReason
    from pagoda.engine.structured.manager import StructuredOutputManager
    from pagoda.server.chat.tools import constrain
    from pagoda.engine.demo import build_byte_tokenizer

    tok = build_tool_tokenizer("qwen") if trigger_is_token else build_byte_tokenizer()
    fmt = FORMATS["hermes"]
    params, parsing = constrain(check_tools(TOOLS, "auto", parallel_tool_calls=False), fmt, SamplingParams(max_tokens=64), tok)
    so = params.structured_outputs
    assert so.trigger == "<tool_call>"
    required, _ = constrain(check_tools(TOOLS, "required"), fmt, SamplingParams(max_tokens=64), tok)
    assert required.structured_outputs.trigger is None  # required stays eager
    manager = StructuredOutputManager(tok, len(tok), [tok.eos_token_id])
    try:
        grammar = manager.compiler.compile(so)
        seq = _Seq()
        manager.add([seq], grammar, so.trigger)
        manager.wait(10)
        ready, failed = manager.take_ready()
        assert ready == [seq] and not failed
        assert seq.matcher is None and seq.watch is not None
        assert (seq.watch.token is not None) == trigger_is_token
        text = "Zürich <tool_ca"  # text, and half a trigger when it is plain text: still no mask
        for t in tok.encode(text, add_special_tokens=False):
            assert manager.watch(seq, t) == (None, None)
        assert seq.matcher is None and manager.bitmasks([seq]) is None
        call = 'll>\n{"name": "f", "arguments": {"city": "東京"}}\n</tool_call>'
        if trigger_is_token:
            text, call = "Zürich ", '<tool_call>\n{"name": "f", "arguments": {"city": "東京"}}\n</tool_call>'
        ids = tok.encode(call, add_special_tokens=False)
        reason, first = None, True
        for t in ids:
            if seq.matcher is None:
                reason, _ = manager.watch(seq, t)
            else:
                rows, bits = manager.bitmasks([seq])  # constrained: the mask allows this token
                assert rows == [0] and bits[0, t // 32] >> (t % 32) & 1
                x = tok.convert_tokens_to_ids("x")
                assert not first or not bits[0, x // 32] >> (x % 32) & 1  # a letter never follows the trigger
                first = False
                reason, _ = manager.accept(seq, t)
        assert reason is FinishReason.GRAMMAR  # the call whole: the grammar ends the output
        answer = parsing.scan(text + call)
        assert answer.content == "Zürich " and [(c.name, json.loads(c.arguments)) for c in answer.calls] == [
            ("f", {"city": "東京"})]
    finally:
        manager.close()

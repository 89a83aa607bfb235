"""Tool calling: the one home of tool-call formats (how a model family writes a call, the grammar
that makes it write only well-formed, schema-valid calls, and how its output is parsed back) and
of a request's tools (checked, then rendered by the chat template and compiled to that grammar).

A format is chosen from the chat template's text (detect) or by name (--tool-call-parser, vLLM's
flag and names). The grammar is llguidance Lark with each function's parameters inlined as %json
with fixed separators (a weak model cannot pad a call with whitespace until max_tokens):
  - "required" / a named function: the whole output is the format's calls (one, or several when
    parallel_tool_calls);
  - "auto": free text, or free text then calls. Lazy where the format has a trigger (Hermes, Mistral):
    no grammar and no mask on the free text, the engine watches for the trigger (its token, or its
    text) and constrains the calls from just after it (StructuredOutputs.trigger). Llama's trigger,
    "{" at the start, and reasoning requests keep the eager grammar: free text as one lexeme that
    cannot spell the trigger, one mask per step;
  - "none": tools rendered in the prompt, nothing constrained or parsed.
Parsing (scan) reads each call from its name on (the call's arguments are the model's own text of
them); text that is not a call of a tool is content. Every call of an output that ended after its
calls (finish "tool_calls") is whole and valid; an output cut inside a call (max_tokens, a stop
string, the time limit) returns that call as far as it was written (complete False), as OpenAI
does. A stream is read with the same function: each call's id and name once its name is written,
then its arguments in pieces as they come, so the concatenated stream equals the unary answer."""
from __future__ import annotations

import copy
import dataclasses
import json
import uuid
from dataclasses import dataclass

from pagoda.engine.errors import InvalidRequestError
from pagoda.engine.structured.manager import StructuredOutputs, added_token_ids
from pagoda.engine.validation import check_text
from pagoda.server.chat import TOOL_CALL_PARSERS
from pagoda.server.chat.reasoning import after_reasoning

CHOICES = ("none", "auto", "required")
# the separators every call is written with (Qwen's and Llama's own style: json.dumps' defaults)
_SEPARATORS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_DECODER = json.JSONDecoder()
_MORE, _BAD = -1, -2  # _lit's answers: the text ends inside the literal; the text differs


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as the model wrote it (cut short where not complete)
    id: str = ""
    complete: bool = True  # the call ended: its arguments whole and its format's closing written


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def ends_in_calls(calls) -> bool:
    """Whether an output that stopped normally stopped after its calls (finish_reason tool_calls)."""
    return bool(calls) and calls[-1].complete


@dataclass(frozen=True)
class CallDelta:
    """What a stream's feed brings of call `index`: `call` so far (its id, name, arguments so far),
    `arguments` new since the last delta; `first`: its id and name are new; `ended`: whole, or cut
    short at the output's end."""
    index: int
    call: ToolCall
    arguments: str
    first: bool
    ended: bool


@dataclass(frozen=True)
class Scan:
    """What an output holds: `content` (the text before any call, and whatever follows the last call
    that parsed), and the calls; `pending` (streaming): text held back because a call may be under way."""
    content: str
    calls: list
    pending: bool = False


class ToolFormat:
    """A model family's way of writing calls: `trigger` (the text a call region starts with),
    `key` (the arguments' key in a call object)."""
    name = ""
    trigger = ""
    key = "arguments"
    markers = ()  # strings in a chat template that mean this format

    def call_schema(self, tool: dict) -> dict:
        """One call of `tool` as a JSON object schema (the tool's $defs moved to the root so its
        "#/$defs/..." references still resolve)."""
        params = copy.deepcopy(tool.get("parameters") or {"type": "object", "properties": {}})
        defs = {k: params.pop(k) for k in ("$defs", "definitions") if k in params}
        return {"type": "object", "properties": {"name": {"const": tool["name"]}, self.key: params},
                "required": ["name", self.key], "additionalProperties": False, **defs, "x-guidance": _SEPARATORS}

    def grammar(self, tools: list[dict], parallel: bool, auto: bool, token) -> str:
        """The Lark grammar of an output: calls only, or (auto) free text or text then calls.
        token(text) -> the grammar's spelling of a marker (a special token as <[id]>, else a literal)."""
        rules = [f"c{i}: %json {json.dumps(self.call_schema(t), ensure_ascii=False)}" for i, t in enumerate(tools)]
        call = " | ".join(f"c{i}" for i in range(len(tools)))
        lines = [*self.calls_rules(call, parallel, token), *rules]
        if auto:
            lines = [*self.auto_rules(token), *lines]
        else:
            lines = ["start: calls", *lines]
        return "\n".join(lines)

    def lazy_grammar(self, tools: list[dict], parallel: bool, token) -> str | None:
        """auto's grammar as a lazy one (StructuredOutputs.trigger): the calls from just after the
        trigger on, the text before it free and unmasked; None where the format has none."""
        rules = [f"c{i}: %json {json.dumps(self.call_schema(t), ensure_ascii=False)}" for i, t in enumerate(tools)]
        call = " | ".join(f"c{i}" for i in range(len(tools)))
        return "\n".join([self.after_trigger(call, parallel, token), *self.calls_rules(call, parallel, token), *rules])

    def after_trigger(self, call: str, parallel: bool, token) -> str:
        raise NotImplementedError

    def calls_rules(self, call: str, parallel: bool, token) -> list[str]:
        raise NotImplementedError

    def auto_rules(self, token) -> list[str]:
        """Free text, or calls after free text: the text cannot spell the trigger when it is a token."""
        trig = token(self.trigger)
        if trig.startswith("<["):
            text = r"TEXT: /(.|\n)+/"
            return ["start: TEXT? calls?", text]  # an empty answer too
        # the trigger is plain text: calls only at the start, text never spells it
        esc = json.dumps(self.trigger)[1:-1].replace("/", "\\/")
        esc = "".join("\\" + c if c in ".[]()|*+?{}^$" else c for c in esc)
        return ["start: TEXT? | calls", rf"TEXT: /(.|\n)+/ & ~/(.|\n)*{esc}(.|\n)*/"]

    def scan(self, text: str, names: set, final: bool = True) -> Scan:
        """The content and calls of an output (final: it has ended; else a stream's text so far)."""
        start = self.region(text)
        if start < 0:
            held = 0 if final else _partial_suffix(text, self.trigger)
            return Scan(text[:len(text) - held], [], held > 0)
        calls, end, over = self.parse_calls(text, start, names)
        if not over or (calls and not calls[-1].complete):  # under way, or cut short inside the calls
            return Scan(text[:start], calls, not final)
        rest = text[end if calls else start:]
        return Scan(text[:start] + (rest if rest.strip() or not calls else ""), calls)

    def region(self, text: str) -> int:
        return text.find(self.trigger)

    def parse_calls(self, text: str, start: int, names: set) -> tuple[list, int, bool]:
        """(calls read from start on, the last one maybe not complete; where the whole calls end;
        whether the region is over: nothing after `end` can become a call)."""
        raise NotImplementedError

    def call_at(self, text: str, pos: int, names: set, closing: tuple) -> tuple[ToolCall | None, int]:
        """The call object {"name": ..., key: {...}} at pos, then its `closing` literals: (call, end);
        (None, _MORE): the text ends before its name is whole; (None, _BAD): not a call of a tool. A call
        whose arguments or closing are not whole is returned not complete, with end at the text's end."""
        for lit in ("{", '"name"', ":"):
            pos = _lit(text, pos, lit)
            if pos < 0:
                return None, pos
        pos = _skip_ws(text, pos)
        if pos == len(text) or text[pos] != '"':
            return None, _MORE if pos == len(text) else _BAD
        try:
            name, pos = _DECODER.raw_decode(text, pos)
        except ValueError:
            return None, _MORE
        if name not in names:
            return None, _BAD
        for lit in (",", json.dumps(self.key), ":"):
            pos = _lit(text, pos, lit)
            if pos < 0:
                return ToolCall(name, "", complete=False), len(text)
        pos = _skip_ws(text, pos)
        try:
            args, end = _DECODER.raw_decode(text, pos)
        except ValueError:
            return ToolCall(name, text[pos:], complete=False), len(text)
        if not isinstance(args, dict):
            return ToolCall(name, text[pos:end], complete=False), len(text)
        close = end
        for lit in ("}", *closing):
            close = _lit(text, close, lit)
            if close < 0:
                return ToolCall(name, text[pos:end], complete=False), len(text)
        return ToolCall(name, text[pos:end]), close

    def separated_calls(self, text: str, head: int, start: int, names: set, sep: str, close: str | None = None,
                        closing: tuple = ()):
        """parse_calls for calls written one after another (the first at head, each followed by its
        `closing` literals), `sep` before each next one, the list ended by `close` when given (else by
        anything but `sep`)."""
        calls, pos = [], start
        while True:
            call, end = self.call_at(text, head, names, closing)
            if call is None:
                return calls, pos, end == _BAD
            calls.append(call)
            if not call.complete:
                return calls, end, False
            pos = end
            shut = _lit(text, end, close) if close else _BAD
            if shut >= 0:
                return calls, shut, True
            head = _lit(text, end, sep)
            if head < 0:
                return calls, pos, head == _BAD and shut == _BAD


class Hermes(ToolFormat):
    """Hermes / Qwen2.5 / Qwen3: <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, one
    block per call, blocks separated by a newline."""
    name = "hermes"
    trigger, end = "<tool_call>", "</tool_call>"
    markers = ("<tool_call>",)

    def calls_rules(self, call, parallel, token):
        more = ' ("\\n" block)*' if parallel else ""
        return ["calls: block" + more, f'block: {token(self.trigger)} "\\n" ({call}) "\\n" {token(self.end)}']

    def after_trigger(self, call, parallel, token):
        return f'start: "\\n" ({call}) "\\n" {token(self.end)}' + (' ("\\n" block)*' if parallel else "")

    def parse_calls(self, text, start, names):
        head = _lit(text, start, self.trigger)
        if head < 0:  # over unless what follows may begin a block
            return [], start, head == _BAD
        return self.separated_calls(text, head, start, names, self.trigger, closing=(self.end,))


class Llama3Json(ToolFormat):
    """Llama 3.1+ JSON calls: {"name": ..., "parameters": {...}} at the start of the answer, several
    separated by "; " (vLLM's llama3_json)."""
    name = "llama3_json"
    trigger, key = "{", "parameters"
    markers = ("<|python_tag|>", "ipython")

    def calls_rules(self, call, parallel, token):
        more = f' ("; " ({call}))*' if parallel else ""
        return [f"calls: ({call})" + more]

    def auto_rules(self, token):
        return ["start: TEXT? | calls", r"TEXT: /[^{](.|\n)*/"]

    def lazy_grammar(self, tools, parallel, token):
        return None  # the trigger, "{", is a call's own first byte: the eager grammar decides at the first token

    def region(self, text):
        return 0 if text.startswith(self.trigger) else -1

    def parse_calls(self, text, start, names):
        return self.separated_calls(text, start, start, names, ";")


class Mistral(ToolFormat):
    """Mistral: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...], one array of calls."""
    name = "mistral"
    trigger = "[TOOL_CALLS]"
    markers = ("[TOOL_CALLS]",)

    def grammar(self, tools, parallel, auto, token):
        return "\n".join([*(self.auto_rules(token) if auto else ["start: calls"]), *self._calls(tools, parallel, token)])

    def lazy_grammar(self, tools, parallel, token):
        return "\n".join(["start: arr", *self._calls(tools, parallel, token)])

    def _calls(self, tools, parallel, token) -> list[str]:
        items = {"anyOf": [self.call_schema(t) for t in tools]}
        for item in items["anyOf"]:  # the options go at the root, with every $defs
            item.pop("x-guidance")
            for k in ("$defs", "definitions"):
                if k in item:
                    items.setdefault(k, {}).update(item.pop(k))
        defs = {k: items.pop(k) for k in ("$defs", "definitions") if k in items}
        schema = {"type": "array", "items": items, "minItems": 1, **({} if parallel else {"maxItems": 1}),
                  **defs, "x-guidance": _SEPARATORS}
        return [f"calls: {token(self.trigger)} arr", f"arr: %json {json.dumps(schema, ensure_ascii=False)}"]

    def parse_calls(self, text, start, names):
        head = _lit(text, start + len(self.trigger), "[")
        if head < 0:
            return [], start, head == _BAD
        return self.separated_calls(text, head, start, names, ",", "]")  # the calls before one cut short are whole


FORMATS = {f.name: f for f in (Hermes(), Llama3Json(), Mistral())}
assert tuple(FORMATS) == TOOL_CALL_PARSERS, "the parsers' names are listed in server/chat/__init__.py"


def detect(chat_template) -> ToolFormat | None:
    """The call format a chat template speaks, from its text; None: it renders no tools."""
    if isinstance(chat_template, dict):  # several named templates: the one used by default
        chat_template = chat_template.get("default") or next(iter(chat_template.values()), "")
    text = chat_template or ""
    if "tools" not in text:
        return None
    for fmt in FORMATS.values():
        if any(m in text for m in fmt.markers):
            return fmt
    return FORMATS["hermes"]  # a template that renders tools with no marker of its own: the commonest format


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools, checked: `tools` exactly as the client sent them (what the chat template
    renders), `choice`: none, auto, required or a function's name; `parallel`: several calls allowed."""
    tools: list
    choice: str
    parallel: bool = True

    @property
    def names(self) -> set:
        return {t["function"]["name"] for t in self.tools}

    @property
    def constrains(self) -> bool:
        return self.choice != "none"

    def grammar(self, fmt: ToolFormat, token) -> str:
        funcs = [t["function"] for t in self.tools]
        if self.choice not in ("auto", "required"):
            funcs = [f for f in funcs if f["name"] == self.choice]
        return fmt.grammar(funcs, self.parallel and self.choice in ("auto", "required"), self.choice == "auto", token)

    def lazy_grammar(self, fmt: ToolFormat, token) -> str | None:
        """auto's grammar from the format's trigger on (None: not auto, or a format without one)."""
        if self.choice != "auto":
            return None
        return fmt.lazy_grammar([t["function"] for t in self.tools], self.parallel, token)


def check_tools(tools, tool_choice=None, parallel_tool_calls=None) -> ToolRequest | None:
    """A request's tools, tool_choice and parallel_tool_calls (OpenAI's shapes), checked; None when no
    tools are given. Raises InvalidRequestError naming the field."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none"):
            raise InvalidRequestError("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list):
        raise InvalidRequestError("tools", "must be a list of {\"type\": \"function\", \"function\": {...}}")
    check_text("tools", json.dumps(tools, ensure_ascii=False, default=str))
    seen = set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise InvalidRequestError(where, "must be {\"type\": \"function\", \"function\": {\"name\": ..., "
                                             "\"parameters\": {...}}}: this server calls functions only")
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not name or len(name) > 64 or not all(c.isalnum() or c in "_-" for c in name):
            raise InvalidRequestError(f"{where}.function.name",
                                      f"must be 1 to 64 letters, digits, _ or -, got {name!r}")
        if name in seen:
            raise InvalidRequestError(f"{where}.function.name", f"{name!r} is given twice")
        seen.add(name)
        params = f.get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
            raise InvalidRequestError(f"{where}.function.parameters", "must be a JSON Schema of an object")
    choice = _choice(tool_choice, seen)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidRequestError("parallel_tool_calls", f"must be a bool, got {parallel_tool_calls!r}")
    return ToolRequest(tools, choice, parallel_tool_calls is not False)


def _choice(tool_choice, names: set) -> str:
    if tool_choice is None:
        return "auto"
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise InvalidRequestError("tool_choice", f"must be one of {', '.join(CHOICES)} or "
                                                     f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, "
                                                     f"got {tool_choice!r}")
        return tool_choice
    f = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = f.get("name") if isinstance(f, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise InvalidRequestError("tool_choice", "must be {\"type\": \"function\", \"function\": {\"name\": ...}}")
    if name not in names:
        raise InvalidRequestError("tool_choice.function.name", f"{name!r} is not one of the tools given")
    return name


def token_spelling(tokenizer):
    """token(text) for grammars: a text that is one added token of the tokenizer as <[id]> (llguidance
    sees added tokens as special), else a Lark literal."""

    added = added_token_ids(tokenizer)

    def token(text: str) -> str:
        return f"<[{added[text]}]>" if text in added else json.dumps(text, ensure_ascii=False)
    return token


def _without(text: str, drop: tuple) -> str:
    for t in drop:
        if t in text:
            text = text.replace(t, "")
    return text


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \n\t\r":
        pos += 1
    return pos


def _lit(text: str, pos: int, lit: str) -> int:
    """The position after `lit` at pos (whitespace before it skipped), else _MORE or _BAD."""
    pos = _skip_ws(text, pos)
    got = text[pos:pos + len(lit)]
    if got == lit:
        return pos + len(lit)
    return _MORE if lit.startswith(got) else _BAD


def _partial_suffix(text: str, trigger: str) -> int:
    """The length of text's longest suffix that begins the trigger (held back while streaming)."""
    for n in range(min(len(trigger) - 1, len(text)), 0, -1):
        if trigger.startswith(text[-n:]):
            return n
    return 0


class ToolStream:
    """A streamed choice's text read as it grows: feed(delta) -> (new content, CallDeltas); content is
    given as soon as it cannot be the start of a call; a call's id and name once its name is written,
    then its arguments as they come."""

    def __init__(self, fmt: ToolFormat, names: set, drop: tuple = ()):
        self.fmt, self.names, self.drop = fmt, names, drop
        self.text, self.sent = "", 0
        self.calls: list[ToolCall] = []  # the calls so far, with their ids
        self.num_ended = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, list]:
        self.text += delta  # a special token's text comes whole, in one delta
        scan = self.fmt.scan(_without(self.text, self.drop), self.names, final)
        content, self.sent = scan.content[self.sent:], max(self.sent, len(scan.content))
        deltas = []
        for i, c in enumerate(scan.calls[self.num_ended:], self.num_ended):
            first = i == len(self.calls)
            sent = "" if first else self.calls[i].arguments
            call = dataclasses.replace(c, id=new_call_id() if first else self.calls[i].id)
            self.calls[i:i + 1] = [call]
            ended = c.complete or final
            if first or ended or len(c.arguments) > len(sent):
                deltas.append(CallDelta(i, call, c.arguments[len(sent):], first, ended))
            self.num_ended += ended
        return content, deltas


def tool_format(tokenizer, name: str | None = None) -> ToolFormat:
    """The call format for a request with tools: `name` (--tool-call-parser) or the chat template's;
    InvalidRequestError naming `tools` when the template renders no tools."""
    if name is not None:
        return FORMATS[name]
    fmt = detect(getattr(tokenizer, "chat_template", None))
    if fmt is None:
        raise InvalidRequestError("tools", "are not supported by this model: its chat template renders no tools")
    return fmt


@dataclass(frozen=True)
class ToolParsing:
    """How a request's output is read back (server/chat/answer.py AnswerReader): the format, the functions, and
    the special tokens' texts that are no part of the answer (the output keeps special tokens for the
    format's markers: EOS and the like are dropped here)."""
    format: str
    names: frozenset
    drop: tuple = ()

    def scan(self, text: str) -> Scan:
        return FORMATS[self.format].scan(_without(text, self.drop), self.names)

    def stream(self) -> ToolStream:
        return ToolStream(FORMATS[self.format], self.names, self.drop)


def constrain(tools: ToolRequest | None, fmt: ToolFormat | None, params, tokenizer, reasoning=None):
    """(params, ToolParsing) of a request whose tools are rendered: with tool_choice other than none,
    its output constrained to the format's calls (the markers kept in the text, which is parsed);
    else (params, None), a reasoning request's structured output constrained after its reasoning.
    Every chat request, on every door, goes through here."""
    if tools is None or not tools.constrains:
        if reasoning is None or params.structured_outputs is None:
            return params, None
        so = after_reasoning(params.structured_outputs, reasoning, token_spelling(tokenizer))
        return params.replace(structured_outputs=so), None
    if params.structured_outputs is not None:
        raise InvalidRequestError("structured_outputs", f"conflicts with tool_choice {tools.choice!r}: set "
                                                        f"tool_choice none for a structured answer")
    token = token_spelling(tokenizer)
    # auto watches for the trigger with no grammar until it comes; with reasoning, the eager grammar
    # (it alone knows where the reasoning ends)
    lazy = tools.lazy_grammar(fmt, token) if reasoning is None else None
    if lazy is not None:
        so = StructuredOutputs(grammar=lazy, trigger=fmt.trigger)
    else:
        grammar = tools.grammar(fmt, token)
        so = after_reasoning(StructuredOutputs(grammar=grammar), reasoning, token)
    markers = {fmt.trigger, getattr(fmt, "end", None)}
    drop = tuple(t for t in getattr(tokenizer, "all_special_tokens", ()) if t not in markers)
    return (params.replace(structured_outputs=so, skip_special_tokens=False),
            ToolParsing(fmt.name, frozenset(tools.names), drop))


def message_tool_fields(where: str, role: str, tool_call_id, tool_calls) -> dict:
    """A chat message's tool fields as chat templates read them, checked (`where`: the message's field
    path, e.g. "messages[2]"): a tool message's tool_call_id; an assistant's tool_calls (OpenAI's shape,
    their arguments parsed to an object: templates write them with tojson, as vLLM gives them)."""
    out = {}
    if tool_calls and role != "assistant":
        raise InvalidRequestError(f"{where}.tool_calls", f"is not a field of a {role} message")
    if (tool_call_id is not None) != (role == "tool"):
        raise InvalidRequestError(f"{where}.tool_call_id", "is required in a tool message" if role == "tool"
                                  else f"is not a field of a {role} message")
    if tool_call_id is not None:
        out["tool_call_id"] = check_text(f"{where}.tool_call_id", tool_call_id)
    if tool_calls:
        out["tool_calls"] = [_template_call(f"{where}.tool_calls[{j}]", c) for j, c in enumerate(tool_calls)]
    return out


def _template_call(where: str, c) -> dict:
    f = c.get("function") if isinstance(c, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(f.get("arguments"), str):
        raise InvalidRequestError(where, "must be {\"id\": ..., \"type\": \"function\", \"function\": "
                                         "{\"name\": STRING, \"arguments\": JSON TEXT}}")
    args = _loads(f["arguments"]) if f["arguments"].strip() else {}
    if not isinstance(args, dict):
        raise InvalidRequestError(f"{where}.function.arguments", "must be a JSON object's text")
    return {"id": c.get("id"), "type": "function", "function": {"name": f["name"], "arguments": args}}

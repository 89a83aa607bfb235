"""Reasoning models (Qwen3, DeepSeek-R1): the answer's `<think>...</think>` part returned apart from
it (vLLM's and DeepSeek's `reasoning_content`), and the grammar prefix that lets a constrained answer
(tool calls, a structured output) begin only after `</think>`.

On when the chat template writes `<think>` (a reasoning model's template does; --reasoning-parser
names it explicitly). The text before `</think>` is the reasoning, with or without its opening tag
(DeepSeek-R1's template opens it in the prompt); an answer without `</think>` that opens with
`<think>` is all reasoning (cut short); any other answer is all content."""
from __future__ import annotations

import json
from dataclasses import dataclass

from pagoda.engine.errors import InvalidRequestError
from pagoda.engine.structured.manager import StructuredOutputs, as_lark
from pagoda.server.chat import REASONING_PARSERS

OPEN, CLOSE = "<think>", "</think>"
PARSERS = REASONING_PARSERS  # both read <think>...</think>
# chat_template_kwargs a request may give (a template is code: nothing else reaches it)
TEMPLATE_KWARGS = {"enable_thinking": bool, "thinking": bool}


@dataclass(frozen=True)
class Reasoning:
    """Reads an answer's reasoning (kept on its EngineRequest). opened: the prompt ends with <think>
    (DeepSeek-R1's template opens it), so the answer starts inside the reasoning."""
    opened: bool = False

    def split(self, text: str, final: bool = True) -> tuple[str, str]:
        """(reasoning, content). While streaming (not final), text that may still become a tag is held
        back, so that each part only grows."""
        if not (self.opened or text.startswith(OPEN)):
            if not final and OPEN.startswith(text):
                return "", ""
            return "", text
        end = text.find(CLOSE)
        if end >= 0:
            return _strip_open(text[:end]), text[end + len(CLOSE):].lstrip("\n")
        held = 0 if final else _partial(text, CLOSE)
        return _strip_open(text[:len(text) - held]), ""

    def wrap(self, grammar: str, token) -> str:
        """A constrained answer's grammar (its first line `start: ...`) with the reasoning before it:
        free text inside <think>...</think>, then the answer constrained."""
        first, _, rest = grammar.partition("\n")
        nl = '("\\n" | "\\n\\n")?'
        if token(CLOSE).startswith("<["):  # the tags are tokens: the reasoning's text cannot spell them
            head = "" if self.opened else f"{token(OPEN)} "
            think = [f"think: {head}THINK_TEXT? {token(CLOSE)} {nl}", r"THINK_TEXT: /(.|\n)+/"]
        else:  # plain text: one lexeme that ends at the first closing tag
            head = "" if self.opened else "<think>"
            think = [f"think: THINK {nl}", rf"THINK: /{head}(.|\n)*<\/think>/ & ~/(.|\n)*<\/think>(.|\n)+/"]
        start = f"start: think{'' if self.opened else '?'} answer"
        return "\n".join([start, "answer: " + first.removeprefix("start: "), *think, rest])


def after_reasoning(so, reasoning: Reasoning | None, token):
    """A structured output (response_format) of a reasoning request, constrained only after the
    reasoning (the reasoning free); unchanged without reasoning or when lazy (its trigger)."""
    if reasoning is None or so is None or so.trigger is not None:
        return so
    return StructuredOutputs(grammar=reasoning.wrap(as_lark(so), token))


def reasoning_for(tokenizer, prompt_ids: list[int], name: str | None = None) -> Reasoning | None:
    """A chat request's Reasoning: with --reasoning-parser, or when the chat template writes <think>;
    None otherwise."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default") or ""
    if name is None and not (template and OPEN in template and CLOSE in template):
        return None
    tail = tokenizer.decode(prompt_ids[-4:], skip_special_tokens=False).rstrip()
    return Reasoning(opened=tail.endswith(OPEN))


def check_template_kwargs(kwargs) -> dict:
    """chat_template_kwargs, checked against the allow-list (InvalidRequestError naming the key)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise InvalidRequestError("chat_template_kwargs", "must be an object")
    for key, value in kwargs.items():
        kind = TEMPLATE_KWARGS.get(key)
        if kind is None:
            raise InvalidRequestError(f"chat_template_kwargs.{key}", f"is not one this server passes to the chat "
                                                                     f"template (only {', '.join(TEMPLATE_KWARGS)})")
        if not isinstance(value, kind):
            raise InvalidRequestError(f"chat_template_kwargs.{key}", f"must be a {kind.__name__}, got "
                                                                     f"{json.dumps(value)}")
    return dict(kwargs)


class ReasoningStream:
    """A streamed answer split as it grows: feed(delta) -> (new reasoning, new content)."""

    def __init__(self, reasoning: Reasoning):
        self.reasoning, self.text, self.sent = reasoning, "", (0, 0)

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.text += delta
        r, c = self.reasoning.split(self.text, final)
        out = r[self.sent[0]:], c[self.sent[1]:]
        self.sent = (max(self.sent[0], len(r)), max(self.sent[1], len(c)))
        return out


def _strip_open(text: str) -> str:
    return (text[len(OPEN):] if text.startswith(OPEN) else text).lstrip("\n")


def _partial(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0

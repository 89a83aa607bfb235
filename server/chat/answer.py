"""A chat completion read back (AnswerReader): the reasoning apart, the tool calls parsed, whole or
as a stream whose pieces, joined, are the whole answer."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagoda.server.chat.reasoning import Reasoning, ReasoningStream
from pagoda.server.chat.tools import ToolParsing, new_call_id


@dataclass(frozen=True)
class Answer:
    """A completion read back: its reasoning (None: not a reasoning request), content and tool calls
    (ToolCalls: whole ones, or one cut short last; streamed: those that ended in this piece), and in a
    stream the calls' pieces (CallDeltas)."""
    reasoning: str | None
    content: str
    calls: list
    deltas: tuple = ()


@dataclass(frozen=True)
class AnswerReader:
    """How a chat completion's text is read back: its reasoning apart (Reasoning), its tool calls
    parsed (ToolParsing); PLAIN reads neither. chat_request makes one beside each EngineRequest."""
    tool_parsing: ToolParsing | None = None
    reasoning: Reasoning | None = None

    @property
    def reads(self) -> bool:
        """Whether the text is read at all (else it is the answer's content as it is)."""
        return self.tool_parsing is not None or self.reasoning is not None

    def read(self, text: str) -> Answer:
        """A whole completion read back."""
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(text)
        if self.tool_parsing is None:
            return Answer(reasoning, text, [])
        scan = self.tool_parsing.scan(text)
        return Answer(reasoning, scan.content, [dataclasses.replace(c, id=new_call_id()) for c in scan.calls])

    def stream(self) -> AnswerStream | None:
        """A streamed completion's reader; None when nothing is read."""
        return AnswerStream(self) if self.reads else None


PLAIN = AnswerReader()


class AnswerStream:
    """A streamed completion read back as it grows: feed(delta, final) -> an Answer of what is new;
    the parts fed, joined, are AnswerReader.read's."""

    def __init__(self, reader: AnswerReader):
        self.reasoning = reader.reasoning and ReasoningStream(reader.reasoning)
        self.tools = reader.tool_parsing and reader.tool_parsing.stream()

    @property
    def calls(self) -> list:
        """The calls so far (the last one maybe not complete)."""
        return self.tools.calls if self.tools else []

    def feed(self, delta: str, final: bool = False) -> Answer:
        reasoning = None
        if self.reasoning:
            reasoning, delta = self.reasoning.feed(delta, final)
        if not self.tools:
            return Answer(reasoning, delta, [])
        content, deltas = self.tools.feed(delta, final)
        return Answer(reasoning, content, [d.call for d in deltas if d.ended], tuple(deltas))

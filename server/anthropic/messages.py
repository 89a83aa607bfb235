"""POST /v1/messages and /v1/messages/count_tokens: a Messages request becomes a chat request
(convert.py) and goes the chat endpoint's one path; its answer is read back (AnswerReader) into
Anthropic's content blocks (thinking, text, tool_use), whole or as Anthropic's events."""
from __future__ import annotations

import json
from functools import partial

from fastapi import Request
from fastapi.responses import Response

from pagoda.engine.errors import InvalidRequestError
from pagoda.engine.validation import new_request_id
from pagoda.server.anthropic.convert import renamed, thinking_kwargs, to_chat
from pagoda.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from pagoda.server.chat.answer import AnswerStream
from pagoda.server.chat.tools import ends_in_calls
from pagoda.server.openai.chat import Chat
from pagoda.server.openai.protocol import ChatRequest
from pagoda.server.http.serving import Call, Serving


class Messages:
    def __init__(self, serving: Serving):
        self.serving, self.chat = serving, Chat(serving)

    def routes(self) -> list:
        return [("POST", "/v1/messages", self.create), ("POST", "/v1/messages/count_tokens", self.count_tokens)]

    async def create(self, body: MessagesRequest, request: Request) -> Response:
        try:
            chat, thinking = to_chat(body)
        except InvalidRequestError as e:
            return self.serving.dialect.error_for(e)
        return await self.serving.generate(chat, request, "msg_", partial(self._requests, chat, thinking),
                                           partial(_whole, body), partial(_events, body))

    async def count_tokens(self, body: CountTokensRequest) -> Response:
        """The prompt's length as a call renders it (the same path, its request made, not run)."""
        def count(engine):
            self.serving.check_model(body.model)
            chat, thinking = to_chat(body)
            # nothing is generated: no grammar to compile (the tools are rendered whatever the choice)
            chat = chat.model_copy(update={"tool_choice": "none" if chat.tools else None,
                                           "parallel_tool_calls": None, "max_tokens": 1})
            (req,), _ = self._requests(chat, thinking, engine, "msg_count_" + new_request_id())
            return {"input_tokens": len(req.prompt_token_ids)}
        return self.serving.plain(count)

    def _requests(self, chat: ChatRequest, thinking: bool | None, engine, rid: str) -> tuple:
        """The chat path's requests (thinking as the template's switch); its errors under Anthropic's names."""
        chat = chat.model_copy(update={"chat_template_kwargs": thinking_kwargs(engine.tokenizer, thinking)})
        try:
            return self.chat.requests(chat, engine, rid, fit_context=True)
        except InvalidRequestError as e:
            raise renamed(e) from None


# ---- the answer ----

def _whole(body: MessagesRequest, call: Call, outs: list) -> dict:
    (_, out), = outs
    matched = _matched_stop(out, out.text, body.stop_sequences)
    answer = call.reader.read(out.text[:len(out.text) - len(matched or "")])
    content = [_thinking(answer.reasoning)] if answer.reasoning else []
    content += [{"type": "text", "text": answer.content}] if answer.content else []
    content += [_tool_use(c) for c in answer.calls]
    return _message(call, content, _usage(out), _stop_reason(body, out, answer.calls), matched)


def _message(call: Call, content: list, usage: dict, reason: str | None = None, matched: str | None = None) -> dict:
    return {"id": call.id, "type": "message", "role": "assistant", "model": call.model, "content": content,
            "stop_reason": reason, "stop_sequence": matched if reason == "stop_sequence" else None, "usage": usage}


def _stop_reason(body: MessagesRequest, out, calls) -> str:
    """Anthropic's stop reason of a finished output: the time limit cuts the answer short as max_tokens does;
    the context's end before max_tokens is model_context_window_exceeded (max_tokens is cut to the context)."""
    if out.finish_reason == "length" and out.num_generated_tokens < body.max_tokens:
        return "model_context_window_exceeded"
    if out.finish_reason in ("length", "time_limit"):
        return "max_tokens"
    if ends_in_calls(calls):
        return "tool_use"
    return "stop_sequence" if out.stop_reason == "stop_string" else "end_turn"


def _matched_stop(out, text: str, stops) -> str | None:
    """The stop sequence that ended an output: the text ends with it (include_stop_str_in_output); the
    engine's match is the longest of those starting first, so the longest the text ends with."""
    if not out.finished or out.stop_reason != "stop_string":
        return None
    return max((s for s in stops or () if text.endswith(s)), key=len, default=None)


def _usage(out) -> dict:
    """Anthropic's usage: input_tokens are those not read from the cache (the prefix cache), as Anthropic counts."""
    return {"input_tokens": out.num_prompt_tokens - out.num_cached_tokens, "output_tokens": out.num_generated_tokens,
            "cache_read_input_tokens": out.num_cached_tokens, "cache_creation_input_tokens": 0}


def _thinking(text: str) -> dict:
    return {"type": "thinking", "thinking": text, "signature": ""}  # nothing to sign: the reasoning is sent back as is


def _tool_use(c) -> dict:
    """A call as a tool_use block; one cut short (max_tokens) has the input {} when its text does not parse."""
    try:
        args = json.loads(c.arguments)
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": _tool_id(c.id), "name": c.name, "input": args if isinstance(args, dict) else {}}


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


async def _events(body: MessagesRequest, call: Call, outputs):
    """message_start (with the prompt's usage, at the first output) and a ping; each block's start, deltas
    and stop, as the answer grows; message_delta (the stop reason, the usage) and message_stop."""
    stream, blocks = AnswerStream(call.reader), _Blocks()
    text, last, matched = "", None, None
    async for _, out in outputs:
        if last is None:
            yield {"type": "message_start", "message": _message(call, [], {**_usage(out), "output_tokens": 0})}
            yield {"type": "ping"}
        last, text = out, text + out.text
        matched = _matched_stop(out, text, body.stop_sequences)
        for event in blocks.feed(stream.feed(out.text[:len(out.text) - len(matched or "")], out.finished)):
            yield event
    for event in blocks.stop():
        yield event
    reason = _stop_reason(body, last, stream.calls)
    yield {"type": "message_delta", "delta": {"stop_reason": reason,
                                              "stop_sequence": matched if reason == "stop_sequence" else None},
           "usage": _usage(last)}
    yield {"type": "message_stop"}


class _Blocks:
    """A stream's content blocks: one opened when its kind of text first comes (a tool_use block when the
    call's name is written), stopped when another opens or its call ends."""

    def __init__(self):
        self.index, self.open = -1, None  # the last block's index; the open one's kind, or ("call", i)

    def feed(self, answer):
        if answer.reasoning:
            yield from self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            yield self._delta({"type": "thinking_delta", "thinking": answer.reasoning})
        if answer.content:
            yield from self._start("text", {"type": "text", "text": ""})
            yield self._delta({"type": "text_delta", "text": answer.content})
        for d in answer.deltas:
            if d.first:
                yield from self._start(("call", d.index), {"type": "tool_use", "id": _tool_id(d.call.id),
                                                           "name": d.call.name, "input": {}})
            if d.arguments and self.open == ("call", d.index):
                yield self._delta({"type": "input_json_delta", "partial_json": d.arguments})
            if d.ended and self.open == ("call", d.index):
                yield from self.stop()

    def stop(self):
        if self.open == "thinking":  # Anthropic's last thinking delta: its signature (none here)
            yield self._delta({"type": "signature_delta", "signature": ""})
        if self.open is not None:
            yield {"type": "content_block_stop", "index": self.index}
        self.open = None

    def _start(self, kind, block: dict):
        if self.open != kind:
            yield from self.stop()
            self.index, self.open = self.index + 1, kind
            yield {"type": "content_block_start", "index": self.index, "content_block": block}

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

"""POST /v1/chat/completions: the conversation through the model's chat template, n choices; the
stream starts with each choice's role. render_chat also serves /tokenize."""
from __future__ import annotations

from functools import partial

from fastapi import Request
from fastapi.responses import Response

from pagoda.engine.errors import InvalidRequestError
from pagoda.server.chat.reasoning import check_template_kwargs
from pagoda.server.chat.requests import chat_request, render
from pagoda.server.chat.tools import check_tools, ends_in_calls, message_tool_fields
from pagoda.server.openai.protocol import ChatMessage, ChatRequest, sampling_params
from pagoda.server.http.serving import Call, Serving, usage


class Chat:
    def __init__(self, serving: Serving):
        self.serving = serving

    async def create(self, body: ChatRequest, request: Request) -> Response:
        return await self.serving.generate(body, request, "chatcmpl-", partial(self.requests, body),
                                           partial(_whole, body), partial(_chunks, body))

    def requests(self, body: ChatRequest, engine, rid: str, fit_context: bool = False) -> tuple:
        """The chat request's EngineRequest and AnswerReader (also the Responses and Messages APIs', as a chat
        request). fit_context: a max_tokens past what the context has left is cut to it (Anthropic's door:
        Claude Code asks for more than most local models' context holds), not refused."""
        # max_completion_tokens (OpenAI's newer name) wins where both are given, as in vLLM
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if body.top_logprobs and not body.logprobs:
            raise InvalidRequestError("top_logprobs", "needs logprobs: true")
        params = sampling_params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
        tools = check_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
        options, limits = self.serving.state.options, self.serving.state.limits

        def make(ids, p):
            room = engine.model_info.max_model_len - len(ids)
            if fit_context and p.max_tokens is not None and 0 < room < p.max_tokens:
                p = p.replace(max_tokens=room)
            return engine.make_request(ids, p, f"{rid}-0", body.priority or 0, limits=limits)
        req, reader = chat_request(engine, _chat_messages(body.messages), params, make, tools=tools,
                                   tool_call_parser=options.tool_call_parser,
                                   reasoning_parser=options.reasoning_parser,
                                   template_kwargs=check_template_kwargs(body.chat_template_kwargs))
        return [req], reader


def _whole(body: ChatRequest, call: Call, outs: list) -> dict:
    choices = []
    for _, out in outs:
        answer = call.reader.read(out.text)
        message = {"role": "assistant", "content": answer.content if answer.content or not answer.calls else None,
                   "refusal": None}
        if answer.reasoning is not None:
            message["reasoning_content"] = answer.reasoning or None
        if answer.calls:
            message["tool_calls"] = [_tool_call(c) for c in answer.calls]
        finish = "tool_calls" if ends_in_calls(answer.calls) and out.finish_reason == "stop" else out.finish_reason
        choices.append(_with_extras(body, call, out, {
            "index": out.index, "message": message,
            "logprobs": None if out.logprobs is None else call.logprobs.chat(out.logprobs), "finish_reason": finish}))
    return {"id": call.id, "object": "chat.completion", "created": call.created, "model": call.model,
            "choices": choices, "usage": usage(out for _, out in outs)}


def _tool_call(c) -> dict:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


async def _chunks(body: ChatRequest, call: Call, outputs):
    """Each choice's role first, then a chunk per delta, then usage if asked (with it, every chunk
    has the field, null but in the last: chat's schema only)."""
    head = {"id": call.id, "object": "chat.completion.chunk", "created": call.created, "model": call.model}
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    if include_usage:
        head["usage"] = None
    for k in range(body.n or 1):
        yield {**head, "choices": [{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}]}
    lasts, streams = {}, {}
    async for _, out in outputs:
        first = out.index not in lasts
        lasts[out.index] = out
        delta, finish = {"content": out.text} if out.text else {}, out.finish_reason
        if call.reader.reads:
            stream = streams.setdefault(out.index, call.reader.stream())
            answer = stream.feed(out.text, out.finished)
            delta = {k: v for k, v in (("reasoning_content", answer.reasoning), ("content", answer.content)) if v}
            finish = "tool_calls" if finish == "stop" and ends_in_calls(stream.calls) else finish
            for d in answer.deltas:  # a call's id and name first, then its arguments as they come
                parts = [{"index": d.index, "id": d.call.id, "type": "function",
                          "function": {"name": d.call.name, "arguments": ""}}] if d.first else []
                parts += [{"index": d.index, "function": {"arguments": d.arguments}}] if d.arguments else []
                for part in parts:
                    yield {**head, "choices": [{"index": out.index, "delta": {"tool_calls": [part]},
                                                "logprobs": None, "finish_reason": None}]}
        if delta or out.finished or out.token_ids or first:
            yield {**head, "choices": [_with_extras(body, call, out, {
                "index": out.index, "delta": delta,
                "logprobs": None if out.logprobs is None else call.logprobs.chat(out.logprobs),
                "finish_reason": finish})]}
    if include_usage:
        yield {**head, "choices": [], "usage": usage(lasts.values())}


def _with_extras(body: ChatRequest, call: Call, out, choice: dict) -> dict:
    """vLLM's extras: the prompt's logprobs, the choice's token ids."""
    if body.prompt_logprobs is not None and out.prompt_logprobs is not None:
        choice["prompt_logprobs"] = call.logprobs.prompt(out.prompt_logprobs)
    if body.return_token_ids:
        choice["token_ids"] = out.token_ids
    return choice


# Roles as the chat template knows them: "developer" is OpenAI's newer name for "system".
_TEMPLATE_ROLE = {"developer": "system", "system": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def render_chat(engine, messages: list[ChatMessage], tools: list | None = None) -> list[int]:
    """A conversation's prompt token ids, through the model's chat template (/tokenize)."""
    return render(engine, _chat_messages(messages), tools)


def _chat_messages(messages: list[ChatMessage]) -> list[dict]:
    if not messages:
        raise InvalidRequestError("messages", "must not be empty")
    return [_chat_message(i, m) for i, m in enumerate(messages)]


def _chat_message(i: int, m: ChatMessage) -> dict:
    where = f"messages[{i}]"
    if m.role not in _TEMPLATE_ROLE:
        raise InvalidRequestError(f"{where}.role", f"{m.role!r} is not a role this server takes (one of "
                                                   f"{', '.join(_TEMPLATE_ROLE)})")
    if m.function_call is not None:
        raise InvalidRequestError(f"{where}.function_call", "is not supported by this server: use tool_calls")
    if m.role != "assistant" and (m.refusal, m.audio, m.annotations) != (None,) * 3:
        field = next(f for f in ("refusal", "audio", "annotations") if getattr(m, f) is not None)
        raise InvalidRequestError(f"{where}.{field}", f"is not a field of a {m.role} message")
    if m.content is None and m.role != "assistant":
        raise InvalidRequestError(f"{where}.content", "is required")
    out = {"role": _TEMPLATE_ROLE[m.role], "content": _text_of(where, m.content),
           **message_tool_fields(where, m.role, m.tool_call_id, m.tool_calls)}
    if m.name is not None and m.role == "tool":
        out["name"] = m.name
    return out


def _text_of(where: str, content) -> str:
    """A message's text: the string, or its text parts joined."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind != "text" or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
            what = f"a {kind!r} part is not supported: this server's models take text" if kind != "text" else \
                "must be {\"type\": \"text\", \"text\": STRING}"
            raise InvalidRequestError(f"{where}.content[{j}]", what)
        texts.append(part["text"])
    return "".join(texts)

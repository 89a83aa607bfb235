"""POST /v1/responses: OpenAI's Responses API over the chat endpoint's one path (a request becomes a
chat request: its input items the conversation, its function tools the chat tools; function_call and
function_call_output items the assistant's calls and their results). Stateless: previous_response_id
and conversation are refused. Answered whole as a Response, or streamed as its typed events
(response.created ... response.completed)."""
from __future__ import annotations

import time
from functools import partial

from fastapi import Request
from fastapi.responses import Response

from pagoda.engine.errors import InvalidRequestError
from pagoda.server.chat.answer import AnswerStream
from pagoda.engine.validation import new_request_id
from pagoda.server.openai.chat import Chat
from pagoda.server.openai.protocol import ChatMessage, ChatRequest, ResponsesRequest
from pagoda.server.http.serving import Call

# fields taken only at a value that changes nothing (besides null)
_ONLY = {"include": ([],), "truncation": ("disabled",), "reasoning": ({},), "background": (False,),
         "max_tool_calls": (), "top_logprobs": (0,), "conversation": ()}
# finish reasons that leave a response incomplete, and why (time_limit: pagoda's time_limit_ms, not in
# OpenAI's enum; tests/openai_spec.py allows it)
_INCOMPLETE = {"length": "max_output_tokens", "time_limit": "time_limit"}
_ROLES = {"user", "system", "developer", "assistant"}


class Responses:
    def __init__(self, chat: Chat):
        self.chat, self.serving = chat, chat.serving

    async def create(self, body: ResponsesRequest, request: Request) -> Response:
        try:
            chat = to_chat(body)
        except InvalidRequestError as e:
            return self.serving.dialect.error_for(e)
        return await self.serving.generate(chat, request, "resp_", partial(self._requests, chat),
                                           partial(_whole, body), partial(_events, body))

    def _requests(self, chat: ChatRequest, engine, rid: str) -> tuple:
        """The chat path's requests; its errors under the Responses API's names for the fields."""
        try:
            return self.chat.requests(chat, engine, rid)
        except InvalidRequestError as e:
            field = e.field.replace("tool_choice.function.", "tool_choice.").replace(".function.", ".")
            raise e.renamed("input" if field.startswith("messages") else field) from None


def to_chat(body: ResponsesRequest) -> ChatRequest:
    """The chat request a Responses request means; InvalidRequestError naming the Responses field."""
    if body.previous_response_id is not None:
        raise InvalidRequestError("previous_response_id", "is not supported: this server is stateless (it keeps no "
                                                          "responses); send the whole conversation in input")
    for name, harmless in _ONLY.items():
        value = getattr(body, name)
        if value is not None and value not in harmless:
            raise InvalidRequestError(name, f"is not supported by this server (got {value!r})")
    messages = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    if not items:
        raise InvalidRequestError("input", "must not be empty")
    for i, item in enumerate(items):
        _add_item(messages, f"input[{i}]", item)
    fmt = body.text and body.text.format
    response_format = None
    if fmt is not None and fmt.type != "text":
        response_format = {"type": fmt.type} if fmt.type == "json_object" else {
            "type": "json_schema", "json_schema": {"name": fmt.name or "answer", "schema": fmt.schema_,
                                                   "strict": fmt.strict}}
        if fmt.type == "json_schema" and fmt.schema_ is None:
            raise InvalidRequestError("text.format.schema", "is required with type json_schema")
    try:
        return ChatRequest(
            model=body.model, messages=[ChatMessage(**m) for m in messages], tools=_tools(body.tools),
            tool_choice=_tool_choice(body.tool_choice), parallel_tool_calls=body.parallel_tool_calls,
            max_completion_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p,
            stream=body.stream, seed=body.seed, logit_bias=body.logit_bias, response_format=response_format,
            chat_template_kwargs=body.chat_template_kwargs, time_limit_ms=body.time_limit_ms)
    except InvalidRequestError:
        raise
    except ValueError as e:  # a part of an item the chat request's types refuse
        raise InvalidRequestError("input", f"holds an item this server cannot take: {e}") from None


def _add_item(messages: list, where: str, item) -> None:
    if not isinstance(item, dict):
        raise InvalidRequestError(where, "must be an object (a message, function_call or function_call_output)")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise InvalidRequestError(f"{where}.role", f"must be one of {', '.join(sorted(_ROLES))}, got {role!r}")
        messages.append({"role": role, "content": _text(where, item.get("content"))})
    elif kind == "function_call":
        call = {"id": _str(where, item, "call_id"), "type": "function",
                "function": {"name": _str(where, item, "name"), "arguments": _str(where, item, "arguments")}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)  # several calls of one turn: one message
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        messages.append({"role": "tool", "tool_call_id": _str(where, item, "call_id"),
                         "content": output if isinstance(output, str) else _text(f"{where}.output", output)})
    elif kind == "reasoning":  # a reasoning item sent back: the template does not render past reasoning
        return
    else:
        raise InvalidRequestError(f"{where}.type", f"{kind!r} items are not supported by this server (message, "
                                                   f"function_call, function_call_output)")


def _str(where: str, item: dict, key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{where}.{key}", "must be a string")
    return value


def _text(where: str, content) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}.content", "must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") or \
                not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{where}.content[{j}]", "must be a text part (input_text or output_text): "
                                                               "this server's models take text")
        texts.append(part["text"])
    return "".join(texts)


def _tools(tools):
    """Responses' flat function tools as chat's ({"type": "function", "function": {...}})."""
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise InvalidRequestError(f"tools[{i}]", "must be a function tool: this server runs no built-in tools")
        out.append({"type": "function", "function": {k: v for k, v in t.items() if k != "type"}})
    return out


def _echoed_tools(tools) -> list:
    """The function tools as a Response echoes them: with `strict` (OpenAI's spec requires it; a Responses
    function tool is strict unless sent with strict false, and this server enforces every call's schema)."""
    return [{**t, "strict": t.get("strict") is not False} if isinstance(t, dict) else t for t in tools or []]


def _tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


# ---- the answer ----

def _usage(outs) -> dict:
    prompt = sum(o.num_prompt_tokens for o in outs if o.index == 0)
    cached = sum(o.num_cached_tokens for o in outs if o.index == 0)
    out = sum(o.num_generated_tokens for o in outs)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + out}


def _response(body: ResponsesRequest, call: Call, status: str, output: list, out=None) -> dict:
    incomplete = _INCOMPLETE.get(out.finish_reason) if out is not None else None
    return {
        "id": call.id, "object": "response", "created_at": call.created, "model": call.model,
        "status": "incomplete" if incomplete else status, "error": None,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": body.instructions, "output": output, "tools": _echoed_tools(body.tools),
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "parallel_tool_calls": body.parallel_tool_calls is not False, "metadata": body.metadata or {},
        "temperature": body.temperature if body.temperature is not None else 1.0,
        "top_p": body.top_p if body.top_p is not None else 1.0, "max_output_tokens": body.max_output_tokens,
        "previous_response_id": None, "store": False, "text": {"format": {"type": "text"}}
        if body.text is None or body.text.format is None else body.text.model_dump(exclude_none=True, by_alias=True),
        "truncation": "disabled", "completed_at": int(time.time()) if status == "completed" else None,
        **({"usage": _usage([out])} if out is not None else {})}


def _message(item_id: str, text: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
            if status == "completed" else []}


def _function_call(c, status: str | None = None, arguments: str | None = None) -> dict:
    """A function_call item; its status by default completed, or incomplete when cut short."""
    status = status or ("completed" if c.complete else "incomplete")
    return {"id": "fc_" + c.id.removeprefix("call_"), "type": "function_call", "call_id": c.id, "name": c.name,
            "arguments": c.arguments if arguments is None else arguments, "status": status}


def _reasoning(item_id: str, text: str, status: str = "completed") -> dict:
    """A reasoning item: the model's <think> text as its content (no summary is made)."""
    return {"id": item_id, "type": "reasoning", "summary": [], "encrypted_content": None, "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []}


def _whole(body: ResponsesRequest, call: Call, outs: list) -> dict:
    (_, out), = outs
    answer = call.reader.read(out.text)
    output = [_reasoning("rs_" + new_request_id(), answer.reasoning)] if answer.reasoning else []
    output += [_message("msg_" + new_request_id(), answer.content)] if answer.content or not answer.calls else []
    output += [_function_call(c) for c in answer.calls]
    return _response(body, call, "completed", output, out)


async def _events(body: ResponsesRequest, call: Call, outputs):
    """The typed events: created, in_progress; the reasoning's item and its text deltas (a reasoning
    model); a message's item, part and text deltas as the text
    comes; each function call's item once its name is written, then its arguments as they come; the
    parts' and items' ends; completed (or incomplete)."""
    seq = iter(range(1 << 62))
    ev = lambda kind, **fields: {"type": kind, "sequence_number": next(seq), **fields}  # noqa: E731
    yield ev("response.created", response=_response(body, call, "in_progress", []))
    yield ev("response.in_progress", response=_response(body, call, "in_progress", []))
    output, text, msg, last, calls = [], "", None, None, {}  # calls: a call's index -> its output index
    thought, thinking = "", None  # the reasoning so far, its item while it grows
    stream = AnswerStream(call.reader)
    async for _, out in outputs:
        last = out
        answer = stream.feed(out.text, out.finished)
        if answer.reasoning:
            if thinking is None:
                thinking = _reasoning("rs_" + new_request_id(), "", "in_progress")
                output.append(thinking)
                yield ev("response.output_item.added", output_index=len(output) - 1, item=thinking)
            thought += answer.reasoning
            yield ev("response.reasoning_text.delta", item_id=thinking["id"], output_index=output.index(thinking),
                     content_index=0, delta=answer.reasoning)
        if thinking is not None and (answer.content or answer.deltas or out.finished):  # the reasoning is over
            k = output.index(thinking)
            yield ev("response.reasoning_text.done", item_id=thinking["id"], output_index=k, content_index=0,
                     text=thought)
            output[k] = thinking = _reasoning(thinking["id"], thought)
            yield ev("response.output_item.done", output_index=k, item=thinking)
            thinking = None
        if answer.content:
            if msg is None:
                msg = _message("msg_" + new_request_id(), "", "in_progress")
                output.append(msg)
                yield ev("response.output_item.added", output_index=len(output) - 1, item=msg)
                yield ev("response.content_part.added", item_id=msg["id"], output_index=len(output) - 1,
                         content_index=0, part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            text += answer.content
            yield ev("response.output_text.delta", item_id=msg["id"], output_index=output.index(msg),
                     content_index=0, delta=answer.content, logprobs=[])
        for d in answer.deltas:
            if d.first:
                if msg is not None:
                    async for e in _close_message(ev, output, msg, text):
                        yield e
                    msg, text = None, ""
                output.append(_function_call(d.call, "in_progress", ""))
                calls[d.index] = len(output) - 1
                yield ev("response.output_item.added", output_index=calls[d.index], item=output[-1])
            k = calls[d.index]
            if d.arguments:
                yield ev("response.function_call_arguments.delta", item_id=output[k]["id"], output_index=k,
                         delta=d.arguments)
            if d.ended:
                yield ev("response.function_call_arguments.done", item_id=output[k]["id"], output_index=k,
                         name=d.call.name, arguments=d.call.arguments)
                output[k] = _function_call(d.call)
                yield ev("response.output_item.done", output_index=k, item=output[k])
    if msg is not None:
        async for e in _close_message(ev, output, msg, text):
            yield e
    if last is not None and not any(o["type"] != "reasoning" for o in output):  # no text and no call: an
        # empty message, as the whole answer has
        output.append(_message("msg_" + new_request_id(), ""))
        yield ev("response.output_item.added", output_index=len(output) - 1, item=output[-1])
        yield ev("response.output_item.done", output_index=len(output) - 1, item=output[-1])
    final = _response(body, call, "completed", output, last)
    yield ev("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)


async def _close_message(ev, output, msg, text):
    k = output.index(msg)
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    yield ev("response.output_text.done", item_id=msg["id"], output_index=k, content_index=0, text=text, logprobs=[])
    yield ev("response.content_part.done", item_id=msg["id"], output_index=k, content_index=0, part=part)
    done = _message(msg["id"], text)
    output[k] = done
    yield ev("response.output_item.done", output_index=k, item=done)

"""POST /api/chat and /api/generate through the one chat layer (server/chat): their requests made
with chat_request (generate's prompt as one user turn, or `raw` as it is), their answers read back
with the AnswerReader and written as Ollama writes them: NDJSON chunks, the last one `done` with
its counts and nanosecond timings, or one object."""
from __future__ import annotations

import json
import time
from datetime import datetime, timezone

from pagoda.engine.errors import InvalidRequestError
from pagoda.engine.validation import check_text
from pagoda.server.chat.answer import PLAIN, Answer
from pagoda.server.chat.requests import chat_request
from pagoda.server.chat.tools import check_tools
from pagoda.server.ollama.protocol import (ChatBody, GenerateBody, Options, chat_messages, check_common,
                                           ollama_field, structured, template_kwargs)


def chat_requests(serving, body: ChatBody, engine, rid: str) -> tuple:
    """/api/chat's EngineRequest and AnswerReader."""
    check_common(body)
    if structured(body.format) is not None and body.tools:
        raise InvalidRequestError("format", "cannot be combined with tools here: an answer is either calls or the "
                                            "format")
    opts = Options(body, structured(body.format))
    tools = check_tools(body.tools)
    options = serving.state.options
    try:
        req, reader = chat_request(engine, chat_messages(body.messages), opts.params,
                                   _maker(serving, engine, rid, opts), tools=tools,
                                   tool_call_parser=options.tool_call_parser,
                                   reasoning_parser=options.reasoning_parser,
                                   template_kwargs=template_kwargs(engine, body.think, options.reasoning_parser))
    except InvalidRequestError as e:
        raise _renamed(e, "messages") from None
    return [req], reader


def generate_requests(serving, body: GenerateBody, engine, rid: str) -> tuple:
    """/api/generate's: the prompt (and system) through the chat template, or with `raw` as it is;
    `context` (an earlier answer's token ids) before it."""
    check_common(body)
    for name in ("suffix", "template", "images"):
        if getattr(body, name):
            raise InvalidRequestError(name, "is not supported by this server" + (
                ": the model's own chat template renders the prompt" if name == "template" else ""))
    opts = Options(body, structured(body.format))
    context = list(body.context or [])
    make = _maker(serving, engine, rid, opts, context)
    options = serving.state.options
    try:
        if body.raw:
            for name in ("system", "think"):
                if getattr(body, name) is not None:
                    raise InvalidRequestError(name, "needs the chat template: not with raw: true")
            ids = engine.tokenizer.encode(check_text("prompt", body.prompt), add_special_tokens=not context)
            return [make(ids, opts.params)], PLAIN
        messages = [{"role": "system", "content": check_text("system", body.system)}] if body.system else []
        messages.append({"role": "user", "content": check_text("prompt", body.prompt)})
        req, reader = chat_request(engine, messages, opts.params, make, reasoning_parser=options.reasoning_parser,
                                   template_kwargs=template_kwargs(engine, body.think, options.reasoning_parser))
    except InvalidRequestError as e:
        raise _renamed(e, "prompt", len(context)) from None
    return [req], reader


def _maker(serving, engine, rid: str, opts: Options, context: list | tuple = ()):
    """make(prompt ids, params) -> the EngineRequest, its answer fitted to num_ctx."""
    def make(ids, params):
        ids = [*context, *ids]
        params = params.replace(max_tokens=opts.max_tokens(len(ids), engine.model_info.max_model_len))
        return engine.make_request(ids, params, f"{rid}-0", limits=serving.state.limits)
    return make


def _renamed(e: InvalidRequestError, prompt: str, num_context: int = 0) -> InvalidRequestError:
    """The engine's prompt errors under the field that gave the prompt (a bad context id by its index)."""
    base, _, rest = e.field.partition("[")
    if base in ("prompt", "prompt_token_ids"):
        j = int(rest.rstrip("]")) if rest.rstrip("]").isdigit() else None
        return e.renamed(f"context[{j}]" if j is not None and j < num_context else prompt)
    return ollama_field(e)


# ---- answers ----

def loaded(name: str, chat: bool) -> dict:
    """The answer to a call with nothing to generate: the ollama CLI's way of loading a model."""
    return {**_head(name), **_part(chat, "", None, [], None), "done": True, "done_reason": "load"}


def whole(chat: bool, name: str, start: float, call, outs: list) -> dict:
    (_, out), = outs
    answer = call.reader.read(out.text)
    return {**_head(name), **_part(chat, answer.content, answer.reasoning, _calls(answer.calls), _logprobs(call, out)),
            "done": True, **_done(chat, start, call, out, out.token_ids)}


async def chunks(chat: bool, name: str, start: float, call, outputs):
    """A chunk per delta with something in it; the last one `done`, with whatever the final delta brings."""
    stream, generated, num_calls = call.reader.stream(), [], 0
    async for _, out in outputs:
        generated += out.token_ids
        answer = stream.feed(out.text, out.finished) if stream else Answer(None, out.text, [])
        calls = _calls(answer.calls, num_calls)
        num_calls += len(calls)
        logprobs = _logprobs(call, out)
        part = _part(chat, answer.content, answer.reasoning, calls, logprobs)
        if out.finished:
            yield {**_head(name), **part, "done": True, **_done(chat, start, call, out, generated)}
        elif answer.content or answer.reasoning or calls or logprobs:
            yield {**_head(name), **part, "done": False}


def _head(name: str) -> dict:
    return {"model": name, "created_at": datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")}


def _part(chat: bool, content: str, reasoning: str | None, calls: list, logprobs: list | None) -> dict:
    if chat:
        message = {"role": "assistant", "content": content}
        if reasoning:
            message["thinking"] = reasoning
        if calls:
            message["tool_calls"] = calls
        part = {"message": message}
    else:
        part = {"response": content, **({"thinking": reasoning} if reasoning else {})}
    return {**part, "logprobs": logprobs} if logprobs else part


def _calls(calls: list, first: int = 0) -> list[dict]:
    """Calls as Ollama returns them, their arguments an object; a call cut short (its arguments not
    whole JSON) is left out: done_reason "length" tells of it."""
    out = []
    for c in calls:
        try:
            args = json.loads(c.arguments)
        except ValueError:
            continue
        if isinstance(args, dict):
            out.append({"id": c.id, "function": {"index": first + len(out), "name": c.name, "arguments": args}})
    return out


def _logprobs(call, out) -> list | None:
    if out.logprobs is None:
        return None
    return call.logprobs.chat(out.logprobs)["content"]


def _done(chat: bool, start: float, call, out, generated: list) -> dict:
    """The last chunk's fields: why it ended, the counts, and the call's wall clock in nanoseconds: load
    (before the engine had the prompt: template, tokens, grammar), prompt eval (to the first token),
    eval (the rest)."""
    end = time.monotonic()
    m = out.metrics
    arrival = _within(m and m.arrival_time, start, end, start)
    first = _within(m and m.first_token_time, arrival, end, end)
    done = {"done_reason": out.finish_reason, "total_duration": _ns(end - start), "load_duration": _ns(arrival - start),
            "prompt_eval_count": out.num_prompt_tokens, "prompt_eval_duration": _ns(first - arrival),
            "eval_count": out.num_generated_tokens, "eval_duration": _ns(end - first)}
    if not chat:  # the conversation's token ids, to send back as `context`
        done["context"] = [*call.reqs[0].prompt_token_ids, *generated]
    return done


def _within(t: float | None, lo: float, hi: float, default: float) -> float:
    return default if t is None else min(max(t, lo), hi)


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)

"""The Ollama requests this server takes (pydantic models, Ollama's field names), and what their
`options`, `format`, `think` and messages mean to the chat layer and the engine."""
from __future__ import annotations

import json
import re

from pydantic import BaseModel, ConfigDict, Field

from pagoda.engine.errors import InvalidRequestError
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.structured.manager import StructuredOutputs
from pagoda.engine.validation import check_int, check_text, is_int
from pagoda.server.chat.reasoning import TEMPLATE_KWARGS, reasoning_for
from pagoda.server.chat.tools import message_tool_fields
from pagoda.server.openai.protocol import Int


class _Fields(BaseModel):
    # JSON's types exactly, as Ollama's Go decoding; unknown fields ignored, as Ollama's decoding does (clients
    # send their own: Open WebUI's metadata, newer Ollama fields)
    model_config = ConfigDict(extra="ignore", strict=True)


class CallFunction(_Fields):
    name: str
    arguments: dict
    index: Int | None = None  # Ollama's own, sent back as it came


class ToolCall(_Fields):
    function: CallFunction
    id: str | None = None
    type: str | None = None


class Message(_Fields):
    role: str
    content: str | None = None
    thinking: str | None = None  # an answer's reasoning sent back: accepted, not rendered (as the templates drop it)
    images: list | None = None  # only empty: the models served here take text
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class _Generation(_Fields):
    model: str
    stream: bool = True
    format: str | dict | None = None
    options: dict | None = None
    keep_alive: str | float | None = None  # accepted: the model stays loaded whatever it says
    think: bool | str | None = None
    truncate: bool | None = None  # accepted: a prompt longer than the context is refused, never cut
    shift: bool | None = None  # accepted: generation ends at the context's end, nothing is shifted out
    logprobs: bool | None = None
    top_logprobs: Int | None = None
    debug_render_only: bool | None = Field(None, alias="_debug_render_only")  # only false


class ChatBody(_Generation):
    messages: list[Message] | None = None
    tools: list | None = None
    # Open WebUI's extras, which Ollama ignores too: a copy of the system prompt it also puts in messages,
    # a num_predict outside options, its own metadata
    system: str | None = None
    num_predict: Int | None = None
    metadata: dict | None = None


class GenerateBody(_Generation):
    prompt: str | None = None
    system: str | None = None
    suffix: str | None = None  # only empty: no fill-in-the-middle here
    template: str | None = None  # only empty: the model's own chat template renders the prompt
    context: list[Int] | None = None
    raw: bool | None = None
    images: list | None = None  # only empty


class ShowBody(_Fields):
    model: str | None = None
    name: str | None = None  # the older name of `model` (the ollama CLI's)
    verbose: bool | None = None  # accepted: every answer is the whole one
    # the ollama CLI sends these empty (Ollama's overrides of what is shown): accepted, ignored
    system: str | None = None
    template: str | None = None
    options: dict | None = None


# options -> the SamplingParams field
SAMPLING = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "seed": "seed",
            "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
            "frequency_penalty": "frequency_penalty", "stop": "stop", "num_predict": "max_tokens"}
# Ollama's options that mean nothing here (load-time and hardware settings, and samplers this engine
# lacks, which Ollama's own newer engine ignores too): accepted at any value, ignored
IGNORED = frozenset({"numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all", "vocab_only",
                     "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep", "tfs_z", "typical_p",
                     "repeat_last_n", "mirostat", "mirostat_tau", "mirostat_eta", "penalize_newline"})
_ENGINE_NAMES = {v: k for k, v in SAMPLING.items()}


class Options:
    """A request's options checked: its SamplingParams, and num_ctx/num_predict to fit each prompt."""

    def __init__(self, body: _Generation, structured: dict | None):
        options = body.options or {}
        for key in options:
            if key not in SAMPLING and key not in IGNORED and key != "num_ctx":
                raise InvalidRequestError(f"options.{key}", "is not an option this server knows (Ollama's runtime "
                                                           "options: " + ", ".join(sorted(SAMPLING)) + ", num_ctx)")
        self.num_predict = _num_predict(options.get("num_predict"))
        self.num_ctx = _whole(options.get("num_ctx"))
        if self.num_ctx is not None:
            check_int("options.num_ctx", self.num_ctx, lo=1)
        if body.top_logprobs and not body.logprobs:
            raise InvalidRequestError("top_logprobs", "needs logprobs: true")
        kw = {SAMPLING[k]: _whole(v) for k, v in options.items() if k in SAMPLING and k != "num_predict"}
        stop = kw.pop("stop", None)
        if stop is not None and not isinstance(stop, (str, list)):
            raise InvalidRequestError("options.stop", f"must be a list of strings, got {json.dumps(stop)}")
        try:
            so = structured and StructuredOutputs(**structured)
            self.params = SamplingParams(**kw, stop=stop or [], max_tokens=None, structured_outputs=so,
                                         logprobs=bool(body.logprobs), top_logprobs=body.top_logprobs or 0)
        except InvalidRequestError as e:
            raise ollama_field(e) from None

    def max_tokens(self, num_prompt: int, context: int) -> int | None:
        """num_predict for a prompt of this many tokens (None: to the context's end), within num_ctx."""
        if self.num_ctx is None:
            return self.num_predict
        if self.num_ctx > context:
            raise InvalidRequestError("options.num_ctx", f"must be at most the model's context length ({context}), "
                                                         f"got {self.num_ctx}")
        room = self.num_ctx - num_prompt
        if room < 1:
            raise InvalidRequestError("options.num_ctx", f"({self.num_ctx}) leaves no room for an answer after the "
                                                         f"prompt ({num_prompt} tokens)")
        if self.num_predict is not None and self.num_predict > room:
            raise InvalidRequestError("options.num_predict", f"({self.num_predict}) plus the prompt ({num_prompt} "
                                                             f"tokens) must fit options.num_ctx ({self.num_ctx})")
        return room if self.num_predict is None else self.num_predict


def _whole(value):
    """JSON's integer: 2.0 is one."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _num_predict(value) -> int | None:
    """Ollama's num_predict: -1 (endless) and -2 (fill the context) both end at the context's end here."""
    value = _whole(value)
    if value is None or (is_int(value) and value in (-1, -2)):
        return None
    check_int("options.num_predict", value, lo=0, hint=" (or -1: to the context's end)")
    return value


def ollama_field(e: InvalidRequestError) -> InvalidRequestError:
    """An engine's error under Ollama's name for the field: options.repeat_penalty, options.stop[0], format."""
    base, bracket, rest = e.field.partition("[")
    if base.startswith("structured_outputs"):
        return e.renamed("format")
    if base in _ENGINE_NAMES:
        return e.renamed(f"options.{_ENGINE_NAMES[base]}{bracket}{rest}")
    return e


def structured(fmt) -> dict | None:
    """`format` as StructuredOutputs' fields: "json" any JSON object, an object a JSON schema."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"json_object": True}
    if isinstance(fmt, dict):
        return {"json": fmt}
    raise InvalidRequestError("format", f'must be "json" or a JSON schema object, got {json.dumps(fmt)}')


def template_kwargs(engine, think, reasoning_parser: str | None) -> dict:
    """`think` as the chat template's switch (enable_thinking, or `thinking`: whichever it reads)."""
    if think is None:
        return {}
    if not isinstance(think, bool):
        raise InvalidRequestError("think", f"must be true or false (no thinking levels here), got {json.dumps(think)}")
    if think and reasoning_for(engine.tokenizer, [], reasoning_parser) is None:
        raise InvalidRequestError("think", "is not supported by this model: its chat template writes no "
                                           "<think>...</think> (see --reasoning-parser)")
    template = template_text(engine.tokenizer)
    return {k: think for k in TEMPLATE_KWARGS if re.search(rf"\b{k}\b", template)}


def template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), "")
    return template or ""


def check_common(body: _Generation) -> None:
    """Fields a generation call may give only at a value that changes nothing."""
    if body.debug_render_only:
        raise InvalidRequestError("_debug_render_only", "is not supported by this server")


_ROLES = ("system", "user", "assistant", "tool")


def chat_messages(messages: list[Message]) -> list[dict]:
    """Ollama's messages as the chat template's dicts: a call's arguments as an object, a tool
    result tied to its call (tool_call_id, else the next unanswered call of tool_name, else in order)."""
    out, pending = [], []  # the calls of the latest assistant message not yet answered: (id, name)
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.role not in _ROLES:
            raise InvalidRequestError(f"{where}.role", f"{m.role!r} is not a role this server takes (one of "
                                                       f"{', '.join(_ROLES)})")
        if m.images:
            raise InvalidRequestError(f"{where}.images", "are not supported: the models served here take text")
        if m.tool_name is not None and m.role != "tool":
            raise InvalidRequestError(f"{where}.tool_name", f"is not a field of a {m.role} message")
        calls = [{"id": c.id or f"call_{i}_{j}", "type": "function",
                  "function": {"name": c.function.name, "arguments": json.dumps(c.function.arguments)}}
                 for j, c in enumerate(m.tool_calls or [])]
        call_id = _answered(m, pending) if m.role == "tool" else m.tool_call_id
        message = {"role": m.role, "content": check_text(f"{where}.content", m.content or ""),
                   **message_tool_fields(where, m.role, call_id, calls)}
        if m.role == "assistant":
            pending = [(c["id"], c["function"]["name"]) for c in calls]
        if m.role == "tool" and m.tool_name is not None:
            message["name"] = m.tool_name
        out.append(message)
    return out


def _answered(m: Message, pending: list) -> str:
    """The call a tool message answers, taken off `pending`."""
    ids = [cid for cid, name in pending if cid == m.tool_call_id or m.tool_call_id is None and name == m.tool_name]
    cid = ids[0] if ids else m.tool_call_id or (pending[0][0] if pending else "call_0")
    pending[:] = [p for p in pending if p[0] != cid]
    return cid

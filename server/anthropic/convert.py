"""A Messages request as the chat request it means (server/openai/chat.py's one path, as the Responses
API's): `system` a system message; a user turn's tool_result blocks `tool` messages (before its text),
an assistant turn's tool_use blocks its tool_calls; custom tools as function tools, tool_choice as
OpenAI's; `thinking` as the chat template's enable_thinking. Errors name Anthropic's fields."""
from __future__ import annotations

import json
import re

from pagoda.engine.errors import InvalidRequestError
from pagoda.server.chat.reasoning import TEMPLATE_KWARGS
from pagoda.server.openai.protocol import ChatMessage, ChatRequest

_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_THINKING = {"enabled": True, "adaptive": True, "disabled": False}
# blocks this server cannot read, and why
_NOT_TEXT = {"image": "this server's models take text", "document": "this server's models take text"}
_OTHER_ROLE = {"tool_use": "an assistant", "thinking": "an assistant", "redacted_thinking": "an assistant",
               "tool_result": "a user"}


def to_chat(body) -> tuple[ChatRequest, bool | None]:
    """The chat request a Messages (or count_tokens) request means, and its thinking switch (None: not
    given); InvalidRequestError naming the Messages field."""
    if not body.messages:
        raise InvalidRequestError("messages", "must not be empty")
    messages, names = _system(body.system), {}  # names: each tool_use id's tool, for its result
    for i, m in enumerate(body.messages):
        turn = _assistant if m.role == "assistant" else _user
        messages += turn(f"messages[{i}]", m.content, names)
    choice, parallel = _tool_choice(body.tool_choice)
    stop = getattr(body, "stop_sequences", None) or None
    extras = {k: getattr(body, k, None) for k in ("max_tokens", "temperature", "top_p", "top_k", "stream", "seed",
                                                  "logit_bias", "priority", "time_limit_ms")}
    # the stop sequence is kept in the text to tell which one matched (messages.py cuts it)
    chat = ChatRequest(model=body.model, messages=[ChatMessage(**m) for m in messages], tools=_tools(body.tools),
                       tool_choice=choice, parallel_tool_calls=parallel, stop=stop,
                       include_stop_str_in_output=True if stop else None, **extras)
    return chat, _thinking(body.thinking)


def renamed(e: InvalidRequestError) -> InvalidRequestError:
    """A chat-path error under the Messages field's name."""
    field = re.sub(r"^stop\b", "stop_sequences", e.field)
    field = field.replace(".function.parameters", ".input_schema").replace(".function.", ".")
    field = field.replace("parallel_tool_calls", "tool_choice.disable_parallel_tool_use")
    if field.startswith("chat_template_kwargs"):
        field = "thinking"
    elif field.startswith("messages"):  # the chat messages' indexes are not the request's
        field = "messages"
    return e.renamed(field) if field != e.field else e


def thinking_kwargs(tokenizer, on: bool | None) -> dict | None:
    """The chat template kwargs that switch its reasoning, for those the template reads."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default") or ""
    if on is None or not template:
        return None
    return {k: on for k in TEMPLATE_KWARGS if re.search(rf"\b{k}\b", template)} or None


def _system(system) -> list[dict]:
    if system is None:
        return []
    text = system if isinstance(system, str) else _texts("system", system)
    return [{"role": "system", "content": text}] if text else []


def _user(where: str, content, names: dict) -> list[dict]:
    """A user turn: its tool results as tool messages, in order, then its text (if any)."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    results, texts = [], []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = _kind(at, block)
        if kind == "text":
            texts.append(_text(at, block))
        elif kind == "tool_result":
            results.append(_tool_result(at, block, names))
        else:
            _refused(at, kind, "a user")
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts or not results else [])


def _assistant(where: str, content, names: dict) -> list[dict]:
    """An assistant turn: its text, its tool_use blocks as tool_calls; its thinking left out (chat
    templates do not render past reasoning)."""
    if isinstance(content, str):
        return [{"role": "assistant", "content": content}]
    texts, calls = [], []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = _kind(at, block)
        if kind == "text":
            texts.append(_text(at, block))
        elif kind == "tool_use":
            calls.append(_tool_call(at, block, names))
        elif kind not in ("thinking", "redacted_thinking"):
            _refused(at, kind, "an assistant")
    return [{"role": "assistant", "content": "\n".join(texts), **({"tool_calls": calls} if calls else {})}]


def _kind(at: str, block) -> str:
    if not isinstance(block, dict):
        raise InvalidRequestError(at, "must be a content block (an object with a type)")
    kind = block.get("type")
    if not isinstance(kind, str):
        raise InvalidRequestError(f"{at}.type", "is required")
    return kind


def _refused(at: str, kind: str, role: str):
    if kind in _NOT_TEXT:
        raise InvalidRequestError(at, f"{kind} blocks are not supported: {_NOT_TEXT[kind]}")
    if kind in _OTHER_ROLE and role and _OTHER_ROLE[kind] != role:
        raise InvalidRequestError(f"{at}.type", f"{kind} blocks belong in {_OTHER_ROLE[kind]} message")
    raise InvalidRequestError(f"{at}.type", f"{kind!r} blocks are not supported by this server")


def _texts(at: str, blocks: list) -> str:
    """Text blocks' texts, joined; any other block refused."""
    texts = []
    for j, block in enumerate(blocks):
        if _kind(f"{at}[{j}]", block) != "text":
            _refused(f"{at}[{j}]", block["type"], "")
        texts.append(_text(f"{at}[{j}]", block))
    return "\n".join(texts)


def _text(at: str, block: dict) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise InvalidRequestError(f"{at}.text", "must be a string")
    return text


def _tool_result(at: str, block: dict, names: dict) -> dict:
    tool_use_id = block.get("tool_use_id")
    if not isinstance(tool_use_id, str) or not tool_use_id:
        raise InvalidRequestError(f"{at}.tool_use_id", "is required: the id of the tool_use block it answers")
    content = block.get("content", "")
    if isinstance(content, list):
        content = _texts(f"{at}.content", content)
    if not isinstance(content, str):
        raise InvalidRequestError(f"{at}.content", "must be a string or a list of text blocks")
    if not isinstance(block.get("is_error", False), bool):
        raise InvalidRequestError(f"{at}.is_error", "must be a bool")
    out = {"role": "tool", "content": content, "tool_call_id": tool_use_id}
    return {**out, "name": names[tool_use_id]} if tool_use_id in names else out


def _tool_call(at: str, block: dict, names: dict) -> dict:
    """A tool_use block as an OpenAI tool call (its input as JSON text)."""
    for field in ("id", "name"):
        if not isinstance(block.get(field), str) or not block[field]:
            raise InvalidRequestError(f"{at}.{field}", "is required (a string)")
    args = block.get("input", {})
    if not isinstance(args, dict):
        raise InvalidRequestError(f"{at}.input", "must be an object")
    names[block["id"]] = block["name"]
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def _tools(tools) -> list | None:
    """Custom tools as function tools (check_tools checks the rest, renamed)."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(t, dict):
            raise InvalidRequestError(at, "must be a tool: {\"name\", \"description\", \"input_schema\"}")
        kind = t.get("type") or "custom"
        if kind != "custom":
            raise InvalidRequestError(f"{at}.type", f"{kind!r} tools are not supported: this server runs no "
                                                    f"built-in tools (only custom ones, with an input_schema)")
        if not isinstance(t.get("input_schema"), dict):
            raise InvalidRequestError(f"{at}.input_schema", "is required: a JSON Schema of the tool's input object")
        if not isinstance(t.get("description", ""), str):
            raise InvalidRequestError(f"{at}.description", "must be a string")
        fn = {"name": t.get("name"), "parameters": t["input_schema"]}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice) -> tuple:
    """(OpenAI's tool_choice, parallel_tool_calls) of Anthropic's tool_choice."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise InvalidRequestError("tool_choice.name", "is required with type tool")
        mapped = {"type": "function", "function": {"name": choice["name"]}}
    elif kind in _CHOICES:
        mapped = _CHOICES[kind]
    else:
        raise InvalidRequestError("tool_choice.type", f"must be one of auto, any, tool, none, got {kind!r}")
    off = choice.get("disable_parallel_tool_use")
    if off is not None and not isinstance(off, bool):
        raise InvalidRequestError("tool_choice.disable_parallel_tool_use", f"must be a bool, got {off!r}")
    return mapped, None if off is None else not off


def _thinking(thinking) -> bool | None:
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind not in _THINKING:
        raise InvalidRequestError("thinking.type", f"must be one of enabled, adaptive, disabled, got {kind!r}")
    budget = thinking.get("budget_tokens")
    if kind == "enabled" and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
        raise InvalidRequestError("thinking.budget_tokens", f"must be a positive integer with type enabled, "
                                                            f"got {budget!r}")
    return _THINKING[kind]

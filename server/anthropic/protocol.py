"""The Messages API requests this server takes (pydantic models, Anthropic's field names). Content
blocks, tools, tool_choice and thinking stay dicts: server/anthropic/convert.py checks them, naming
the block. A field this server does not know is ignored: clients (Claude Code) send beta fields."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagoda.server.openai.protocol import Int


class _Fields(BaseModel):
    # Anthropic's types exactly ("16" is not an integer); unknown fields ignored
    model_config = ConfigDict(extra="ignore", strict=True)


class Message(_Fields):
    role: Literal["user", "assistant"]
    content: str | list[dict]


class CountTokensRequest(_Fields):
    """POST /v1/messages/count_tokens: what shapes the prompt."""
    model: str
    messages: list[Message]
    system: str | list[dict] | None = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""
    max_tokens: Annotated[Int, Field(ge=1)]
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    stream: bool | None = None
    metadata: dict | None = None  # accepted (user_id), not used
    # pagoda's and vLLM's extras, as on the chat door
    seed: Int | None = None
    logit_bias: dict[str, float] | None = None
    priority: Int | None = None
    time_limit_ms: Int | None = None

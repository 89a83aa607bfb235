"""Anthropic's error object ({"type": "error", "error": {"type": ..., "message": ...}}) and its
events (`event: <type>` beside each `data:`), as a Dialect; a full queue is its 529 overloaded_error."""
from __future__ import annotations

import orjson

from pagoda.server.http.dialects import Dialect

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """Anthropic's error object; the message names the field (Anthropic's has no field of its own for it)."""
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def event(chunk: dict) -> bytes:
    return b"event: " + chunk["type"].encode() + b"\ndata: " + orjson.dumps(chunk) + b"\n\n"


ANTHROPIC = Dialect(error_body, event, statuses=((429, 529),))

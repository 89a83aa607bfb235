"""Ollama's error object ({"error": message}) and its NDJSON stream (one JSON object a line), as a Dialect."""
from __future__ import annotations

import orjson

from pagoda.server.http.dialects import Dialect


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """Ollama's error: one string, naming the field."""
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    return {"error": message}


def event(chunk: dict) -> bytes:
    return orjson.dumps(chunk) + b"\n"


OLLAMA = Dialect(error_body, event, media_type="application/x-ndjson")

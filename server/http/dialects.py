"""How an HTTP API writes its errors and its streams (a Dialect): OpenAI's Server-Sent Events (`data:`
events, an error as one more event, then `data: [DONE]`) here; Anthropic's named events and Ollama's
NDJSON in their own packages. The routes, the serving skeleton and the app's guards all answer in the
dialect of the API a path belongs to."""
from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import dataclass
from typing import Callable

import grpc
import orjson
from fastapi.responses import Response, StreamingResponse

from pagoda.server.openai import errors
from pagoda.server.state import status_for


@dataclass(frozen=True)
class Dialect:
    """An HTTP API's error body, (status, message, param, code) -> dict, and its stream: each chunk's
    bytes, the bytes that end a stream, and the stream's media type."""
    error_body: Callable[..., dict]
    event: Callable[[dict], bytes]
    done: bytes = b""
    media_type: str = "text/event-stream"
    statuses: tuple = ()  # (status, the API's own status for it) pairs: Anthropic's 529 for a full queue

    def parts(self, e: Exception) -> tuple[int, str, str | None, str | None]:
        status, message, param, code = errors.error_parts(e)
        return dict(self.statuses).get(status, status), message, param, code

    def error_response(self, status: int, message: str, param: str | None = None, headers: dict | None = None,
                       code: str | None = None) -> Response:
        return Response(orjson.dumps(self.error_body(status, message, param, code)), status_code=status,
                        media_type="application/json", headers=headers)

    def error_for(self, e: Exception) -> Response:
        """An exception's error response, through the one status map (server/state.py)."""
        status, message, param, code = self.parts(e)
        # seconds, a whole number >= 1 (RFC 9110): the queue-wait estimate where the refusal has one
        wait = getattr(e, "retry_after", None) or 1
        headers = {"Retry-After": str(max(1, math.ceil(wait)))} if status in (429, 503, 529) else None
        return self.error_response(status, message, param, headers, code)

    async def events(self, chunks, status: dict):
        """The stream of an endpoint's chunks (an async iterator of dicts); status["code"] says how it ended;
        an error after the stream began is one more event, in the API's error shape."""
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    yield self.event(chunk)
        except (asyncio.CancelledError, GeneratorExit):
            status["code"] = grpc.StatusCode.CANCELLED
            raise
        except Exception as e:
            status["code"] = status_for(e)[0]
            yield self.event(self.error_body(*self.parts(e)))
        if self.done:
            yield self.done


def event(chunk: dict) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


OPENAI = Dialect(errors.error_body, event, b"data: [DONE]\n\n")


class EventStream(StreamingResponse):
    """A StreamingResponse that runs `close` when it ends, whatever ends it (a client that leaves
    before the first chunk included, when the body's generator never starts)."""

    def __init__(self, content, close, headers: dict, media_type: str = "text/event-stream"):
        super().__init__(content, media_type=media_type, headers={"Cache-Control": "no-cache", **headers})
        self._close = close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._close()

"""Server-Sent Events: an endpoint's chunks as `data:` events, an error as OpenAI's error object in
one more event, then `data: [DONE]`."""
from __future__ import annotations

import asyncio
import contextlib

import grpc
import orjson
from fastapi.responses import StreamingResponse

from pagoda.server.openai.errors import error_body, error_parts
from pagoda.server.state import status_for

DONE = b"data: [DONE]\n\n"


def event(chunk: dict) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


async def events(chunks, status: dict):
    """The stream of an endpoint's chunks (an async iterator of dicts); status["code"] says how it ended."""
    try:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield event(chunk)
    except (asyncio.CancelledError, GeneratorExit):
        status["code"] = grpc.StatusCode.CANCELLED
        raise
    except Exception as e:
        status["code"] = status_for(e)[0]
        http_status, message, param, code = error_parts(e)
        yield event(error_body(http_status, message, param, code))
    yield DONE


class EventStream(StreamingResponse):
    """A StreamingResponse that runs `close` when it ends, whatever ends it (a client that leaves
    before the first chunk included, when the body's generator never starts)."""

    def __init__(self, content, close, headers: dict):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})
        self._close = close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._close()

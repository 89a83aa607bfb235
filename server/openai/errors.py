"""OpenAI's error object, from any exception through server/state.py's one map (status_for, HTTP_STATUS)."""
from __future__ import annotations

import math

import orjson
from fastapi.responses import Response

from pagoda.engine.errors import InvalidRequestError
from pagoda.server.state import HTTP_STATUS, status_for

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error",
               405: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_error", 503: "service_unavailable", 504: "timeout"}
# OpenAI's error.code (a string, or null) where an HTTP status has one word for every cause
ERROR_CODES = {400: "invalid_value", 401: "invalid_api_key", 429: "rate_limit_exceeded"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object: type from the status, code a string or null."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code or ERROR_CODES.get(status)}}


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None,
                   code: str | None = None) -> Response:
    return Response(orjson.dumps(error_body(status, message, param, code)), status_code=status,
                    media_type="application/json", headers=headers)


def error_parts(e: Exception) -> tuple[int, str, str | None, str | None]:
    """(HTTP status, message, param, code) of an exception, through the one status map."""
    code, message = status_for(e)
    param = e.field if isinstance(e, InvalidRequestError) else None
    return HTTP_STATUS.get(code, 500), message, param, getattr(e, "reason", None)


def error_for(e: Exception) -> Response:
    status, message, param, code = error_parts(e)
    # seconds, a whole number >= 1 (RFC 9110): the queue-wait estimate where the refusal has one
    wait = getattr(e, "retry_after", None) or 1
    headers = {"Retry-After": str(max(1, math.ceil(wait)))} if status in (429, 503) else None
    return error_response(status, message, param, headers, code)

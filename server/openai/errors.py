"""OpenAI's error object, and any exception's HTTP parts through server/state.py's one map (status_for,
HTTP_STATUS); server/http/dialects.py's Dialect writes them as responses."""
from __future__ import annotations

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


def error_parts(e: Exception) -> tuple[int, str, str | None, str | None]:
    """(HTTP status, message, param, code) of an exception, through the one status map."""
    code, message = status_for(e)
    param = e.field if isinstance(e, InvalidRequestError) else None
    return HTTP_STATUS.get(code, 500), message, param, getattr(e, "reason", None)

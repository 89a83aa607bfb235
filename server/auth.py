"""Optional bearer-token auth (--api-key / PAGODA_API_KEY): a grpc.aio server interceptor.

Every call but grpc.health.v1 and server reflection must carry the metadata
`authorization: Bearer <key>`; others get UNAUTHENTICATED before their request is even parsed. The
comparison is constant-time: hmac.compare_digest over SHA-256 digests (equal lengths, so not even the
key's length leaks).
"""
from __future__ import annotations

import hashlib
import hmac

import grpc

OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
UNAUTHENTICATED_MESSAGE = "missing or invalid API key: send the metadata 'authorization: Bearer <key>'"


def key_digest(value: str | bytes) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value).digest()


def bearer_token(metadata) -> str | bytes | None:
    """The token of the first `authorization: Bearer <token>` metadata entry, else None."""
    for key, value in metadata or ():
        if key != "authorization":
            continue
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
        return None
    return None


def check_key(token, expected_digest: bytes) -> bool:
    return token is not None and hmac.compare_digest(key_digest(token), expected_digest)


async def _deny_unary(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)


async def _deny_stream(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
    yield  # an async generator, like any server-streaming handler  # pragma: no cover


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_key: str, metrics=None):
        self._digest = key_digest(api_key)
        self._metrics = metrics
        # No request deserializer: an unauthenticated request's bytes are never parsed.
        self._deny = {
            (False, False): grpc.unary_unary_rpc_method_handler(_deny_unary),
            (False, True): grpc.unary_stream_rpc_method_handler(_deny_stream),
            (True, False): grpc.stream_unary_rpc_method_handler(_deny_unary),
            (True, True): grpc.stream_stream_rpc_method_handler(_deny_stream),
        }

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method or ""
        if method.startswith(OPEN_PREFIXES) or check_key(bearer_token(handler_call_details.invocation_metadata),
                                                         self._digest):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:  # an unknown method: UNIMPLEMENTED either way
            return None
        if self._metrics is not None:
            self._metrics.requests.labels(method.rsplit("/", 1)[-1], "UNAUTHENTICATED").inc()
        return self._deny[(handler.request_streaming, handler.response_streaming)]

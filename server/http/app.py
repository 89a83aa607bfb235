"""The HTTP door, beside gRPC: the same engine, the same front-end and the same asyncio loop.
OpenAIServer routes each path to its endpoint (completions.py, chat.py, routes.py here; Anthropic's
Messages in server/anthropic, Ollama's API in server/ollama); here too what every route shares: the
API key and body size (before a body is read), a body that does not fit its model as a 400 naming the
field, each in the dialect of the path's API, and uvicorn on a socket bound here."""
from __future__ import annotations

import asyncio
import contextlib

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagoda.server.anthropic.errors import ANTHROPIC
from pagoda.server.anthropic.messages import Messages
from pagoda.server.auth import check_key, key_digest
from pagoda.server.ollama.api import Ollama
from pagoda.server.ollama.embed import OllamaEmbed
from pagoda.server.ollama.errors import OLLAMA
from pagoda.server.openai.chat import Chat
from pagoda.server.openai.completions import Completions
from pagoda.server.openai.embeddings import Embeddings
from pagoda.server.openai.responses import Responses
from pagoda.server.openai.routes import Routes
from pagoda.server.http.serving import Serving
from pagoda.server.http.dialects import OPENAI, Dialect
from pagoda.server.state import ServerState

_OPEN_PATHS = {"/health", "/version", "/metrics"}
# each API's paths, answered (errors included) in its dialect; every other path is OpenAI's
_DIALECTS = (("/v1/messages", ANTHROPIC), ("/api/", OLLAMA))


def dialect_of(path: str) -> Dialect:
    return next((d for prefix, d in _DIALECTS if path.startswith(prefix)), OPENAI)


class OpenAIServer:
    """The routes, over the server's shared state."""

    def __init__(self, state: ServerState):
        self.state = state
        self._key = key_digest(state.options.api_key) if state.options.api_key else None
        serving = Serving(state)
        completions, chat, routes = Completions(serving), Chat(serving), Routes(serving)
        responses = Responses(chat)
        messages, ollama = Messages(Serving(state, ANTHROPIC)), Ollama(Serving(state, OLLAMA))
        ollama_embed = OllamaEmbed(Serving(state, OLLAMA))
        # no redirect for a trailing slash: each route answers with and without one
        self.app = FastAPI(title="pagoda", openapi_url=None, docs_url=None, redoc_url=None, redirect_slashes=False)
        self.app.add_exception_handler(RequestValidationError, _invalid_body)
        self.app.add_exception_handler(StarletteHTTPException, _no_route)
        self.app.middleware("http")(self._guard)
        for method, path, handler in (
                ("POST", "/v1/completions", completions.create), ("POST", "/v1/chat/completions", chat.create),
                ("POST", "/v1/responses", responses.create),
                ("GET", "/v1/models", routes.models), ("GET", "/v1/models/{model_id:path}", routes.model),
                ("POST", "/tokenize", routes.tokenize), ("POST", "/detokenize", routes.detokenize),
                ("GET", "/health", routes.health), ("GET", "/stats", routes.stats), ("GET", "/version", routes.version),
                ("GET", "/metrics", routes.metrics), ("POST", "/v1/load_lora_adapter", routes.load_lora_adapter),
                ("POST", "/v1/unload_lora_adapter", routes.unload_lora_adapter),
                *messages.routes(), *ollama.routes(), *ollama_embed.routes(), *Embeddings(serving).routes()):
            for route in (path, path + "/"):
                self.app.add_api_route(route, handler, methods=[method], include_in_schema=False)

    async def _guard(self, request: Request, call_next):
        """API key (all but /health, /version and /metrics, as vLLM; `Authorization: Bearer KEY`, or Anthropic's
        `x-api-key: KEY`) and request size, before a body is read."""
        dialect = dialect_of(request.url.path)
        if self._key is not None and request.url.path.rstrip("/") not in _OPEN_PATHS:
            auth = request.headers.get("authorization", "")
            token = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-api-key")
            if not check_key(token, self._key):
                return dialect.error_response(401, "a valid API key is required: Authorization: Bearer KEY "
                                                   "(or x-api-key: KEY)")
        size = request.headers.get("content-length")
        limit = self.state.options.max_message_bytes
        if size is not None and size.isdigit() and int(size) > limit:
            return dialect.error_response(413, f"the request body is {size} bytes, more than this server's {limit} "
                                               f"(--max-message-bytes)")
        return await call_next(request)


async def _no_route(request: Request, exc: StarletteHTTPException) -> Response:
    dialect = dialect_of(request.url.path)
    if exc.status_code in (404, 405):
        return dialect.error_response(exc.status_code, f"no route {request.method} {request.url.path}")
    return dialect.error_response(exc.status_code, str(exc.detail))


async def _invalid_body(request: Request, exc: RequestValidationError) -> Response:
    error_response = dialect_of(request.url.path).error_response
    err = exc.errors()[0] if exc.errors() else {}
    param = _param_of(err.get("loc", ()))
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        return error_response(400, f"unknown field {param!r}", param, code="unknown_parameter")
    if kind == "json_invalid":
        return error_response(400, "the request body is not valid JSON", code="invalid_json")
    if kind == "missing":
        return error_response(400, f"{param} is required", param, code="missing_required_parameter")
    code = "invalid_type" if kind.endswith("_type") or kind == "literal_error" else None
    return error_response(400, f"{param or 'body'}: {err.get('msg', 'invalid')}", param, code=code)


def _param_of(loc) -> str | None:
    """A pydantic error location as the field's name: messages[0].content, not body.messages.0.content."""
    parts = [p for p in loc if p != "body"]
    if not parts:
        return None
    # a union's member names (str, list[int], ...) say which type was tried, not where
    parts = [p for p in parts if not (isinstance(p, str) and ("[" in p or p in _TYPE_NAMES))]
    out = ""
    for i, p in enumerate(parts):
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p))
    return out


_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none", "function-after", "literal"}


# ---- the server ----

class _ChunkedBodyLimit:
    """--max-message-bytes for a body sent without Content-Length (chunked), which the route would
    otherwise read whole: read here up to the limit (413 past it), then handed on."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and not any(k == b"content-length" for k, _ in scope["headers"]):
            limit, size, parts = self.state.options.max_message_bytes, 0, []
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    break
                size += len(message.get("body", b""))
                if size > limit:
                    response = dialect_of(scope["path"]).error_response(
                        413, f"the request body is more than this server's {limit} bytes (--max-message-bytes)")
                    return await response(scope, receive, send)
                parts.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
            whole = [{"type": "http.request", "body": b"".join(parts), "more_body": False}]

            async def replay():
                return whole.pop() if whole else await receive()
            return await self.app(scope, replay, send)
        return await self.app(scope, receive, send)


class _Uvicorn:
    """uvicorn on a socket bound here (so a port in use fails at start, with the port named), inside
    the server's own event loop; the server process keeps its own SIGTERM handling (drain)."""

    def __init__(self, app, sock, options):
        import ssl

        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # pagoda serve drains on SIGTERM itself
                yield

        tls = {}
        if options.tls_cert:
            tls = dict(ssl_certfile=options.tls_cert, ssl_keyfile=options.tls_key)
            if options.tls_client_ca:
                tls.update(ssl_ca_certs=options.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=1,
                                timeout_keep_alive=options.http_keepalive_timeout, **tls)
        self.server = Server(config)
        self.port = sock.getsockname()[1]
        self.task = asyncio.ensure_future(self.server.serve(sockets=[sock]))

    async def stop(self) -> None:
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.task, 10)


def bind(host: str, port: int):
    """A listening TCP socket on host:port ("[::]" or "::": every interface, IPv4 too); OSError
    naming --http-port and the fix."""
    from pagoda.server.ports import bound_socket

    sock = bound_socket(host, port, "--http-port")
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def start(state: ServerState, host: str, port: int) -> _Uvicorn:
    return _Uvicorn(_ChunkedBodyLimit(OpenAIServer(state).app, state), bind(host, port), state.options)

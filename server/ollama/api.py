"""Ollama's endpoints: /api/chat and /api/generate through the serving skeleton (server/chat's one
chat layer beneath), /api/tags, /api/show, /api/ps and /api/version, and the heartbeat at /."""
from __future__ import annotations

import time
from functools import partial

from fastapi import Request
from fastapi.responses import PlainTextResponse, Response

from pagoda.engine.errors import InvalidRequestError
from pagoda.server.ollama import chat, models
from pagoda.server.ollama.protocol import ChatBody, GenerateBody, ShowBody
from pagoda.server.http.serving import Serving, json_response

# The Ollama release whose API this one follows: clients gate features on it (structured outputs
# 0.5, streamed tool calls 0.8, think 0.9), and every one of those is served here.
VERSION = "0.12.0"
_MANAGING = [("POST", "/api/pull"), ("POST", "/api/push"), ("POST", "/api/create"), ("POST", "/api/copy"),
             ("DELETE", "/api/delete")]


class Ollama:
    def __init__(self, serving: Serving):
        self.serving, self.state = serving, serving.state

    def routes(self) -> list:
        return [("GET", "/", self.heartbeat), ("HEAD", "/", self.heartbeat),
                ("POST", "/api/chat", self.chat), ("POST", "/api/generate", self.generate),
                ("GET", "/api/tags", self.tags), ("POST", "/api/show", self.show), ("GET", "/api/ps", self.ps),
                ("GET", "/api/version", self.version),
                *[(method, path, self.manage) for method, path in _MANAGING]]

    async def manage(self, request: Request) -> Response:
        """Ollama's model management (pull, push, create, copy, delete): refused, saying what is served."""
        names = ", ".join(repr(n) for n in self.state.served_model_names())
        return self.serving.dialect.error_response(
            501, f"{request.method} {request.url.path}: this server serves the model it was started with ({names}) "
                 f"and manages no others (start pagoda serve MODEL for another)")

    async def heartbeat(self) -> Response:
        """The ollama CLI's and Open WebUI's check that a server is there (they read this text)."""
        return PlainTextResponse("Ollama is running")

    async def version(self) -> Response:
        return json_response({"version": VERSION})

    async def chat(self, body: ChatBody, request: Request) -> Response:
        if not body.messages:
            return self._loaded(body.model, True)
        return await self._generate(body, request, chat.chat_requests, True)

    async def generate(self, body: GenerateBody, request: Request) -> Response:
        if not body.prompt:
            return self._loaded(body.model, False)
        return await self._generate(body, request, chat.generate_requests, False)

    async def _generate(self, body, request: Request, requests, is_chat: bool) -> Response:
        start, name = time.monotonic(), body.model
        body = body.model_copy(update={"model": self._resolve(name)})
        return await self.serving.generate(body, request, "ollama-", partial(requests, self.serving, body),
                                           partial(chat.whole, is_chat, name, start),
                                           partial(chat.chunks, is_chat, name, start))

    def _loaded(self, name: str, is_chat: bool) -> Response:
        """A call with nothing to generate loads the model in Ollama: here it is loaded already."""
        def work(engine):
            self.serving.check_model(self._resolve(name))
            return chat.loaded(name, is_chat)
        return self.serving.plain(work)

    async def tags(self) -> Response:
        return self.serving.plain(lambda engine: {"models": [
            models.entry(engine, n, parent) for n, parent in models.served(self.state, engine)]})

    async def ps(self) -> Response:
        return self.serving.plain(lambda engine: {"models": [
            models.running(engine, n, parent) for n, parent in models.served(self.state, engine)]})

    async def show(self, body: ShowBody) -> Response:
        def work(engine):
            if not (body.model or body.name):
                raise InvalidRequestError("model", "is required")
            name = self._resolve(body.model or body.name)
            adapter = self.serving.check_model(name)
            return models.show(engine, self.state, name, adapter and self.state.served_model_names()[0])
        return self.serving.plain(work)

    def _resolve(self, name: str) -> str:
        engine = self.state.engine
        names = self.state.served_model_names() + (sorted(engine.adapters) if engine is not None else [])
        return models.resolve(name, names)


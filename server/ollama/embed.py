"""Ollama's /api/embed (and the older /api/embeddings): pooling requests (engine/pooling.py) through the
serving skeleton in Ollama's dialect. /api/embed's vectors are L2-normalized, as Ollama's are. Its
`truncate` (default true) keeps an input's last tokens when it is longer than the context (Ollama keeps
the first: the last are kept here because last-token pooling reads the EOS the tokenizer appends)."""
from __future__ import annotations

import time
from functools import partial

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from pagoda.engine.errors import InvalidRequestError
from pagoda.engine.pooling import PoolingParams
from pagoda.server.chat.answer import PLAIN
from pagoda.server.ollama import models
from pagoda.server.openai.protocol import Int
from pagoda.server.http.serving import Call, Serving


class _Fields(BaseModel):
    # JSON's types exactly, as Ollama's Go decoding; an unknown field is refused by name
    model_config = ConfigDict(extra="forbid", strict=True)


class EmbedBody(_Fields):
    model: str
    input: str | list[str]
    truncate: bool | None = None
    dimensions: Int | None = None
    options: dict | None = None  # accepted, not used: sampling options mean nothing to pooling
    keep_alive: str | Int | None = None  # accepted: the model stays loaded


class EmbeddingsBody(_Fields):
    """The older /api/embeddings: one prompt, its vector as the model pools it."""
    model: str
    prompt: str
    options: dict | None = None
    keep_alive: str | Int | None = None


class OllamaEmbed:
    def __init__(self, serving: Serving):
        self.serving, self.state = serving, serving.state

    def routes(self) -> list[tuple]:
        return [("POST", "/api/embed", self.embed), ("POST", "/api/embeddings", self.embeddings)]

    async def embed(self, body: EmbedBody, request: Request) -> Response:
        inputs = [body.input] if isinstance(body.input, str) else list(body.input)
        params = {"normalize": True, "dimensions": body.dimensions}
        return await self._pooled(body, request, inputs, "input", params, body.truncate is not False,
                                  partial(_embed, body.model))

    async def embeddings(self, body: EmbeddingsBody, request: Request) -> Response:
        return await self._pooled(body, request, [body.prompt], "prompt", {}, False, _embeddings)

    async def _pooled(self, body, request: Request, inputs: list, field: str, params: dict, truncate: bool,
                      answer) -> Response:
        start = time.monotonic()
        body = body.model_copy(update={"model": self._resolve(body.model)})
        make = partial(self._requests, inputs, field, params, truncate)
        return await self.serving.generate(body, request, "ollama-", make, partial(answer, start), None)

    def _requests(self, inputs: list, field: str, params: dict, truncate: bool, engine, rid: str) -> tuple:
        if not inputs:
            raise InvalidRequestError(field, "must not be empty")
        self.state.check_call_size(len(inputs), field)
        pooling = PoolingParams(**params, truncate_prompt_tokens=engine.model_info.max_model_len if truncate else None)
        reqs = []
        for i, text in enumerate(inputs):
            try:
                reqs.append(engine.make_request(text, pooling, f"{rid}-{i}", limits=self.state.limits, stream=False))
            except InvalidRequestError as e:
                if not e.field.startswith("prompt"):
                    raise
                raise e.renamed(f"{field}[{i}]" if len(inputs) > 1 else field) from None
        return reqs, PLAIN

    def _resolve(self, name: str) -> str:
        engine = self.state.engine
        names = self.state.served_model_names() + (sorted(engine.adapters) if engine is not None else [])
        return models.resolve(name, names)


def _vectors(outs: list) -> tuple[list[list[float]], int]:
    ordered = [out for _, out in sorted(outs, key=lambda x: x[0])]
    return [o.embedding.tolist() for o in ordered], sum(o.num_prompt_tokens for o in ordered)


def _embed(name: str, start: float, call: Call, outs: list) -> dict:
    vectors, tokens = _vectors(outs)
    total = int((time.monotonic() - start) * 1e9)
    return {"model": name, "embeddings": vectors, "total_duration": total, "load_duration": 0,
            "prompt_eval_count": tokens}


def _embeddings(start: float, call: Call, outs: list) -> dict:
    return {"embedding": _vectors(outs)[0][0]}

"""The small routes: GET /v1/models (and one model), POST /tokenize and /detokenize (vLLM's),
GET /health, /stats, /version and /metrics."""
from __future__ import annotations

import json
import time

from fastapi.responses import Response

from pagoda.engine.errors import InvalidRequestError
from pagoda.engine.validation import check_text
from pagoda.server.openai.chat import render_chat
from pagoda.server.openai.errors import error_response
from pagoda.server.openai.protocol import DetokenizeRequest, TokenizeRequest
from pagoda.server.openai.serving import Serving, json_response
from pagoda.server.state import SERVING, stats_dict


class Routes:
    def __init__(self, serving: Serving):
        self.serving, self.state = serving, serving.state

    async def health(self) -> Response:
        if self.state.phase == SERVING and self.state.engine is not None:
            return json_response({"status": "serving"})
        return json_response({"status": self.state.phase}, 503)

    async def models(self) -> Response:
        return self.serving.plain(lambda engine: {"object": "list", "data": [
            _model_card(engine, name) for name in self.state.served_model_names()]})

    async def model(self, model_id: str) -> Response:
        """GET /v1/models/{id} (the SDK's models.retrieve)."""
        def card(engine):
            self.serving.check_model(model_id)
            return _model_card(engine, model_id)
        return self.serving.plain(card)

    async def version(self) -> Response:
        from importlib.metadata import version
        return json_response({"version": version("pagoda")})

    async def metrics(self) -> Response:
        """Prometheus' text format, on the HTTP port where scrapers look first (also --metrics-port)."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if self.state.metrics is None:
            return error_response(404, "this server keeps no metrics")
        return Response(generate_latest(self.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def stats(self) -> Response:
        return self.serving.plain(lambda engine: stats_dict(engine.stats()))  # GetStats' figures, under its names

    async def tokenize(self, body: TokenizeRequest) -> Response:
        """vLLM's /tokenize: a prompt's (or a conversation's) token ids."""
        def tokenize(engine):
            self.serving.check_model(body.model)
            if (body.prompt is None) == (body.messages is None):
                raise InvalidRequestError("prompt", "or messages: exactly one is required")
            if body.prompt is not None:
                check_text("prompt", body.prompt)
                ids = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
            else:
                ids = render_chat(engine, body.messages)
            strs = [engine.vocab.pieces[t].decode("utf-8", "replace") for t in ids] if body.return_token_strs else None
            return {"count": len(ids), "max_model_len": engine.model_info.max_model_len, "tokens": ids,
                    "token_strs": strs}
        return self.serving.plain(tokenize)

    async def detokenize(self, body: DetokenizeRequest) -> Response:
        """vLLM's /detokenize: the text token ids spell."""
        def detokenize(engine):
            self.serving.check_model(body.model)
            vocab = engine.model_info.vocab_size
            for i, t in enumerate(body.tokens):
                if not 0 <= t < vocab:
                    raise InvalidRequestError(f"tokens[{i}]", f"must be a token id in [0, {vocab}), got {t}")
            return {"prompt": engine.decode(body.tokens, skip_special_tokens=False)}
        return self.serving.plain(detokenize)


def _model_card(engine, name: str) -> dict:
    loaded = int(time.time() - engine.stats().uptime_s)
    return {"id": name, "object": "model", "created": loaded, "owned_by": "pagoda",
            "max_model_len": engine.model_info.max_model_len, "dtype": engine.model_info.dtype,
            "deterministic": engine.model_info.deterministic,
            "speculative_config": json.loads(engine.model_info.speculative_config or "null")}

"""The small routes: GET /v1/models (and one model), POST /tokenize and /detokenize (vLLM's),
GET /health, /stats, /version and /metrics."""
from __future__ import annotations

import json
import time

from fastapi.responses import Response

from pagoda.engine.errors import InvalidRequestError
from pagoda.engine.validation import check_text
from pagoda.server.openai.chat import render_chat
from pagoda.server.openai.protocol import (DetokenizeRequest, LoadLoRAAdapterRequest, TokenizeRequest,
                                           UnloadLoRAAdapterRequest)
from pagoda.server.http.serving import Serving, json_response
from pagoda.server.state import SERVING, stats_dict


class Routes:
    def __init__(self, serving: Serving):
        self.serving, self.state = serving, serving.state

    async def health(self) -> Response:
        if self.state.phase == SERVING and self.state.engine is not None:
            return json_response({"status": "serving"})
        return json_response({"status": self.state.phase}, 503)

    async def models(self) -> Response:
        """The base model under each served name, then each LoRA adapter with the base as its parent."""
        def cards(engine):
            names = self.state.served_model_names()
            return {"object": "list", "data": [_model_card(engine, n) for n in names] + [
                _model_card(engine, a, names[0]) for a in sorted(engine.adapters)]}
        return self.serving.plain(cards)

    async def model(self, model_id: str) -> Response:
        """GET /v1/models/{id} (the SDK's models.retrieve)."""
        def card(engine):
            adapter = self.serving.check_model(model_id)
            return _model_card(engine, model_id, adapter and self.state.served_model_names()[0])
        return self.serving.plain(card)

    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest) -> Response:
        """vLLM's POST /v1/load_lora_adapter (with --allow-lora-loading)."""
        return await self._adapters(lambda engine: engine.load_adapter(body.lora_name, body.lora_path),
                                    f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest) -> Response:
        """vLLM's POST /v1/unload_lora_adapter: answered once the adapter's requests in flight have finished."""
        return await self._adapters(lambda engine: engine.unload_adapter(body.lora_name),
                                    f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    async def _adapters(self, work, message: str) -> Response:
        try:
            self.state.check_lora_loading()
            with self.state.admit(generation=False) as engine:
                await work(engine)
        except Exception as e:
            return self.serving.dialect.error_for(e)
        return Response(message, media_type="text/plain")

    async def version(self) -> Response:
        from importlib.metadata import version
        return json_response({"version": version("pagoda")})

    async def metrics(self) -> Response:
        """Prometheus' text format, on the HTTP port where scrapers look first (also --metrics-port)."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if self.state.metrics is None:
            return self.serving.dialect.error_response(404, "this server keeps no metrics")
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


def _model_card(engine, name: str, parent: str | None = None) -> dict:
    """A model object; a LoRA adapter's names its base model as `parent` (vLLM's) and its directory as `root`."""
    loaded = int(time.time() - engine.stats().uptime_s)
    extra = {} if parent is None else {"parent": parent, "root": engine.adapters[name].path}
    return {"id": name, "object": "model", "created": loaded, "owned_by": "pagoda", **extra,
            "max_model_len": engine.model_info.max_model_len, "dtype": engine.model_info.dtype,
            "quantization": engine.model_info.quantization or None,
            "deterministic": engine.model_info.deterministic,
            "speculative_config": json.loads(engine.model_info.speculative_config or "null")}

"""POST /v1/embeddings: a pooling request per input (engine/pooling.py), through the serving skeleton as
any generation is; each vector as floats or as base64 of little-endian float32. POST /v1/score and
/v1/rerank (vLLM's) score text pairs (server/scoring.py)."""
from __future__ import annotations

import base64
from functools import partial

import numpy as np
from fastapi import Request
from fastapi.responses import Response

from pagoda.engine.errors import InvalidRequestError
from pagoda.engine.pooling import PoolingParams, with_prompt
from pagoda.server.chat.answer import PLAIN
from pagoda.server.openai.protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from pagoda.server.http.serving import Call, Serving
from pagoda.server.scoring import pair_inputs, pair_scores, ranked


class Embeddings:
    def __init__(self, serving: Serving):
        self.serving = serving

    def routes(self) -> list[tuple]:
        return [("POST", "/v1/embeddings", self.create), ("POST", "/v1/score", self.score),
                ("POST", "/v1/rerank", self.rerank)]

    async def create(self, body: EmbeddingRequest, request: Request) -> Response:
        return await self.serving.generate(body, request, "embd-", partial(self._embeddings, body),
                                           partial(_embeddings, body), None)

    async def score(self, body: ScoreRequest, request: Request) -> Response:
        return await self.serving.generate(body, request, "score-", partial(self._pairs, body, _score_texts),
                                           partial(_scores, body), None)

    async def rerank(self, body: RerankRequest, request: Request) -> Response:
        return await self.serving.generate(body, request, "rerank-", partial(self._pairs, body, _rerank_texts),
                                           partial(_ranked, body), None)

    def _embeddings(self, body: EmbeddingRequest, engine, rid: str) -> tuple:
        inputs = _inputs(body.input)
        inputs = with_prompt(inputs, engine.model_info.pooler, body.prompt_name)
        several = isinstance(body.input, list) and isinstance(body.input[0], (str, list))
        names = [f"input[{i}]" if several else "input" for i in range(len(inputs))]
        params = PoolingParams(normalize=body.normalize, dimensions=body.dimensions,
                               truncate_prompt_tokens=_keep(body.truncate_prompt_tokens, engine))
        return self._requests(body, engine, rid, inputs, names, params), PLAIN

    def _pairs(self, body, pairs, engine, rid: str) -> tuple:
        """Each pair's two texts (pairs(body): lefts, rights, and each text's name): a cross-encoder's request
        per pair, or each text embedded normalized, lefts first, then rights."""
        lefts, rights, names = pairs(body)
        inputs, names, params = pair_inputs(engine, lefts, rights, names, _keep(body.truncate_prompt_tokens, engine))
        return self._requests(body, engine, rid, inputs, names, params), PLAIN

    def _requests(self, body, engine, rid: str, inputs: list, names: list[str], params: PoolingParams) -> list:
        """A pooling request per input; the engine's prompt fields renamed to the input's."""
        self.serving.state.check_call_size(len(inputs), names[0].partition("[")[0])
        reqs = []
        for i, (x, name) in enumerate(zip(inputs, names)):
            try:
                reqs.append(engine.make_request(x, params, f"{rid}-{i}", body.priority or 0,
                                                limits=self.serving.state.limits, stream=False))
            except InvalidRequestError as e:  # the engine's prompt_token_ids[j] as this request spells it
                if not e.field.startswith("prompt"):
                    raise
                raise e.renamed(name + e.field.removeprefix("prompt_token_ids").removeprefix("prompt")) from None
        return reqs


def _keep(truncate_prompt_tokens: int | None, engine) -> int | None:
    """vLLM's truncate_prompt_tokens: -1 is the model's length."""
    return engine.model_info.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens


def _inputs(given) -> list:
    """The request's inputs: a text, a list of texts, token ids, or a list of token-id lists."""
    if isinstance(given, str):
        return [given]
    if not given:
        raise InvalidRequestError("input", "must not be empty")
    return [given] if isinstance(given[0], int) else list(given)


def _score_texts(body: ScoreRequest) -> tuple:
    """text_1 against each text_2: one against many (text_1 repeated), or two lists of one length."""
    lefts = [body.text_1] if isinstance(body.text_1, str) else list(body.text_1)
    rights = [body.text_2] if isinstance(body.text_2, str) else list(body.text_2)
    if not lefts or not rights:
        raise InvalidRequestError("text_1" if not lefts else "text_2", "must not be empty")
    if len(lefts) == 1:
        lefts = lefts * len(rights)
    elif len(lefts) != len(rights):
        raise InvalidRequestError("text_2", f"must hold as many texts as text_1 ({len(lefts)}), or text_1 just "
                                            f"one; got {len(rights)}")
    names = ["text_1" if isinstance(body.text_1, str) else f"text_1[{i}]" for i in range(len(lefts))]
    names += ["text_2" if isinstance(body.text_2, str) else f"text_2[{i}]" for i in range(len(rights))]
    return lefts, rights, names


def _rerank_texts(body: RerankRequest) -> tuple:
    """The query against each document."""
    if not body.documents:
        raise InvalidRequestError("documents", "must not be empty")
    if body.top_n is not None and body.top_n < 0:
        raise InvalidRequestError("top_n", f"must be >= 0 (0: every document), got {body.top_n}")
    n = len(body.documents)
    return [body.query] * n, list(body.documents), ["query"] * n + [f"documents[{i}]" for i in range(n)]


def _vectors(outs: list) -> tuple[list[np.ndarray], int]:
    """The whole outputs' vectors by input index, and their tokens."""
    ordered = [out for _, out in sorted(outs, key=lambda x: x[0])]
    return [o.embedding for o in ordered], sum(o.num_prompt_tokens for o in ordered)


def _embeddings(body: EmbeddingRequest, call: Call, outs: list) -> dict:
    vectors, tokens = _vectors(outs)
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
            for i, v in enumerate(vectors)]
    return {"id": call.id, "object": "list", "created": call.created, "model": call.model, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _scores(body: ScoreRequest, call: Call, outs: list) -> dict:
    scores, tokens = pair_scores(call.engine, outs)
    return {"id": call.id, "object": "list", "created": call.created, "model": call.model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _ranked(body: RerankRequest, call: Call, outs: list) -> dict:
    scores, tokens = pair_scores(call.engine, outs)
    results = [{"index": i, "relevance_score": scores[i], "document": {"text": body.documents[i]}}
               for i in ranked(scores, body.top_n)]
    if body.return_documents is False:
        for r in results:
            del r["document"]
    return {"id": call.id, "model": call.model, "results": results, "usage": {"total_tokens": tokens}}


def _encoded(vector: np.ndarray, encoding_format: str | None):
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()

"""Scoring text pairs, for every door (POST /v1/score and /v1/rerank, gRPC Rerank): with an embedding model
as a bi-encoder (the cosine of the two texts' normalized embeddings); with a causal LM served as a
cross-encoder (--pooling '{"classifier_from_token": ["no", "yes"]}', Qwen3-Reranker's recipe) the pair
tokenized together (as vLLM does: the client writes the model's prompt template into the texts) and scored by
the softmax of the last position's logits of those tokens: P("yes")."""
from __future__ import annotations

import numpy as np

from pagoda.engine.errors import InvalidRequestError
from pagoda.engine.pooling import PoolingParams
from pagoda.engine.validation import check_text


def pair_inputs(engine, lefts: list[str], rights: list[str], names: list[str], keep: int | None) -> tuple:
    """(inputs, their names, PoolingParams) of the pairs: each pair's token ids (a cross-encoder), or each
    text alone, lefts first, then rights (a bi-encoder). names: the lefts' then the rights' field names."""
    classes = classifier_ids(engine)
    if classes is None:
        return lefts + rights, names, PoolingParams(normalize=True, truncate_prompt_tokens=keep)
    names = names[len(lefts):]
    ids = [engine.tokenizer(check_text(n, a), check_text(n, b))["input_ids"] for a, b, n in zip(lefts, rights, names)]
    return ids, names, PoolingParams(truncate_prompt_tokens=keep, logit_token_ids=classes)


def pair_scores(engine, outs: list) -> tuple[list[float], int]:
    """Each pair's score from the whole outputs ((input index, output) pairs), and the tokens of them all."""
    ordered = [out for _, out in sorted(outs, key=lambda x: x[0])]
    vectors, tokens = [o.embedding for o in ordered], sum(o.num_prompt_tokens for o in ordered)
    if classifier_ids(engine) is not None:
        return [float(_softmax(v)[-1]) for v in vectors], tokens
    n = len(vectors) // 2
    return [float(np.dot(a, b)) for a, b in zip(vectors[:n], vectors[n:])], tokens


def ranked(scores: list[float], top_n: int | None) -> list[int]:
    """The documents' indexes, best first; the first top_n of them (None or 0: all)."""
    return sorted(range(len(scores)), key=lambda i: -scores[i])[:top_n or None]


def classifier_ids(engine) -> tuple[int, ...] | None:
    """A cross-encoder's class tokens (PoolerConfig.classifier_from_token) as ids, or None: a bi-encoder."""
    pooler = engine.model_info.pooler
    if pooler is None or not pooler.classifier_from_token:
        return None
    ids = tuple(engine.tokenizer.convert_tokens_to_ids(t) for t in pooler.classifier_from_token)
    if any(i is None or i == engine.tokenizer.unk_token_id for i in ids):
        raise InvalidRequestError("model", f"classifier_from_token {list(pooler.classifier_from_token)} are not "
                                           f"single tokens of this model's vocabulary")
    return ids


def _softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max())
    return e / e.sum()

"""Logprobs as OpenAI (chat, completions) and vLLM (prompt_logprobs) write them, each token's text
from the bytes it spells (engine/detokenizer.py TokenVocab)."""
from __future__ import annotations

from pagoda.engine.outputs import TokenLogprob


class Logprobs:
    def __init__(self, vocab):
        self.pieces = vocab.pieces

    def _piece(self, token_id: int) -> bytes:
        return self.pieces[token_id] if token_id < len(self.pieces) else b""

    def _token(self, token_id: int) -> str:
        return self._piece(token_id).decode("utf-8", "replace")

    def chat(self, items) -> dict:
        def entry(token_id, logprob):
            piece = self._piece(token_id)
            return {"token": piece.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(piece)}
        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, p) for t, p in lp.top]}
                            for lp in items], "refusal": None}

    def completion(self, items, start: int = 0) -> tuple[dict, int]:
        """OpenAI's completion logprobs, each token's text_offset counted from `start` (where this
        piece begins in the choice's whole text); and where the next token starts."""
        tokens = [self._token(lp.token_id) for lp in items]
        offsets, at = [], start
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in items],
                "top_logprobs": [None if lp.top is None else {self._token(t): p for t, p in lp.top} for lp in items],
                "text_offset": offsets}, at

    def prompt(self, items) -> list | None:
        """vLLM's prompt_logprobs: per prompt token (None for the first), {token id: {logprob, rank,
        decoded_token}} for the token itself and the top alternatives."""
        if items is None:
            return None

        def entries(lp):
            pairs = {lp.token_id: (lp.logprob, lp.rank), **{t: (p, r) for r, (t, p) in enumerate(lp.top, 1)}}
            return {str(t): {"logprob": p, "rank": r, "decoded_token": self._token(t)} for t, (p, r) in pairs.items()}
        return [None if lp is None else entries(lp) for lp in items]


def echoed(prompt_token_ids: list[int] | None, prompt_logprobs) -> list:
    """An echoed prompt's logprob entries (the first token has none: null logprob and top), to go
    before the completion's; none without echo."""
    if prompt_token_ids is None:
        return []
    lps = prompt_logprobs or [None] * len(prompt_token_ids)
    return [lp or TokenLogprob(t, None, None) for t, lp in zip(prompt_token_ids, lps)]

"""Pooled hidden states: a pooling request's prompt runs in (chunked) prefill steps like any other;
each step folds its rows into the sequence's pool state, and the step that completes the prompt
makes its vector: the last token's hidden state, the mean over the prompt, the first token's (CLS)
or every token's. Then Matryoshka truncation, then L2 normalization, in float32."""
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class PoolRows:
    """A pooling sequence's rows [start, end) of the step's flat batch; `first` is the position of
    row `start` in its prompt, `done` whether this step completes the prompt."""
    seq: object
    start: int
    end: int
    first: int
    done: bool


def logit_rows(rows: list[PoolRows]) -> list[int]:
    """The rows whose LM-head logits a cross-encoder's score reads: each one's last, once its prompt is done."""
    return [r.end - 1 for r in rows if r.done and r.seq.pooling.logit_token_ids]


def pool_step(hidden: torch.Tensor, rows: list[PoolRows], logits: torch.Tensor | None = None
              ) -> list[tuple[object, np.ndarray]]:
    """hidden: [num_tokens, hidden] of the step; logits: [len(logit_rows(rows)), vocab], of those rows.
    Folds each pooling sequence's rows into its pool_state; returns the vectors of those whose prompt
    completed (float32, [dims], or [num_tokens, dims] for "all"; a score's logits [len(logit_token_ids)]),
    with one copy to the host."""
    done, scored = [], iter(range(0 if logits is None else len(logits)))
    for r in rows:
        p = r.seq.pooling
        if p.logit_token_ids and r.done:
            ids = torch.tensor(p.logit_token_ids, device=logits.device)
            done.append((r.seq, logits[next(scored)][ids].float()))
            continue
        if p.method == "last":
            state = hidden[r.end - 1] if r.done else None
        elif p.method == "cls":
            state = hidden[r.start] if r.first == 0 else r.seq.pool_state
        elif p.method == "mean":
            chunk = hidden[r.start:r.end].float().sum(dim=0)
            state = chunk if r.seq.pool_state is None else r.seq.pool_state + chunk
        else:  # all
            chunk = hidden[r.start:r.end].float()
            state = chunk if r.seq.pool_state is None else torch.cat([r.seq.pool_state, chunk])
        if r.done:
            done.append((r.seq, _finish(state.float(), p, r.seq.num_prompt_tokens)))
        else:
            r.seq.pool_state = state
    if not done:
        return []
    flat = torch.cat([v.reshape(-1) for _, v in done]).cpu().numpy()  # the one host copy
    out, at = [], 0
    for seq, v in done:
        out.append((seq, flat[at:at + v.numel()].reshape(v.shape)))
        at += v.numel()
    return out


def _finish(state: torch.Tensor, p, num_tokens: int) -> torch.Tensor:
    # state: [hidden] (or [num_tokens, hidden] for "all") -> [dims]
    if p.method == "mean":
        state = state / num_tokens
    state = state[..., :p.dimensions]
    return F.normalize(state, dim=-1) if p.normalize else state

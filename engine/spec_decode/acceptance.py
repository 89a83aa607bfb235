"""Acceptance of speculative proposals (engine/spec_decode/proposers.py makes them).

The rejection sampling of Leviathan et al. 2023 / Chen et al. 2023 for a point-mass proposal x (n-gram lookup proposes one token, with probability 1) accepts x with probability p(x)
and on rejection samples from p with x removed, renormalised. Drawing t ~ p at the position and
accepting iff t == x realises exactly that law (P(t == x) = p(x); given t != x, t is distributed
as p without x), and the first rejected position's token is t itself. So every query row is sampled
as usual (greedy rows: the argmax) and a sequence keeps its proposals up to the first that differs
from the row's token, plus that token (or, all accepted, the last row's). With the draws of a
seeded row keyed by its position (ModelRunner._generators), a seeded request gives the same text
with speculation as without, whatever the batch. A greedy draft model's proposal is a point mass
too: a deterministic function of the context (its argmax), so the same rule is exact for it. (A
sampled draft would need the general rule: accept with min(1, p(x) / q(x)), else draw from max(0, p - q).)
"""
import numpy as np
import torch


def proposal_rows(sched) -> np.ndarray | None:
    """Per sampled row of the step: the proposed token that row's logits verify, -1 where none
    (a sequence's last row, a sequence that does not speculate); None when none speculates."""
    if not sched.spec_tokens:
        return None
    rows = []
    for k, spec in zip(sched.num_sampled, sched.spec_tokens):
        if k:
            rows += spec
            rows.append(-1)
    return np.array(rows, dtype=np.int64)


def accepted_tokens(tokens: torch.Tensor, accepted: torch.Tensor, num_rows: np.ndarray) -> list[list[int]]:
    """Per sampling sequence, its new tokens: the accepted prefix of its proposals, then the token of
    the first row not accepted. tokens, accepted: [num_rows_total], each row's token (the target's
    choice there) and whether it equals the row's proposal; num_rows: rows per sequence. The step's
    one host-device sync."""
    width = int(num_rows.max())
    first = np.cumsum(num_rows) - num_rows
    cols = np.arange(width)
    valid = cols[None, :] < num_rows[:, None]
    idx = torch.from_numpy(np.where(valid, first[:, None] + cols[None, :], first[:, None])).to(tokens.device)
    # idx: [num_seqs, width] rows of each sequence, padded with its first
    ok = accepted[idx] & torch.from_numpy(valid).to(tokens.device)
    num_accepted = ok.int().cumprod(dim=1).sum(dim=1)  # [num_seqs]
    table = torch.cat([num_accepted[:, None], tokens[idx]], dim=1).tolist()
    return [r[1:r[0] + 2] for r in table]

"""The step's flat batch as arrays (numpy, on the host): the sequences' new tokens one after another, their
positions and KV slots, block tables padded with -1, which rows are sampled, scored or pooled. The model
runner moves them to the device."""
from __future__ import annotations

import itertools

import numpy as np

from pagoda.engine.core.scheduler import SchedulerOutput
from pagoda.engine.core.sequence import Sequence
from pagoda.engine.layers.pooler import PoolRows


def gather(sched: SchedulerOutput, num_groups: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The one pass over the step's sequences (numpy does the rest): the new tokens' ids, flat;
    each seq's first new position; every KV group's block tables [num_groups, num_seqs, widest], padded
    with -1 (a sequence's tables are equally long)."""
    starts, ids, tables = [], [], [[] for _ in range(num_groups)]
    for i, (s, n) in enumerate(zip(sched.seqs, sched.num_new_tokens)):
        a = s.num_computed_tokens
        starts.append(a)
        ids += s.token_ids[a:a + n]
        if sched.spec_tokens:
            ids += sched.spec_tokens[i]  # proposals follow the last token (speculative decoding)
        for group, table in zip(tables, s.block_tables):
            group.append(table)
    return np.array(ids, dtype=np.int64), np.array(starts, dtype=np.int64), np.stack([block_tables(t) for t in tables])


def positions_and_slots(starts: np.ndarray, counts: np.ndarray, tables: np.ndarray, bs: int):
    """Each sequence's query positions [start, start + count), flattened, and their KV slots
    (tables [num_seqs, widest] -> slots [num_tokens]; [num_groups, num_seqs, widest] -> [num_groups, num_tokens])."""
    if len(counts) == int(counts.sum()):  # one token per sequence
        seq_of_token, positions = np.arange(len(counts)), starts
    else:
        seq_of_token = np.repeat(np.arange(len(counts)), counts)
        offsets = np.cumsum(counts) - counts
        positions = starts[seq_of_token] + np.arange(int(counts.sum())) - offsets[seq_of_token]
    slots = tables[..., seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
    return positions, slots


def block_tables(tables) -> np.ndarray:
    """Block tables [num_seqs, widest], padded with -1."""
    return np.array(list(itertools.zip_longest(*tables, fillvalue=-1)), dtype=np.int32).T.copy()


def sample_rows(num_query: np.ndarray, num_sampled: np.ndarray) -> np.ndarray:
    """The flat batch's rows whose logits are sampled: the last num_sampled[i] query rows of each seq."""
    ends = np.cumsum(num_query)
    first = np.repeat(ends - num_sampled, num_sampled)  # per sampled row: its seq's first sampled row
    offset = np.arange(int(num_sampled.sum())) - np.repeat(np.cumsum(num_sampled) - num_sampled, num_sampled)
    return first + offset


def decode_groups(context_lens: np.ndarray, block_size: int, num_groups: int = 4):
    """Split decode rows (sorted longest first) into up to num_groups runs of equal count, each
    with the block-table width its longest row needs."""
    n = len(context_lens)
    if n < 4 * num_groups:
        return ()
    bounds = np.linspace(0, n, num_groups + 1).astype(int)
    return tuple((int(a), int(b), -(-int(context_lens[a]) // block_size)) for a, b in zip(bounds[:-1], bounds[1:]))


def prompt_rows(sched: SchedulerOutput) -> list[tuple[Sequence, int, int, list[int]]]:
    """Per sequence that wants prompt logprobs not yet computed: the rows [a, b) of the step's flat
    batch whose logits score prompt tokens, and those tokens (each row scores the token after it;
    tokens already scored before a preemption are not scored again)."""
    out, row = [], 0
    for seq, n in zip(sched.seqs, sched.num_new_tokens):
        if seq.needs_prompt_logprobs:
            start = seq.num_computed_tokens
            first = max(start + 1, len(seq.prompt_logprobs) + 1)  # prompt token index to score first
            last = min(start + n, seq.num_prompt_tokens - 1)
            if first <= last:
                out.append((seq, row + first - 1 - start, row + last - start, seq.token_ids[first:last + 1]))
        row += n
    return out


def pooling_rows(sched: SchedulerOutput) -> list[PoolRows]:
    """Per pooling sequence in the step: its rows of the flat batch, and whether they complete its prompt."""
    out, row = [], 0
    for seq, n in zip(sched.seqs, sched.num_new_tokens):
        if seq.pooling is not None:
            start = seq.num_computed_tokens
            out.append(PoolRows(seq, row, row + n, start, start + n == seq.num_prompt_tokens))
        row += n
    return out

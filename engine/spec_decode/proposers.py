"""Speculative decoding: proposers guess a few tokens per running sequence; the target model
verifies them all in one forward (each sequence's last token plus its proposals, a multi-token
query over its cached blocks); the acceptance rule keeps the output exactly the target's.

    schedule -> propose (Speculator.propose, Scheduler.add_proposals) -> run (the model scores every
    query position, the sampler draws a token at each) -> accept (accepted_tokens) ->
    Scheduler.update_from_output (appends only accepted tokens; rolls back the rejected ones' slots)
    -> Speculator.observe (metrics, switch-off)

The acceptance rule, and the rows it reads: engine/spec_decode/acceptance.py."""
from dataclasses import dataclass

import numpy as np
import torch

from pagoda.engine.config import SpeculativeConfig
from pagoda.engine.executor.batch import block_tables

PAUSE_STEPS = 16  # most steps a sequence with poor recent acceptance goes without proposals
ACCEPTANCE_DECAY = 0.5  # weight of the history in a sequence's moving acceptance rate


@dataclass
class SpecState:
    """A sequence's recent speculation (Sequence.speculation)."""
    acceptance: float = 1.0  # moving average of accepted / proposed
    paused: int = 0  # steps left without proposals
    # the next pause's length: 2 steps, doubled by each pause up to PAUSE_STEPS, back to 2 once a
    # verification does well (a brief miss, such as an edit in copied text, costs a short pause)
    backoff: int = 2


class NgramProposer:
    """Prompt lookup: the longest suffix of the sequence (prompt_lookup_max tokens down to
    prompt_lookup_min) found earlier in its own text proposes the tokens that followed it there
    (the latest such match that has k tokens after it, else the latest)."""

    def __init__(self, config: SpeculativeConfig):
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        ids = np.asarray(token_ids, dtype=np.int64)
        size = len(ids)
        # ends: where an earlier n-gram equal to the last n tokens ends, for n = 1, 2, ... (one pass over
        # the text for n = 1; each longer n keeps the ends whose token n - 1 back matches too)
        ends, n = np.flatnonzero(ids[:-1] == ids[-1]), 1
        while n < min(self.max_n, size - 1):
            longer = ends[ends >= n]
            longer = longer[ids[longer - n] == ids[size - 1 - n]]
            if not len(longer):
                break
            ends, n = longer, n + 1
        if not len(ends) or n < self.min_n:
            return []
        starts = ends - n + 1
        full = starts[starts + n + k <= size]
        s = int(full[-1] if len(full) else starts[-1]) + n
        return ids[s:s + k].tolist()


class DraftProposer:
    """A smaller model's greedy proposals. The draft is a ModelRunner of its own whose KV cache mirrors
    the target's block for block (as many blocks of the same size; its own layers and heads), so the
    target's block tables and slots serve it: no second allocator, and the target's rollback frees the
    draft's slots too. The draft runs only in steps that speculate, and only for the speculating
    sequences: each first catches up (catch_up: a query over its tokens from seq.draft_computed, the
    draft's KV so far, through its last token), then, once add_proposals has given the proposals
    slots, the draft decodes (fill), feeding each proposal but the last in turn (k forwards in all).
    draft_computed is 0 after a preemption and for a new sequence, also where the target hit the
    prefix cache (blocks the target computed hold draft KV only if some draft step covered them, so
    the draft recomputes them: more work, never poorer proposals), and falls back with the target's
    rollback of rejected proposals (Scheduler._roll_back)."""

    def __init__(self, runner):
        self.runner = runner
        self.first: torch.Tensor | None = None  # [n] the draft's next token per sequence with room (device)
        self.rows: dict[int, int] = {}  # seq_id -> its row in first

    def catch_up(self, sched, rooms: list[int]) -> list[list[int]] | None:
        """The draft over each sequence with room's tokens it has not seen, and its next token after
        them; placeholders of each sequence's room (fill puts the tokens in), None when none has room."""

        speculating = [i for i, room in enumerate(rooms) if room]
        if not speculating:
            return None
        # single-token queries first (the decode path); each query ends with the sequence's last token
        seqs = sorted((sched.seqs[i] for i in speculating), key=lambda s: s.num_tokens - s.draft_computed != 1)
        starts = np.array([s.draft_computed for s in seqs], dtype=np.int64)
        ids = np.array([t for s in seqs for t in s.token_ids[s.draft_computed:]], dtype=np.int64)
        counts = np.array([s.num_tokens for s in seqs], dtype=np.int64) - starts
        self.first = self.runner.draft_catch_up(ids, starts, counts, block_tables([s.block_table for s in seqs]))
        self.rows = {s.seq_id: r for r, s in enumerate(seqs)}
        for s in seqs:
            s.draft_computed = s.num_tokens
        return [[0] * room for room in rooms]

    def fill(self, sched) -> None:
        """The speculating sequences' proposals (as many as add_proposals gave slots): greedy draft steps."""

        order = sorted((i for i, spec in enumerate(sched.spec_tokens) if spec), key=lambda i: -len(sched.spec_tokens[i]))
        if not order:
            return
        seqs = [sched.seqs[i] for i in order]
        lens = np.array([len(sched.spec_tokens[i]) for i in order])  # longest first: step j's rows are a prefix
        tables = block_tables([s.block_table for s in seqs])
        starts = np.array([s.num_tokens for s in seqs], dtype=np.int64)  # the first proposal's position
        rows = torch.tensor([self.rows[s.seq_id] for s in seqs], device=self.first.device)
        steps = [self.first[rows]]  # steps[j]: proposal j + 1 of the sequences that have one
        for j in range(int(lens[0]) - 1):  # feed proposal j + 1 of the sequences that want proposal j + 2
            m = int((lens > j + 1).sum())
            steps.append(self.runner.draft_decode(steps[j][:m], starts[:m] + j, tables[:m]))
        table = torch.full((len(seqs), len(steps)), -1, dtype=torch.int64, device=self.first.device)
        for j, t in enumerate(steps):
            table[:len(t), j] = t
        for i, seq, row, n in zip(order, seqs, table.tolist(), lens):  # the one host-device sync
            sched.spec_tokens[i] = row[:n]
            # every proposal but the last fed (the target's rollback trims the rejected); the last, if
            # accepted, is fed by the next step's catch-up with the target's token after it
            seq.draft_computed += int(n) - 1


class Speculator:
    """The proposals of a step, under the switch-off rules, and the counts of what was accepted."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft_runner=None):
        self.config, self.max_model_len = config, max_model_len
        self.proposer = NgramProposer(config) if draft_runner is None else None
        self.draft = DraftProposer(draft_runner) if draft_runner is not None else None
        self.num_proposed = 0  # proposed tokens verified
        self.num_accepted = 0  # of those, accepted
        self.num_verifications = 0  # sequence-steps that verified proposals

    def stats(self) -> dict:
        """Speculation's part of EngineStats, by name."""
        return dict(spec_proposed_tokens=self.num_proposed, spec_accepted_tokens=self.num_accepted,
                    spec_mean_accepted_length=self.mean_accepted_length)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a sequence gains per verifying step: accepted proposals plus the target's own."""
        return 1 + self.num_accepted / self.num_verifications if self.num_verifications else 0.0

    def propose(self, sched) -> list[list[int]] | None:
        """Per sequence of the step (in its order): the tokens to verify (empty: none); None when the
        step does not speculate. Switch-off: a step running more than disable_by_batch_size sequences
        (its verification would cost more than it saves), and a sequence whose recent acceptance
        rate fell below min_acceptance_rate (for PAUSE_STEPS steps)."""
        rooms = [0] * len(sched.seqs)
        if len(sched.seqs) <= self.config.disable_by_batch_size:
            for i, (seq, n, k) in enumerate(zip(sched.seqs, sched.num_new_tokens, sched.num_sampled)):
                if n == 1 and k == 1:  # the sequence's last token only: its next token is sampled now
                    rooms[i] = self._room(seq)
        if self.draft is not None:  # it runs only in steps that speculate
            return self.draft.catch_up(sched, rooms)
        if not any(rooms):
            return None
        out = [self.proposer.propose(seq.token_ids, room) if room else [] for seq, room in zip(sched.seqs, rooms)]
        return out if any(out) else None

    def fill(self, sched) -> None:
        """After add_proposals: a draft model's tokens into the proposals' slots (n-gram's are in)."""
        if self.draft is not None:
            self.draft.fill(sched)

    def _room(self, seq) -> int:
        """How many tokens seq may have proposed: 0 where its next token's distribution depends on the
        tokens before it in ways the verification does not see (penalties, bad words, min_tokens,
        a grammar), or while paused."""
        p = seq.params
        if seq.matcher is not None or seq.watch is not None or p.needs_penalties or seq.bad_words or seq.num_generated_tokens < p.min_tokens:
            return 0
        state = seq.speculation = seq.speculation or SpecState()
        if state.paused:
            state.paused -= 1
            return 0
        # the bonus token needs room too: at most max_tokens generated, max_model_len in all
        left = min(seq.max_tokens - seq.num_generated_tokens, self.max_model_len - seq.num_tokens) - 1
        return max(0, min(self.config.num_speculative_tokens, left))

    def observe(self, sched, tokens: list[list[int]]) -> None:
        """Count the step's accepted proposals (each speculating row of `tokens` holds the accepted
        proposals plus one token) and update each sequence's moving acceptance rate."""
        if not sched.spec_tokens:
            return
        rows = iter(tokens)
        for seq, k, spec in zip(sched.seqs, sched.num_sampled, sched.spec_tokens):
            row = next(rows) if k else None
            if not spec:
                continue
            accepted = len(row) - 1
            self.num_proposed += len(spec)
            self.num_accepted += accepted
            self.num_verifications += 1
            state, rate = seq.speculation, accepted / len(spec)
            state.acceptance = ACCEPTANCE_DECAY * state.acceptance + (1 - ACCEPTANCE_DECAY) * rate
            if state.acceptance < self.config.min_acceptance_rate:
                state.paused, state.acceptance = state.backoff, 1.0  # then try again
                state.backoff = min(2 * state.backoff, PAUSE_STEPS)
            elif rate >= 0.5:
                state.backoff = 2

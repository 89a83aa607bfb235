"""Continuous batching under a per-step token budget, with chunked prefill and preemption."""
import bisect
import collections
import heapq
import itertools
import time
from dataclasses import dataclass, field

from pagoda.engine.core.block_manager import BlockManager, Hits
from pagoda.engine.core.sequence import Sequence, SequenceStatus
from pagoda.engine.outputs import FinishReason


@dataclass
class SchedulerOutput:
    """What one step runs: the runner reads token ids, positions and block tables from these."""
    seqs: list[Sequence] = field(default_factory=list)  # single-token queries first, then longer
    num_new_tokens: list[int] = field(default_factory=list)  # per seq: tokens it computes this step
    num_sampled: list[int] = field(default_factory=list)  # per seq: query rows whose logits it samples
    # per seq: the proposed tokens it verifies this step (speculative decoding; empty list: none). They
    # follow its last token in the query; they are not in its token_ids until accepted. [] : none at all
    spec_tokens: list[list[int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    start_time: float = 0.0  # time.monotonic() when the step was scheduled

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def sampling_seqs(self) -> list[Sequence]:
        """The sequences that sample, in the step's order (StepResult.tokens has a row for each)."""
        return [s for s, k in zip(self.seqs, self.num_sampled) if k]


def num_to_sample(seq: Sequence, num_new_tokens: int) -> int:
    """1 when the step reaches seq's last token, so it samples the next one; a prompt scored with
    max_tokens 0 samples nothing."""
    return int(seq.num_computed_tokens + num_new_tokens == len(seq.token_ids) and seq.max_tokens > 0)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, structured=None, max_queue_wait_s: float | None = None, adapters=None,
                 long_rope_from: int | None = None, pipeline_depth: int = 1):
        self.block_manager = block_manager
        self.long_rope_from = long_rope_from  # LongRoPE: the length past which a sequence rotates by the long factors
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: list[Sequence] = []  # sorted by sort_key (priority, arrival)
        self.running: list[Sequence] = []  # sorted likewise; the last is the first to preempt
        self.num_preemptions = 0
        self.num_prompt_tokens_seen = 0  # prompt tokens admitted, for the prefix-cache hit rate
        self.num_prompt_tokens_cached = 0  # of those, found in the prefix cache
        self.num_prompt_tokens_processed = 0  # prompt tokens run through the model (recomputes included)
        self.num_generated_tokens = 0
        self.num_pooling_requests = 0  # pooling sequences that got their vector
        self.num_pooling_tokens = 0  # their prompt tokens
        self.structured = structured  # StructuredOutputManager: a constrained sequence's matcher takes each token
        self.max_queue_wait_s = max_queue_wait_s  # a sequence never scheduled this long after arrival is refused
        self.deadlines: list = []  # heap of (time, tiebreak, seq, reason): time limits and queue-wait limits
        self._tiebreak = itertools.count()
        # what the queue-wait estimate (EngineStats.queue_wait_s) is made of
        self.num_waiting_tokens = 0
        self.step_s = 0.0  # seconds per step, a moving average
        self.finish_times: collections.deque = collections.deque(maxlen=64)
        self.adapters = adapters  # engine/lora/adapters.py AdapterSlots: LoRA slots of running sequences (None: no LoRA)
        self.adapter_tokens: dict[str, int] = {}  # LoRA adapter name -> tokens generated (metrics)
        # pipeline parallelism: up to pipeline_depth batches in flight, each over its share of the sequences; a
        # sequence in one (in_flight) is not scheduled again until its tokens are back (update_from_output)
        self.pipeline_depth = pipeline_depth
        self.in_flight: set[Sequence] = set()
        self._batch_seats = 0

    def add(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.WAITING:  # first time: its limits start to count
            if seq.times.deadline is not None:
                heapq.heappush(self.deadlines, (seq.times.deadline, next(self._tiebreak), seq, FinishReason.TIME_LIMIT))
            if self.max_queue_wait_s is not None:
                refuse_at = seq.times.arrival + self.max_queue_wait_s
                heapq.heappush(self.deadlines, (refuse_at, next(self._tiebreak), seq, FinishReason.REFUSED))
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)
        self.num_waiting_tokens += seq.num_tokens

    def expire(self) -> list[Sequence]:
        """Once per step: sequences past their time limit finish (TIME_LIMIT, with what they have, in the
        queue too), and sequences never scheduled within max_queue_wait_s are refused. Returns them."""
        expired, now = [], time.monotonic()
        while self.deadlines and self.deadlines[0][0] <= now:
            _, _, seq, reason = heapq.heappop(self.deadlines)
            if seq.is_finished or (reason is FinishReason.REFUSED and seq.times.first_scheduled is not None):
                continue
            error = None
            if reason is FinishReason.REFUSED:
                error = f"it waited {now - seq.times.arrival:.3g}s in the queue, past this server's --max-queue-wait"
            self.finish(seq, reason, error)
            expired.append(seq)
        if len(self.deadlines) > 64 + 2 * (len(self.waiting) + len(self.running)):  # mostly finished ones: drop them
            self.deadlines = [d for d in self.deadlines if not d[2].is_finished]
            heapq.heapify(self.deadlines)
        return expired

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(start_time=time.monotonic())
        self._batch_seats = -(-(len(self.running) + len(self.waiting)) // self.pipeline_depth)
        if self.long_rope_from is not None:
            self._switch_to_long_rope(out)
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        self._schedule_waiting(out, budget)
        # single-token queries first, longest context first (lets attention group similar lengths)
        keys = [(n != 1, -len(s.token_ids)) for s, n in zip(out.seqs, out.num_new_tokens)]
        order = sorted(range(len(keys)), key=keys.__getitem__)
        out.seqs = [out.seqs[i] for i in order]
        out.num_new_tokens = [out.num_new_tokens[i] for i in order]
        out.num_sampled = [num_to_sample(s, n) for s, n in zip(out.seqs, out.num_new_tokens)]
        if self.pipeline_depth > 1:
            self.in_flight.update(out.seqs)
        return out

    def add_proposals(self, out: SchedulerOutput, proposals: list[list[int]]) -> None:
        """Speculative decoding: each sequence's proposed tokens (aligned with out.seqs) join its query
        as far as the step's token budget and the free blocks allow (a guess never preempts anything);
        every query row is sampled. Single-token queries stay first."""
        budget = self.max_num_batched_tokens - out.num_tokens
        out.spec_tokens = [[] for _ in out.seqs]
        for i, (seq, spec) in enumerate(zip(out.seqs, proposals)):
            spec = spec[:max(0, budget)]
            while spec and not self.block_manager.can_append(seq, seq.num_tokens + len(spec)):
                spec = spec[:-1]
            if spec:
                self.block_manager.append(seq, seq.num_tokens + len(spec))
                out.num_new_tokens[i] += len(spec)
                out.num_sampled[i] += len(spec)
                out.spec_tokens[i] = spec
                budget -= len(spec)
        order = sorted(range(len(out.seqs)), key=lambda i: out.num_new_tokens[i] != 1)  # stable
        for name in ("seqs", "num_new_tokens", "num_sampled", "spec_tokens"):
            setattr(out, name, [getattr(out, name)[i] for i in order])

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0 and len(out.seqs) < self._batch_seats:
            seq = self.running[i]
            if seq in self.in_flight:
                i += 1
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            n = max(1, self.block_manager.num_fitting(seq, seq.num_computed_tokens, n))
            while not self.block_manager.can_append(seq, seq.num_computed_tokens + n):
                # the newest (lowest priority) running sequence not in flight (seq at worst)
                victim = next(s for s in reversed(self.running) if s not in self.in_flight)
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                self.block_manager.append(seq, seq.num_computed_tokens + n)
                out.seqs.append(seq)
                out.num_new_tokens.append(n)
                budget -= n
                i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        # Strict order: if the head does not fit, nothing behind it jumps the queue. Except for LoRA
        # (vLLM's rule): a sequence whose adapter finds no free slot waits, and those behind it pass it.
        i = 0
        while (i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs
               and len(out.seqs) < self._batch_seats):
            seq = self.waiting[i]
            if seq.needs_every_prompt_row:  # no cached prefix: its rows are not computed
                hits = Hits()
            else:
                hits = self.block_manager.match_prefix(seq)
                if self.block_manager.prefix_in_flight(seq, hits):
                    break  # its prefix is being computed: next step it is a cache hit
            cached = len(hits) * self.block_manager.block_size
            n = self.block_manager.num_fitting(seq, cached, min(seq.num_tokens - cached, budget), hits)
            if n == 0 or not self.block_manager.can_allocate(seq, cached + n, hits):
                break
            if seq.adapter is not None and not self.adapters.acquire(seq):
                i += 1
                continue
            self.block_manager.allocate(seq, cached + n, hits)
            seq.num_computed_tokens = cached
            if seq.status is SequenceStatus.WAITING:  # first admission, not a recompute
                seq.times.first_scheduled = time.monotonic()
                seq.num_cached_tokens = min(cached, seq.num_prompt_tokens)
                self.num_prompt_tokens_seen += seq.num_prompt_tokens
                self.num_prompt_tokens_cached += seq.num_cached_tokens
            self.waiting.pop(i)
            self.num_waiting_tokens -= seq.num_tokens
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.sort_key)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= n

    def _switch_to_long_rope(self, out: SchedulerOutput) -> None:
        """LongRoPE: a sequence longer than long_from rotates every token by the long factors, so one that grew
        past it has its KV recomputed (as transformers' Phi-3 recomputes its cache there); its prefix-cache
        blocks are the long factors' own from then on."""
        for seq in [s for s in self.running if s.num_tokens > self.long_rope_from and not s.long_rope
                    and s not in self.in_flight]:
            self._preempt(seq, out, recompute_only=True)
        for seq in self.waiting:
            if seq.num_tokens > self.long_rope_from and not seq.long_rope:
                seq.long_rope, seq.hash_seed, seq.block_hashes = True, ("longrope", seq.hash_seed), []

    def _preempt(self, seq: Sequence, out: SchedulerOutput, recompute_only: bool = False) -> None:
        """Free seq's blocks to recompute it later (recompute_only: not for want of blocks, not counted)."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        if seq.lora_slot >= 0:
            self.adapters.release(seq)
        seq.num_computed_tokens = seq.draft_computed = 0
        seq.pool_state = None  # pooled again from the first row
        seq.status = SequenceStatus.PREEMPTED
        if not recompute_only:
            seq.times.preemptions.append(time.monotonic())
            self.num_preemptions += 1
        out.preempted.append(seq)
        self.add(seq)

    def update_from_output(self, out: SchedulerOutput, tokens: list[list[int]]) -> list[Sequence]:
        """Advance computed counts, append each sampling seq's new tokens (a list per seq, in order),
        finish sequences that stop. Returns the sequences that got tokens or finished."""
        changed, rows, now = [], iter(tokens), time.monotonic()
        self.step_s += 0.2 * (now - out.start_time - self.step_s)
        specs = out.spec_tokens or [()] * len(out.seqs)
        for seq, n, k, spec in zip(out.seqs, out.num_new_tokens, out.num_sampled, specs):
            self.in_flight.discard(seq)
            if seq.is_finished:  # while its batch was in flight (pipeline parallelism): aborted, expired
                if k:
                    next(rows)  # its tokens dropped
                continue
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.num_prompt_tokens_processed += n
                seq.times.prefill_chunks.append((out.start_time, now, n))
            seq.num_computed_tokens += n - len(spec)  # proposals count once accepted
            self.block_manager.register_full_blocks(seq)
            if k:
                self._append(seq, next(rows))
                if spec and not seq.is_finished:
                    self._roll_back(seq)
                changed.append(seq)
            elif seq.max_tokens == 0 and seq.num_computed_tokens == seq.num_tokens:  # a prompt scored, or pooled
                self.finish(seq, FinishReason.LENGTH)
                changed.append(seq)
                if seq.pooling is not None:
                    self.num_pooling_requests += 1
                    self.num_pooling_tokens += seq.num_prompt_tokens
        return changed

    def _roll_back(self, seq: Sequence) -> None:
        """After a verification: the accepted proposals' KV is valid (all but the new last token are
        computed); the slots of the rejected ones are given back. Only verified tokens reach the
        prefix cache. A draft model's KV of the rejected ones is dropped too."""
        seq.num_computed_tokens = seq.num_tokens - 1
        seq.draft_computed = min(seq.draft_computed, seq.num_computed_tokens)
        self.block_manager.trim(seq, seq.num_tokens)
        self.block_manager.register_full_blocks(seq)

    def _append(self, seq: Sequence, tokens: list[int]) -> None:
        """Append tokens one by one; the first that stops the sequence is its last (the rest are dropped)."""
        if seq.times.first_token is None:
            seq.times.first_token = time.monotonic()
        for token in tokens:
            seq.token_ids.append(token)
            self.num_generated_tokens += 1
            if seq.adapter is not None:
                self.adapter_tokens[seq.adapter] = self.adapter_tokens.get(seq.adapter, 0) + 1
            reason, error = check_stop(seq, self.max_model_len), None
            if reason is None and seq.matcher is not None:
                reason, error = self.structured.accept(seq, token)
            elif reason is None and seq.watch is not None:  # a lazy grammar: does this token trigger it?
                reason, error = self.structured.watch(seq, token)
            if reason is not None:
                self.finish(seq, reason, error)
                return

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """The one place a sequence finishes: out of the queues, its blocks freed; `error` says why
        when reason is ERROR."""
        if seq.is_finished:
            return
        self.in_flight.discard(seq)
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self.num_waiting_tokens -= seq.num_tokens
        self.block_manager.free(seq)
        if seq.lora_slot >= 0:
            self.adapters.release(seq)
        seq.pool_state = None
        seq.times.finished = time.monotonic()
        self.finish_times.append(seq.times.finished)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error


def scheduler_stats(s: Scheduler, now: float) -> dict:
    """The scheduler's part of EngineStats, by name."""
    seen = s.num_prompt_tokens_seen
    return dict(num_running=len(s.running), num_prompt_tokens_processed=s.num_prompt_tokens_processed,
                num_generated_tokens=s.num_generated_tokens, num_preemptions=s.num_preemptions,
                num_cached_prompt_tokens=s.num_prompt_tokens_cached,
                prefix_cache_hit_rate=s.num_prompt_tokens_cached / seen if seen else 0.0,
                num_waiting_tokens=s.num_waiting_tokens, num_free_seats=max(0, s.max_num_seqs - len(s.running)),
                step_token_budget=s.max_num_batched_tokens, step_s=s.step_s,
                finished_per_s=finished_per_s(s.finish_times, now), adapter_tokens=dict(s.adapter_tokens),
                num_pooling_requests=s.num_pooling_requests, num_pooling_tokens=s.num_pooling_tokens)


def finished_per_s(finish_times, now: float) -> float:
    """Sequences finished per second over the last len(finish_times) finishes, up to now."""
    return len(finish_times) / (now - finish_times[0]) if finish_times and now > finish_times[0] else 0.0


def check_stop(seq: Sequence, max_model_len: int) -> FinishReason | None:
    """Whether seq's last token stops it: token-level stops plus stop strings (through the sequence's
    detokenizer, which takes the token here)."""
    params, token, detokenizer = seq.params, seq.token_ids[-1], seq.detokenizer
    if detokenizer is not None:
        detokenizer.append(token)
    num_tokens = len(seq.token_ids)
    num_generated = num_tokens - seq.num_prompt_tokens
    if num_generated >= params.min_tokens:
        if not params.ignore_eos and token in seq.eos_token_ids:
            return FinishReason.EOS
        if token in params.stop_token_ids:
            return FinishReason.STOP_TOKEN
        if params.stop and detokenizer is not None and detokenizer.find_stop(params.stop,
                                                                            params.include_stop_str_in_output):
            return FinishReason.STOP_STRING
    if num_generated >= seq.max_tokens or num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None

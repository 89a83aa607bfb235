"""The asyncio front: the engine loop runs in its own thread; each request gets an asyncio
queue of deltas. add/abort cross into the loop through an inbox; outputs cross back with
one call_soon_threadsafe per event loop per step."""
import asyncio
import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator

from engine.config import EngineConfig
from engine.errors import EngineClosedError, EngineError, InvalidRequestError, QueueFullError
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason, Sequence

log = logging.getLogger("pagoda.engine")
_ids = itertools.count()


class EngineFront:
    """What both asyncio fronts share: the tokenizer's helpers, the stats snapshot, and the
    per-request queues each step's outputs are routed to. A subclass sets config, tokenizer,
    _stats and _started, and holds its own lock around _admit, _settle and _close_queues."""

    def _init_requests(self) -> None:
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._unfinished: dict[str, int] = {}  # request id -> its sequences not yet delivered finished
        self._num_pending = 0  # sequences added but not yet taken in by the engine loop
        self._closed = False

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def stats(self):
        """The snapshot taken after the latest step (uptime read now)."""
        return dataclasses.replace(self._stats, uptime_s=time.monotonic() - self._started)

    def _admit(self, request_id: str, num_seqs: int) -> asyncio.Queue:
        """A new request's queue, or QueueFullError / InvalidRequestError (a request id in flight)."""
        if self._num_queued() >= self.config.max_queue_len:
            raise QueueFullError(f"the waiting queue is full ({self.config.max_queue_len} requests); retry later")
        if request_id in self._queues:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in flight")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = (asyncio.get_running_loop(), queue)
        self._unfinished[request_id] = num_seqs
        self._num_pending += num_seqs
        return queue

    def _num_queued(self) -> int:
        """Sequences waiting to be scheduled, those not yet taken in by the engine loop included."""
        raise NotImplementedError

    def _settle(self, request_id: str, out) -> tuple | None:
        """Book one output (a delta or the exception that ended the request) against its request;
        returns (event loop, queue) to hand it to, or None when the request is gone."""
        entry = self._queues.get(request_id)
        if entry is None:
            return None
        if isinstance(out, BaseException):
            self._drop(request_id)
        elif out.finished:
            self._unfinished[request_id] -= 1
            if not self._unfinished[request_id]:  # the whole request is done
                self._drop(request_id)
        return entry

    def _drop(self, request_id: str) -> None:
        del self._queues[request_id]
        del self._unfinished[request_id]

    def _close_queues(self, error: BaseException) -> list:
        """Every request still in flight gets `error`: the outbox entries for hand_over."""
        outbox = [(loop, queue, error) for loop, queue in self._queues.values()]
        self._queues.clear()
        self._unfinished.clear()
        return outbox


class AsyncEngine(EngineFront):
    def __init__(self, config: EngineConfig):
        self.engine = LLMEngine(config)
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self.model_info = self.engine.model_info()
        self._cv = threading.Condition()
        self._inbox: list[tuple[str, object]] = []
        self._outbox: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue, object]] = []
        self._init_requests()
        self._thread = threading.Thread(target=self._loop, name="pagoda-engine", daemon=True)
        self._stats = self.engine.stats()
        self._started = self.engine.started

    def start(self) -> None:
        self._thread.start()

    # ---- requests ----

    async def generate(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yields deltas; with n > 1 each carries the index of its completion, and the stream
        ends when all n have finished."""
        if self._closed:
            raise EngineClosedError("the engine is shut down")
        request_id = request_id or f"req-{next(_ids)}"
        seqs = self.engine.make_sequences(prompt, params, request_id, priority)  # raises InvalidRequestError
        with self._cv:
            queue = self._admit(request_id, len(seqs))
            self._inbox.append(("add", seqs))
            self._cv.notify()
        async with contextlib.aclosing(consume(queue, len(seqs), lambda: self.abort(request_id))) as outs:
            async for out in outs:  # closing this generator closes consume(), which aborts
                yield out

    def abort(self, request_id: str) -> None:
        with self._cv:
            self._inbox.append(("abort", request_id))
            self._cv.notify()

    def shutdown(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        hand_over(self._close_queues(EngineClosedError("the engine shut down")))

    # ---- the loop thread ----

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._inbox and not self.engine.has_work() and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                # Applied under the lock, so that admission always sees a request in exactly one
                # of the inbox and the scheduler's waiting list.
                for kind, item in self._inbox:
                    self._apply(kind, item)
                self._inbox.clear()
                self._num_pending = 0
            try:
                updated = self.engine.step()
            except Exception:  # a bug outside the model run; never let the loop die
                log.exception("engine step crashed")
                updated = fail_all(self.engine)
            self._stats = self.engine.stats()
            for seq in updated:
                self._deliver(seq)
            outbox, self._outbox = self._outbox, []
            hand_over(outbox)

    def _num_queued(self) -> int:
        # Read live, not from the step's snapshot: requests the current step has just scheduled
        # no longer count, however long its model run takes.
        return len(self.engine.scheduler.waiting) + self._num_pending

    def _apply(self, kind: str, item) -> None:
        if kind == "add":
            for seq in item:
                seq.num_text_sent = seq.num_tokens_sent = 0
            try:
                self.engine.add_sequences(item)
            except Exception as e:
                self._post(item[0].request_id, e)
            return
        for seq in self.engine.abort(item):
            self._deliver(seq)

    def _deliver(self, seq: Sequence) -> None:
        if seq.request_id in self._queues:
            self._post(seq.request_id, outcome(seq))

    def _post(self, request_id: str, out) -> None:
        entry = self._settle(request_id, out)
        if entry is not None:
            self._outbox.append((*entry, out))


# ---- shared with the engine process (engine/engine_process.py) ----

async def consume(queue: asyncio.Queue, unfinished: int, abort) -> AsyncIterator[RequestOutput]:
    """A request's deltas from its queue until its `unfinished` sequences have finished; an
    exception in the queue is raised. Leaving early calls abort()."""
    held = None
    try:
        while unfinished:
            out, held = (held, None) if held is not None else (await queue.get(), None)
            # a consumer that fell behind the engine gets what piled up as one delta
            while not isinstance(out, BaseException) and not out.finished and not queue.empty():
                nxt = queue.get_nowait()
                if isinstance(nxt, BaseException) or nxt.index != out.index:
                    held = nxt
                    break
                out = _merge(out, nxt)
            if isinstance(out, BaseException):
                raise out
            unfinished -= out.finished
            yield out
    finally:
        if unfinished:
            abort()


def fail_all(engine: LLMEngine) -> list[Sequence]:
    """After a step crashed outside the model run: finish every request in flight with an error."""
    seqs = [s for group in engine.requests.values() for s in group if not s.is_finished]
    for seq in seqs:
        engine.scheduler.finish(seq, FinishReason.ERROR)
        seq.error = "internal engine error"
    engine.requests.clear()
    return seqs


def outcome(seq: Sequence) -> RequestOutput | EngineError:
    """What a sequence's consumer gets after a step: its delta, or the error that ended it."""
    if seq.finish_reason is FinishReason.ERROR:
        return EngineError(f"request {seq.request_id} failed: {seq.error}")
    return _delta(seq)


def _delta(seq: Sequence) -> RequestOutput:
    """What is new since the last delivery. Text that may yet turn into a stop string is held."""
    text = seq.detokenizer.text
    end = len(text) if seq.is_finished else sendable_end(len(text), seq.num_text_sent, seq.params.stop)
    reason = seq.finish_reason
    out = RequestOutput(
        request_id=seq.request_id, index=seq.index, token_ids=seq.generated_token_ids[seq.num_tokens_sent:],
        text=text[seq.num_text_sent:end], finished=seq.is_finished,
        finish_reason=reason.public if reason else None, stop_reason=reason.value if reason else None,
        num_prompt_tokens=seq.num_prompt_tokens, num_generated_tokens=seq.num_generated_tokens,
        num_cached_tokens=seq.num_cached_tokens, metrics=seq.metrics(),
        logprobs=seq.logprobs[seq.num_tokens_sent:seq.num_generated_tokens] if seq.params.logprobs else None)
    seq.num_text_sent, seq.num_tokens_sent = end, seq.num_generated_tokens
    return out


def sendable_end(length: int, num_sent: int, stop: list[str]) -> int:
    """How much of an unfinished stream's text can go out: all but what may yet be the start of a
    stop string (never less than what was already sent)."""
    return max(num_sent, length - max(map(len, stop), default=1) + 1)


def _merge(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive deltas of one completion as one: b's cumulative counts and state."""
    logprobs = None if a.logprobs is None and b.logprobs is None else (a.logprobs or []) + (b.logprobs or [])
    return dataclasses.replace(b, token_ids=a.token_ids + b.token_ids, text=a.text + b.text, logprobs=logprobs)


def hand_over(outbox) -> None:
    """Hand (event loop, queue, item) outputs to their event loops: one wake-up per loop, not per request."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for loop, queue, item in outbox:
        by_loop.setdefault(loop, []).append((queue, item))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # that event loop is closed
            pass


def _put_all(items) -> None:
    for queue, item in items:
        queue.put_nowait(item)

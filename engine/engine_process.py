"""AsyncEngine's interface with the engine loop in a child process.

In one process the server's event loop and the engine loop share a GIL: every streamed message's
Python runs between the engine's steps and slows them (measured: a thread busy with Python 25% of
the time made offline generation 19% slower; another process busy 100% cost nothing). Here the
child owns the model and steps it; the parent keeps the tokenizer (Tokenize, chat templates), the
per-request queues, and a receiver thread that hands each step's deltas to the event loops.

The child reports token ids, not text: the parent detokenizes each stream (as vLLM's front-end
process does), which keeps a decode per token and per stream out of the engine's loop. Only a
sequence that stopped at a stop string, which the child has to decode to find, comes with the
length its text was cut to.

Messages over one duplex pipe (pickled):
  parent -> child: ("add", request_id, prompt, params, priority) | ("abort", request_id) | ("shutdown",)
  child -> parent: ("ready", config, model_info, stats, started, tokenizer) | ("error", exception)
                   ("queued", num_waiting, num_taken) | ("step", [(request_id, record | exception)], stats)
                   | ("closed",)
A record is one sequence's news since its last one (see _record).
"queued" comes once the child's step has scheduled, when it took in new requests: the waiting
list then, and how many sequences it took in; the parent's queue limit counts those two numbers.
"""
import contextlib
import itertools
import logging
import multiprocessing
import pickle
import signal
import threading
from collections.abc import AsyncIterator

from engine.async_engine import EngineFront, consume, fail_all, hand_over, sendable_end
from engine.config import EngineConfig
from engine.detokenizer import CONTEXT_TOKENS, IncrementalDetokenizer
from engine.errors import EngineClosedError, EngineError, InvalidRequestError
from engine.outputs import RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason, Sequence

log = logging.getLogger("pagoda.engine")
_ids = itertools.count()


class ProcessEngine(EngineFront):
    def __init__(self, config: EngineConfig):
        """Starts the child and waits until it has loaded the model (raising what it raised if not)."""
        ctx = multiprocessing.get_context("spawn")  # fork is unsafe with gRPC's and torch's threads
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=_child_main, args=(config, child_conn), name="pagoda-engine", daemon=True)
        self._proc.start()
        child_conn.close()
        try:
            msg = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise RuntimeError(f"the engine process exited while loading (exit code {self._proc.exitcode})")
        if msg[0] == "error":
            self._proc.join(30)
            raise msg[1]
        _, self.config, self.model_info, self._stats, self._started, self.tokenizer = msg
        self._lock = threading.Lock()  # the pipe's send side and the request tables
        self._init_requests()
        self._texts: dict[str, tuple[list[str], dict]] = {}  # request id -> (stop strings, {index: _Text})
        self._num_waiting = self._stats.num_waiting  # the child's, as it last reported it
        self._receiver = threading.Thread(target=self._receive, name="pagoda-engine-receiver", daemon=True)

    def start(self) -> None:
        self._receiver.start()

    async def generate(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """As AsyncEngine.generate; a request the engine refuses raises InvalidRequestError on the
        first iteration."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling_params", f"expected SamplingParams, got {type(params).__name__}")
        request_id = request_id or f"req-{next(_ids)}"
        with self._lock:
            if self._closed:
                raise EngineClosedError("the engine is shut down")
            queue = self._admit(request_id, params.n)
            self._texts[request_id] = (list(params.stop), {})
            self._send(("add", request_id, prompt, params, priority))
        async with contextlib.aclosing(consume(queue, params.n, lambda: self.abort(request_id))) as outs:
            async for out in outs:  # closing this generator closes consume(), which aborts
                yield out

    def abort(self, request_id: str) -> None:
        with self._lock:
            if not self._closed:
                self._send(("abort", request_id))

    def shutdown(self) -> None:
        with self._lock:
            closing, self._closed = not self._closed, True
            if closing:
                self._send(("shutdown",))
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._fail_pending(EngineClosedError("the engine shut down"))

    # ---- parent side ----

    def _send(self, msg) -> None:  # under self._lock
        try:
            self._conn.send(msg)
        except (OSError, ValueError):  # the child is gone; the receiver reports it
            pass

    def _num_queued(self) -> int:
        # The child's waiting list as it last reported it (after a step's scheduling, or after
        # the step), plus the requests sent to it since.
        return self._num_waiting + self._num_pending

    def _receive(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                with self._lock:
                    died = not self._closed
                    self._closed = True
                if died:
                    self._proc.join(5)
                    log.error("the engine process exited (code %s)", self._proc.exitcode)
                    self._fail_pending(EngineError(f"the engine process exited (code {self._proc.exitcode})"))
                return
            if msg[0] == "closed":
                return
            if msg[0] == "queued":
                with self._lock:
                    self._num_waiting, taken = msg[1], msg[2]
                    self._num_pending -= taken
                continue
            _, items, self._stats = msg
            items = [(request_id, self._output(request_id, rec)) for request_id, rec in items]
            with self._lock:
                self._num_waiting = self._stats.num_waiting
                outbox = [(*entry, out) for request_id, out in items
                          if (entry := self._settle(request_id, out)) is not None]
            hand_over(outbox)

    def _output(self, request_id: str, rec):
        """A child's record as the RequestOutput delta the stream gets (an exception passes through)."""
        entry = self._texts.get(request_id)
        if isinstance(rec, BaseException) or entry is None:  # None: the request is gone
            return rec
        index, token_ids, reason, cut, prompt_tail, counts, metrics, logprobs = rec
        stop, texts = entry
        text = texts.get(index)
        if text is None:
            text = texts[index] = _Text(self.tokenizer, prompt_tail, stop)
        reason = FinishReason(reason) if reason is not None else None
        return RequestOutput(
            request_id=request_id, index=index, token_ids=token_ids, text=text.delta(token_ids, reason, cut),
            finished=reason is not None, finish_reason=reason.public if reason else None,
            stop_reason=reason.value if reason else None, num_prompt_tokens=counts[0],
            num_generated_tokens=counts[1], num_cached_tokens=counts[2], metrics=RequestMetrics(*metrics),
            logprobs=logprobs)

    def _drop(self, request_id: str) -> None:
        super()._drop(request_id)
        self._texts.pop(request_id, None)

    def _close_queues(self, error: BaseException) -> list:
        self._texts.clear()
        return super()._close_queues(error)

    def _fail_pending(self, error: BaseException) -> None:
        with self._lock:
            outbox = self._close_queues(error)
        hand_over(outbox)


class _Text:
    """One stream's text, decoded in the parent from the token ids the child reports, with the
    engine's rules: text that may yet become a stop string is held back, a finished sequence's
    held-back characters are flushed, and a stop string cuts the text where the child found it."""

    def __init__(self, tokenizer, prompt_tail: list[int], stop: list[str]):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_tail)
        self.stop = stop
        self.num_sent = 0

    def delta(self, token_ids: list[int], reason: FinishReason | None, cut: int | None) -> str:
        for t in token_ids:
            self.detokenizer.append(t)
        if reason in _FLUSHED:
            self.detokenizer.flush()
        text = self.detokenizer.text
        end = len(text) if cut is None else cut
        if reason is None:
            end = sendable_end(end, self.num_sent, self.stop)
        out, self.num_sent = text[self.num_sent:end], end
        return out


# the engine flushes a sequence's detokenizer when it finishes, unless at a stop string or aborted
_FLUSHED = (FinishReason.LENGTH, FinishReason.EOS, FinishReason.STOP_TOKEN)


# ---- the child ----

def _child_main(config: EngineConfig, conn) -> None:
    # Ctrl-C (and a service manager's SIGTERM) reach the whole process group: the parent drains and
    # then shuts the child down; a parent that dies closes the pipe, which ends the child too
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine(config)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", e if _picklable(e) else RuntimeError(f"{type(e).__name__}: {e}")))
        return
    conn.send(("ready", engine.config, engine.model_info(), engine.stats(), engine.started, engine.tokenizer))
    try:
        _child_loop(engine, conn)
    except (EOFError, OSError, BrokenPipeError):
        pass  # the parent is gone


def _child_loop(engine, conn) -> None:
    while True:
        if not engine.has_work():
            conn.poll(None)  # idle: sleep until a command comes
        items, num_added = [], 0
        while conn.poll(0):
            cmd = conn.recv()
            if cmd[0] == "shutdown":
                conn.send(("closed",))
                return
            if cmd[0] == "add":
                num_added += cmd[3].n
                items += _add(engine, *cmd[1:])
            else:
                items += [(s.request_id, _record(s)) for s in engine.abort(cmd[1])]
        reported = False

        def report_queue():
            # Requests taken in are now counted in the scheduler's waiting list, and those this
            # step admitted no longer are: the parent's queue limit sees that before the model runs.
            nonlocal reported
            if num_added and not reported:
                reported = True
                conn.send(("queued", len(engine.scheduler.waiting), num_added))

        try:
            updated = engine.step(report_queue) if engine.has_work() else []
        except Exception:  # a bug outside the model run; never let the loop die
            log.exception("engine step crashed")
            updated = fail_all(engine)
        report_queue()
        items += [(s.request_id, _record(s)) for s in updated]
        conn.send(("step", items, engine.stats()))


def _record(seq: Sequence):
    """What the parent needs for a sequence's delta (an EngineError if it failed): (index, new token
    ids, finish reason value or None, the length its text was cut to at a stop string or None, the
    prompt's last tokens (context for the parent's detokenizer; first record only), (num_prompt,
    num_generated, num_cached) tokens, metrics (arrival, first scheduled, first token), new logprobs)."""
    reason = seq.finish_reason
    if reason is FinishReason.ERROR:
        return EngineError(f"request {seq.request_id} failed: {seq.error}")
    sent, num_generated, p = seq.num_tokens_sent, seq.num_generated_tokens, seq.num_prompt_tokens
    seq.num_tokens_sent = num_generated
    m = seq.metrics()
    return (seq.index, seq.token_ids[p + sent:], reason.value if reason else None,
            len(seq.detokenizer.text) if reason is FinishReason.STOP_STRING else None,
            seq.token_ids[max(0, p - CONTEXT_TOKENS):p] if sent == 0 else None,
            (p, num_generated, seq.num_cached_tokens), (m.arrival_time, m.first_scheduled_time, m.first_token_time),
            seq.logprobs[sent:num_generated] if seq.params.logprobs else None)


def _add(engine, request_id, prompt, params, priority) -> list:
    try:
        seqs = engine.make_sequences(prompt, params, request_id, priority)
        engine.add_sequences(seqs)
    except Exception as e:  # InvalidRequestError naming the field, mostly
        return [(request_id, e if _picklable(e) else EngineError(f"{type(e).__name__}: {e}"))]
    for seq in seqs:
        seq.num_tokens_sent = 0
    return []


def _picklable(e: BaseException) -> bool:
    try:
        pickle.loads(pickle.dumps(e))
    except Exception:  # noqa: BLE001
        return False
    return True

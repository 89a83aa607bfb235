"""The asyncio front-end: one API (make_request, generate, abort, stats, shutdown) over either
transport to the engine core (engine/frontend/transport.py: a thread of this process, or a child process;
EngineConfig.engine_process chooses). It checks and tokenizes requests (engine/validation.py),
owns request ids and the queue limit, and routes each step's outputs (made in the core,
engine/core/core_outputs.py) to per-request asyncio queues, with one wake-up per event loop per step.
A caller takes them as deltas (generate, open), or as whole completions: a request made with
stream=False (the core's whole-output mode), or deltas folded by whole_outputs (one output per
completion, with its finish reason, counts and logprobs final)."""
import asyncio
import contextlib
import dataclasses
import functools
import itertools
import threading
import time
from collections.abc import AsyncIterator

from pagoda.engine.config import EngineConfig
from pagoda.engine.core.core_io import Abort, AdapterCommand, AdapterResult, CoreFailed, EngineRequest, Queued, StepReport
from pagoda.engine.errors import (AdapterLoadError, AdapterNotFoundError, DuplicateRequestError, EngineClosedError,
                                 EngineError, InvalidRequestError, QueueFullError, QueueWaitError)
from pagoda.engine.outputs import RequestOutput, merge
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.structured.manager import GrammarCompiler
from pagoda.engine.inputs import chat_prompt_ids, make_request
from pagoda.engine.lora import usable
from pagoda.engine.validation import DEFAULT_LIMITS, ModelLimits, RequestLimits


class AsyncEngine:
    def __init__(self, config: EngineConfig):
        """Loads the model (in this thread, or in the child process, waiting for it)."""
        from pagoda.engine.frontend.transport import ProcessTransport, ThreadTransport

        self._transport = (ProcessTransport if config.engine_process else ThreadTransport)(config)
        ready = self._transport.ready
        self.config, self.model_info, self.tokenizer = ready.config, ready.model_info, ready.tokenizer
        self._model = ModelLimits.of(self.model_info)
        # an in-thread core shares its compiler: the matcher a request's check built is the one it copies
        core = getattr(self._transport, "core", None)
        self.grammars = core.grammars if core is not None else GrammarCompiler(
            self.tokenizer, self.model_info.vocab_size, self.model_info.eos_token_ids)
        self._stats, self._started = ready.stats, ready.started
        self._lock = threading.Lock()  # the request tables, from the event loops and the report thread
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._unfinished: dict[str, int] = {}  # request id -> its sequences not yet delivered finished
        self._num_pending = 0  # sequences sent to the core and not yet taken in by it
        self._num_waiting = self._stats.num_waiting  # the core's waiting list, as last reported
        self._closed = False  # no new requests
        self._transport_open = True
        self.on_failure = None  # called with the error, from a worker thread, if the core dies
        # LoRA adapters: those loaded (as last reported), those being unloaded, the commands in flight
        self.adapters = {a.name: a for a in self.model_info.adapters}
        self._unloading: set[str] = set()
        self._adapter_calls: dict[int, tuple] = {}
        self._adapter_tokens = itertools.count(1)

    def start(self) -> None:
        self._transport.start(self._on_report)

    # ---- LoRA adapters (engine/lora/adapters.py) ----

    def check_adapter(self, name: str | None) -> None:
        """AdapterNotFoundError unless `name` (None: the base model) is loaded and not being unloaded."""
        if not usable(name, self.adapters, self._unloading):  # the core's rule, over what it reported
            raise AdapterNotFoundError(name)

    async def load_adapter(self, name: str, path: str) -> None:
        """Load a PEFT adapter directory under `name` (ValueError naming what is wrong)."""
        await self._adapter_call(AdapterCommand(next(self._adapter_tokens), "load", name, path))

    async def unload_adapter(self, name: str) -> None:
        """Unload an adapter: new requests for it are refused at once; returns once its requests in
        flight have finished and it is gone."""
        self.check_adapter(name)
        self._unloading.add(name)
        try:
            await self._adapter_call(AdapterCommand(next(self._adapter_tokens), "unload", name))
        finally:
            self._unloading.discard(name)

    async def _adapter_call(self, cmd: AdapterCommand) -> None:
        if not self.config.enable_lora:
            raise AdapterLoadError("LoRA adapters are not enabled on this server "
                                   "(--lora-modules / --allow-lora-loading)")
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            if self._closed:
                raise EngineClosedError("the engine is shut down")
            self._adapter_calls[cmd.token] = (asyncio.get_running_loop(), future)
        self._transport.send(cmd)
        try:
            await future
        except InvalidRequestError:
            raise
        except ValueError as e:
            raise AdapterLoadError(str(e)) from None

    # ---- requests ----

    def make_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                     priority: int = 0, *, limits: RequestLimits = DEFAULT_LIMITS,
                     default_max_tokens: int | None = None, stream: bool = True) -> EngineRequest:
        """A prompt (text or token ids) and its params, checked against the model and tokenized;
        raises InvalidRequestError naming the field. stream=False: the core sends each completion
        once, whole, when it finishes (vLLM's RequestOutputKind.FINAL_ONLY). Tokenizing a long text
        takes a while: callers on an event loop may run this in a thread and hand the result to
        generate()."""
        return make_request(prompt, params, model=self._model, tokenizer=self.tokenizer, request_id=request_id,
                            priority=priority, limits=limits, default_max_tokens=default_max_tokens,
                            stream=stream, grammars=self.grammars)

    async def generate(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yields what is new for the request after each step; with n > 1 each output carries the
        index of its completion, and the stream ends when all n have finished. `prompt` may be an
        EngineRequest from make_request. Refusals (InvalidRequestError, DuplicateRequestError,
        QueueFullError, EngineClosedError) come on the first iteration; a failed step raises
        EngineError. Leaving the iteration early aborts the request."""
        req = prompt if isinstance(prompt, EngineRequest) else self.make_request(prompt, params, request_id, priority)
        async with contextlib.aclosing(self.open(req)) as outs:
            async for out in outs:  # closing this generator closes consume(), which aborts
                yield out

    def open(self, req: EngineRequest) -> AsyncIterator[RequestOutput]:
        """generate() for a checked request, admitted now: refusals raise here, before any output is
        awaited (a protocol that must answer a refusal with its own status uses this). The iterator
        must be run to its end or closed (aclose), which aborts the request."""
        queue = self._admit(req)
        return consume(req.request_id, queue, req.params.n, lambda: self.abort(req.request_id))

    def abort(self, request_id: str, error: BaseException | None = None) -> None:
        """Ends the request in the core (its KV blocks freed on the next step). With `error`, its stream
        raises that at once, even while a step runs, and gets nothing more (a time limit)."""
        if error is not None:
            with self._lock:
                entry = self._queues.pop(request_id, None)
                self._unfinished.pop(request_id, None)
            if entry is not None:
                hand_over([(*entry, error)])
        if not self._closed:
            self._transport.send(Abort(request_id))

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            closing, self._transport_open = self._transport_open, False
        if closing:
            self._transport.close()
        self._fail_pending(EngineClosedError("the engine shut down"))

    # ---- the tokenizer and the figures ----

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            template_kwargs: dict | None = None) -> list[int]:
        """The prompt's token ids; tools (OpenAI's function tools, as the client sent them) go to the
        template's `tools` argument; template_kwargs (checked: server/chat/reasoning.py) to the template."""
        return chat_prompt_ids(self.tokenizer, messages, tools, template_kwargs)

    @functools.cached_property
    def vocab(self):
        """The bytes each token id spells (engine/detokenizer.py), for logprob tokens and echoed prompts:
        an in-thread core's own, else read from the tokenizer here."""
        from pagoda.engine.detokenizer import TokenVocab

        core = self.core
        return core.vocab if core is not None else TokenVocab(self.tokenizer, self.model_info.vocab_size)

    def prompt_text(self, req: EngineRequest) -> str:
        """A request's prompt as text: as the caller wrote it, or what its token ids spell (a prompt given
        as ids, rendered from messages or truncated), through the one detokenizer."""
        if req.prompt_text is not None:
            return req.prompt_text
        return self.decode(req.prompt_token_ids, req.params.skip_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """What token ids spell, through the one detokenizer (ids must be in the vocabulary)."""
        from pagoda.engine.detokenizer import IncrementalDetokenizer

        d = IncrementalDetokenizer(self.vocab, [], skip_special_tokens)
        for t in token_ids:
            d.append(t)
        return d.flush()

    def stats(self):
        """The snapshot taken after the latest step (uptime read now)."""
        return dataclasses.replace(self._stats, uptime_s=time.monotonic() - self._started)

    def num_queued(self) -> int:
        """Sequences waiting for the core to schedule them, as the queue limit counts them."""
        return self._num_waiting + self._num_pending

    @property
    def num_in_flight(self) -> int:
        """Requests admitted and not yet finished (or left by their caller)."""
        return len(self._queues)

    @property
    def core(self):
        """The engine core (EngineCore) with the in-thread transport, for tests and tools; None with
        the child process."""
        return getattr(self._transport, "core", None)

    # ---- routing ----

    def _admit(self, req: EngineRequest) -> asyncio.Queue:
        """The request's queue, once it is sent to the core; refused if the queue is full or its id in flight."""
        with self._lock:
            if self._closed:
                raise EngineClosedError("the engine is shut down")
            if self.num_queued() >= self.config.max_queue_len:
                raise QueueFullError(f"the waiting queue is full ({self.config.max_queue_len} requests); retry later")
            if req.request_id in self._queues:
                raise DuplicateRequestError("request_id", f"{req.request_id!r} is already used by a request in flight")
            self._check_time_limit(req)
            self.check_adapter(req.adapter)  # an unload may have started since it was made
            queue: asyncio.Queue = asyncio.Queue()
            self._queues[req.request_id] = (asyncio.get_running_loop(), queue)
            self._unfinished[req.request_id] = req.params.n
            self._num_pending += req.params.n
        self._transport.send(req)  # not under the lock: a full pipe must not stall the report thread
        return queue

    def queue_wait_s(self, num_seqs: int = 1, num_tokens: int = 0) -> float:
        """The estimated wait of a request arriving now (EngineStats.queue_wait_s, from the latest step's
        figures), the sequences sent to the core and not yet taken in counted as queued before it."""
        return self._stats.queue_wait_s(num_seqs + self._num_pending, num_tokens)

    def _check_time_limit(self, req: EngineRequest) -> None:  # under self._lock
        """Admission: a request whose time limit is estimated to pass before its first token (the queue
        before it, then its own prompt) is refused now, not left to end with nothing."""
        limit = req.params.time_limit_ms
        if limit is None:
            return
        wait = self.queue_wait_s(req.params.n, len(req.prompt_token_ids))
        if wait * 1000 > limit:
            raise QueueWaitError(f"time_limit_ms {limit} cannot be met: the queue before this request and its "
                                 f"prompt are estimated to take {wait:.3g}s; retry later or with a longer limit",
                                 retry_after=wait)

    def _on_report(self, report) -> None:
        """A report from the core (its thread, or the receiver of the child's pipe)."""
        if isinstance(report, StepReport):
            with self._lock:
                self._stats = report.stats
                self._num_waiting = report.stats.num_waiting
                outbox = [(*entry, out) for out in report.outputs if (entry := self._settle(out)) is not None]
            hand_over(outbox)
        elif isinstance(report, Queued):
            with self._lock:
                self._num_waiting = report.num_waiting
                self._num_pending -= report.num_taken
        elif isinstance(report, AdapterResult):
            self.adapters = {a.name: a for a in report.adapters}
            with self._lock:
                loop, future = self._adapter_calls.pop(report.token, (None, None))
            if future is not None:
                loop.call_soon_threadsafe(_settle_future, future, report.error)
        elif isinstance(report, CoreFailed):
            with self._lock:
                self._closed = True
            if self.on_failure is not None:  # first: by the time a caller sees the error, the owner knows
                self.on_failure(report.error)
            self._fail_pending(report.error)

    def _settle(self, out: RequestOutput) -> tuple | None:  # under self._lock
        """Book one output against its request; (event loop, queue) to hand it to, or None when
        the request is gone (its caller left)."""
        entry = self._queues.get(out.request_id)
        if entry is not None and out.finished:
            self._unfinished[out.request_id] -= 1
            if not self._unfinished[out.request_id] or out.finish_reason == "error":
                del self._queues[out.request_id]
                del self._unfinished[out.request_id]
        return entry

    def _fail_pending(self, error: BaseException) -> None:
        """Every request still in flight gets `error`."""
        with self._lock:
            outbox = [(loop, queue, error) for loop, queue in self._queues.values()]
            self._queues.clear()
            self._unfinished.clear()
            calls, self._adapter_calls = list(self._adapter_calls.values()), {}
        hand_over(outbox)
        for loop, future in calls:
            loop.call_soon_threadsafe(_settle_future, future, error)


async def consume(request_id: str, queue: asyncio.Queue, unfinished: int, abort) -> AsyncIterator[RequestOutput]:
    """A request's outputs from its queue until its `unfinished` sequences have finished; an
    exception in the queue, or an output that failed, is raised. Leaving early calls abort()."""
    held = None
    try:
        while unfinished:
            out, held = (held, None) if held is not None else (await queue.get(), None)
            # a consumer that fell behind the engine gets what piled up as one output
            while not isinstance(out, BaseException) and not out.finished and not queue.empty():
                nxt = queue.get_nowait()
                if isinstance(nxt, BaseException) or nxt.index != out.index:
                    held = nxt
                    break
                out = merge(out, nxt)
            if isinstance(out, BaseException):
                raise out
            if out.finish_reason == "error":
                if out.stop_reason == "refused":
                    raise QueueWaitError(f"request {request_id} was refused: {out.error}; retry later")
                raise EngineError(f"request {request_id} failed: {out.error}")
            unfinished -= out.finished
            yield out
    finally:
        if unfinished:
            abort()


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


async def merge_streams(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(which stream, output) from several requests' streams (the prompts of one call), as they come;
    the first error raised by one is raised here. The caller closes the streams afterwards."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for out in stream:
                await queue.put((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(tasks)
        while open_streams:
            i, item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # before the streams themselves are closed


async def whole_outputs(outputs: AsyncIterator[tuple[int, RequestOutput]]) -> list[tuple[int, RequestOutput]]:
    """(which stream, delta) pairs folded into one whole output per completion, in order of (stream,
    index); each completion must have finished."""
    whole: dict[tuple[int, int], RequestOutput] = {}
    async for i, out in outputs:
        key = (i, out.index)
        whole[key] = merge(whole[key], out) if key in whole else out
    if not all(out.finished for out in whole.values()):
        raise RuntimeError("the engine ended a request without a final output")
    return [(i, out) for (i, _), out in sorted(whole.items())]


def _settle_future(future: asyncio.Future, error: BaseException | None) -> None:
    if not future.done():
        future.set_result(None) if error is None else future.set_exception(error)

"""The engine core behind a boundary: in a thread of this process, or in a child process.

In one process the server's event loop and the engine loop share a GIL: every streamed message's
Python runs between the engine's steps and slows them (measured: a thread busy with Python 25% of
the time made offline generation 19% slower; another process busy 100% cost nothing). The child
process owns the model and steps it; the parent keeps the tokenizer (requests are tokenized and
checked before they are sent) and the per-request queues.

Both transports run the same loop (run_core) over the same records (engine/core/core_io.py): commands
in, reports out. A report reaches the front-end through `on_report`, called in the core's thread
(in-thread) or in a receiver thread that reads the child's pipe.
"""
import atexit
import collections
import logging
import multiprocessing
import pickle
import signal
import threading
from logging.handlers import QueueHandler, QueueListener

from pagoda.engine.config import EngineConfig
from pagoda.engine.core.core_io import (Abort, AdapterCommand, Closed, CoreFailed, CoreReady, EngineRequest, Queued,
                                   Shutdown, StepReport)
from pagoda.engine.core.core_outputs import failed_output
from pagoda.engine.errors import EngineDeadError

log = logging.getLogger("pagoda.engine")


def run_core(core, commands, report) -> None:
    """The engine loop: take in commands, step, report, until Shutdown. `commands` has a
    multiprocessing Connection's poll() and recv(); report(record) hands a report out."""
    while True:
        if not core.has_work():
            commands.poll(core.idle_poll_s)  # idle: sleep until a command comes (or a rank may have died)
        core.check_alive()  # EngineDeadError: fatal, ends the loop
        outputs, num_added = [], 0
        while commands.poll(0):
            cmd = commands.recv()
            if isinstance(cmd, Shutdown):
                core.close()
                report(Closed())
                return
            if isinstance(cmd, EngineRequest):
                num_added += cmd.params.n
                outputs += _add(core, cmd)
            elif isinstance(cmd, Abort):
                outputs += core.abort(cmd.request_id)
            elif isinstance(cmd, AdapterCommand):
                for result in core.adapter_command(cmd):
                    report(result)
        if not (outputs or num_added or core.has_work()):
            continue  # woke only to check the ranks
        outputs += core.guarded(lambda: _step(core, report, num_added))
        report(StepReport(outputs, core.stats()))
        if core.unloading:  # LoRA adapters whose last requests finished in this step
            for result in core.adapter_results():
                report(result)


def _step(core, report, num_added: int) -> list:
    """A step, with the requests taken in since the last one reported queued once it admitted what it
    could: they count in the core's waiting list, and those it admitted no longer do, so the front-end's
    queue limit sees that before the model runs."""
    try:
        scheduled = core.schedule() if core.has_work() else None
    finally:
        if num_added:
            report(Queued(core.num_waiting, num_added))
    return core.execute(*scheduled) if scheduled is not None else []


def _add(core, req: EngineRequest) -> list:
    try:
        core.add_request(req)
    except Exception as e:  # checked before it was sent: a bug, which fails only this request
        log.exception("taking in request %s failed", req.request_id)
        return [failed_output(req.request_id, f"{type(e).__name__}: {e}")]
    return []


def ready_report(core) -> CoreReady:
    return CoreReady(core.config, core.model_info(), core.stats(), core.started, core.tokenizer)


class ThreadTransport:
    """The core in a thread of this process; it calls on_report itself."""

    def __init__(self, config: EngineConfig):
        from pagoda.engine.core.engine_core import EngineCore

        self.core = EngineCore(config)
        self.ready = ready_report(self.core)
        self._commands = _Inbox()
        self._thread: threading.Thread | None = None

    def start(self, on_report) -> None:
        self._thread = threading.Thread(target=self._run, args=(on_report,), name="pagoda-engine", daemon=True)
        self._thread.start()

    def _run(self, on_report) -> None:
        try:
            run_core(self.core, self._commands, on_report)
        except BaseException as e:  # noqa: BLE001 - a bug in the loop itself: the front-end must know
            log.exception("the engine loop crashed")
            on_report(CoreFailed(EngineDeadError(f"the engine loop crashed: {type(e).__name__}: {e}")))

    def send(self, command) -> None:
        self._commands.send(command)

    def close(self) -> None:
        self._commands.send(Shutdown())
        if self._thread is not None:
            self._thread.join(timeout=30)


class _Inbox:
    """Commands to the in-thread core, with the two calls run_core makes of a Connection."""

    def __init__(self):
        self._items = collections.deque()
        self._cv = threading.Condition()

    def send(self, item) -> None:
        with self._cv:
            self._items.append(item)
            self._cv.notify()

    def poll(self, timeout: float | None = 0.0) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self._items, timeout)

    def recv(self):
        with self._cv:
            return self._items.popleft()


class ProcessTransport:
    """The core in a child process, over one duplex pipe (records pickled)."""

    def __init__(self, config: EngineConfig):
        """Starts the child and waits until it has loaded the model (raising what it raised if not)."""
        ctx = multiprocessing.get_context("spawn")  # fork is unsafe with gRPC's and torch's threads
        self._conn, child_conn = ctx.Pipe()
        # the child's log records go out through this process's handlers (its format, its level)
        logs, root = ctx.Queue(), logging.getLogger()
        self._log_listener = QueueListener(logs, *root.handlers, respect_handler_level=True)
        self._log_listener.start()
        # not a daemon: a tensor-parallel core starts its ranks' processes (the atexit kill below ends it)
        self._proc = ctx.Process(target=_child_main, args=(config, child_conn, logs, root.level),
                                 name="pagoda-engine", daemon=False)
        self._proc.start()
        # Runs before multiprocessing's own exit handler, whose terminate() the child ignores (SIGTERM
        # is the parent's to handle) and whose join() would then wait forever, e.g. for a child still
        # loading when the server is told to stop.
        atexit.register(self._kill)
        child_conn.close()
        try:
            msg = self._conn.recv()
        except EOFError:
            self._stop()
            raise RuntimeError(f"the engine process exited while loading (exit code {self._proc.exitcode})")
        if isinstance(msg, CoreFailed):
            self._stop()
            raise msg.error
        self.ready: CoreReady = msg
        self._send_lock = threading.Lock()
        self._closing = False

    @property
    def pid(self) -> int:
        return self._proc.pid

    def start(self, on_report) -> None:
        threading.Thread(target=self._receive, args=(on_report,), name="pagoda-engine-receiver", daemon=True).start()

    def send(self, command) -> None:
        with self._send_lock:
            try:
                self._conn.send(command)
            except (OSError, ValueError):  # the child is gone; the receiver reports it
                pass

    def close(self) -> None:
        self._closing = True
        self.send(Shutdown())
        self._stop()

    def _stop(self) -> None:
        self._proc.join(30)
        self._kill()
        atexit.unregister(self._kill)
        self._log_listener.stop()

    def _kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    def _receive(self, on_report) -> None:
        failed = False  # the child said why it stopped: its exit needs no second report
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                if not self._closing and not failed:
                    self._proc.join(5)
                    log.error("the engine process exited (code %s)", self._proc.exitcode)
                    on_report(CoreFailed(EngineDeadError(f"the engine process exited (code {self._proc.exitcode})")))
                return
            on_report(msg)
            failed = failed or isinstance(msg, CoreFailed)
            if isinstance(msg, Closed):
                return


def _child_main(config: EngineConfig, conn, logs, log_level: int) -> None:
    # Ctrl-C (and a service manager's SIGTERM) reach the whole process group: the parent drains and
    # then shuts the child down; a parent that dies closes the pipe, which ends the child too
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    root = logging.getLogger()
    root.handlers[:] = [QueueHandler(logs)]
    root.setLevel(log_level)
    from pagoda.engine.core.engine_core import EngineCore

    try:
        core = EngineCore(config)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(CoreFailed(e if _picklable(e) else RuntimeError(f"{type(e).__name__}: {e}")))
        return
    try:
        conn.send(ready_report(core))
        run_core(core, conn, conn.send)
    except (EOFError, OSError):
        pass  # the parent is gone
    except EngineDeadError as e:  # e.g. a tensor-parallel rank died: the parent fails the engine with this
        log.error("%s", e)
        conn.send(CoreFailed(e))
    finally:
        core.close()


def _picklable(e: BaseException) -> bool:
    try:
        pickle.loads(pickle.dumps(e))
    except Exception:  # noqa: BLE001
        return False
    return True

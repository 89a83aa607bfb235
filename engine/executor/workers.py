"""Tensor-parallel ranks: the engine core is rank 0 (the driver: scheduler, block manager, sampler);
it starts ranks 1..N-1 as processes that each build the same ModelRunner from the config and their
rank (their shard of the model, then their KV cache), then run what the driver calls through one
generic Workers.call(method, *args): each step, `replay`.

A step goes to each worker once, before the driver's own forward, as one StepInputs record over a
local socket (the inputs as numpy arrays, a few KB: 41 us a round trip, against 812 us as a gloo
broadcast; benchmarks/tensor_parallel.py). The model's own collectives (an all-reduce after each
row-parallel layer and the embedding, the logits' all-gather) run on a torch.distributed process
group: gloo on CPU, NCCL on CUDA, created directly over a TCPStore (no process-global default group,
so one process may run several engines one after another), with a timeout (EngineConfig.tp_timeout_s)
that catches a rank that hangs. A worker that dies, or a collective that fails or times out, is fatal
to the engine (EngineDeadError): the ranks would be out of step."""
from __future__ import annotations

import dataclasses
import datetime
import logging
import multiprocessing.connection
import os
import secrets
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from pagoda.engine.executor import parallel
from pagoda.engine.errors import EngineDeadError

log = logging.getLogger("pagoda.engine")

START_TIMEOUT_S = 300.0  # for the ranks to start and connect (importing torch on a busy machine)


@dataclass
class StepInputs:
    """What every rank computes in a step: the model's inputs (as host arrays) and, in order, the
    rows of the step's hidden states whose logits are computed (None: every row; an index array; a
    (start, stop) range)."""
    input_ids: np.ndarray
    positions: np.ndarray
    meta: dict  # AttentionMetadata's fields, tensors as numpy arrays
    logits_rows: list
    lora: object = None  # engine/lora/adapters.py LoRAStep: the step's adapter rows, or None


def to_host(t: torch.Tensor | None):
    return None if t is None else t.cpu().numpy()


def process_group(store, rank: int, size: int, device: torch.device, timeout_s: float):
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        opts = torch.distributed.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return torch.distributed.ProcessGroupNCCL(store, rank, size, opts)
    # the ranks meet under the start's timeout (a rank may still be importing torch on a busy
    # machine); the collectives then run under the configured one, which catches a hung rank
    pg = torch.distributed.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=START_TIMEOUT_S))
    pg.set_timeout(timeout)
    return pg


class Workers:
    """The driver's handle on ranks 1..N-1: each a `python -m pagoda.engine.executor.rank` process (a fresh
    interpreter: nothing of the caller's __main__ is re-run), connected back over an authenticated
    local socket."""

    def __init__(self, config, device: torch.device):
        """config.model is the checkpoint's local directory; each rank builds its ModelRunner from it."""
        size = config.tensor_parallel_size
        if device.type == "cuda" and size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size {size} exceeds the {torch.cuda.device_count()} visible CUDA "
                             f"devices")
        self.store = torch.distributed.TCPStore("127.0.0.1", 0, size, True, wait_for_workers=False,
                                                timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
        key = secrets.token_bytes(16)
        listener = multiprocessing.connection.Listener(("127.0.0.1", 0), authkey=key)
        env = {**os.environ, "PAGODA_TP_AUTHKEY": key.hex()}
        host, port = listener.address
        self.procs = [subprocess.Popen([sys.executable, "-m", "pagoda.engine.executor.rank", str(rank), f"{host}:{port}"],
                                       env=env, stdin=subprocess.DEVNULL) for rank in range(1, size)]
        self._finalizer = weakref.finalize(self, _stop, [], self.procs)
        try:
            self.conns = _accept(listener, self.procs)
        finally:
            listener.close()
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _stop, self.conns, self.procs)
        for rank, conn in enumerate(self.conns, 1):
            conn.send((config, self.store.port))
        self.group = parallel.TPGroup(0, size, process_group(self.store, 0, size, device, config.tp_timeout_s))

    def call(self, method: str, *args, wait: bool = True) -> list:
        """Every other rank runs its ModelRunner's method(*args) (the driver runs its own); with wait,
        their results in rank order. A step is sent without waiting: the collectives keep the ranks
        in step, and a reply would cost a round trip per step."""
        if not wait:
            self.check()
        for conn in self.conns:
            try:
                conn.send((method, args, wait))
            except (OSError, ValueError):
                if wait:
                    continue  # its reply says why (or that it exited)
                self.check()
                raise EngineDeadError("a tensor-parallel rank is gone") from None
        return [self._reply(rank, conn) for rank, conn in enumerate(self.conns, 1)] if wait else []

    def _reply(self, rank: int, conn):
        try:
            ok, value = conn.recv()
        except EOFError:
            ok, value = False, f"exited (code {self.procs[rank - 1].wait(5)})"
        if not ok:
            raise RuntimeError(f"tensor-parallel rank {rank} failed: {value}")
        return value

    def check(self, wait: float = 0.0) -> None:
        """EngineDeadError if a rank has exited (within `wait` seconds)."""
        deadline = time.monotonic() + wait
        while True:
            for rank, proc in enumerate(self.procs, 1):
                if proc.poll() is not None:
                    raise EngineDeadError(f"tensor-parallel rank {rank} exited (code {proc.returncode})")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def close(self) -> None:
        self._finalizer()


def _accept(listener, procs) -> list:
    """One connection per worker, in rank order; an error if one exits first (or none comes in time)."""
    got: dict[int, object] = {}
    errors: list[BaseException] = []

    def accept_all():
        try:
            for _ in procs:
                conn = listener.accept()
                got[conn.recv()] = conn  # each says its rank first
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            errors.append(e)
    t = threading.Thread(target=accept_all, daemon=True)
    t.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while t.is_alive() and time.monotonic() < deadline:
        t.join(0.1)
        for rank, proc in enumerate(procs, 1):
            if proc.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} exited while starting (code {proc.returncode})")
    if t.is_alive() or errors:
        raise RuntimeError(f"tensor-parallel ranks did not connect: {errors[0] if errors else 'timed out'}")
    return [got[rank] for rank in range(1, len(procs) + 1)]


def _stop(conns, procs) -> None:
    for conn in conns:
        try:
            conn.send(None)
        except (OSError, ValueError):
            pass
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def step_inputs(input_ids, positions, meta, logits_rows, lora=None) -> StepInputs:
    fields = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)}
    host = {k: to_host(v) if isinstance(v, torch.Tensor) else v for k, v in fields.items()}
    rows = [to_host(r) if isinstance(r, torch.Tensor) else r for r in logits_rows]
    return StepInputs(to_host(input_ids), to_host(positions), host, rows, lora)


def cpu_threads(config) -> int:
    """Torch threads per rank on CPU: the configured number, else the cores shared among the ranks."""
    if config.cpu_threads is not None:
        return config.cpu_threads
    return max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)


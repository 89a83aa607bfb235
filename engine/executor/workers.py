"""Tensor- and pipeline-parallel ranks: the engine core is rank 0 (the driver: scheduler, block manager,
sampler); it starts ranks 1..N-1 (N = tensor_parallel_size x pipeline_parallel_size) as processes that
each build the same ModelRunner from the config and their rank (their shard of the model, or of their
pipeline stage's layers: engine/executor/pipeline.py, then their KV cache), then run what the driver
calls through one generic Workers.call(method, *args): each step, `replay`.

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

from pagoda.engine.executor import pipeline
from pagoda.engine.errors import EngineDeadError

log = logging.getLogger("pagoda.engine")

START_TIMEOUT_S = 300.0  # for the ranks to start and connect (importing torch on a busy machine)
# multi-node: what the other nodes' ranks read from the driver's store to reach its listener (node.py)
LISTENER_KEY, AUTHKEY_KEY = "pagoda/listener_port", "pagoda/authkey"


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
    socket. With several nodes (config.nnodes) the driver starts this node's ranks 1..per_node-1; the
    other nodes' connect from there (engine/executor/node.py): they have no process here (`procs`
    holds this node's only, ranks 1.., then `conns` the other nodes' ranks)."""

    def __init__(self, config, device: torch.device):
        """config.model is the checkpoint's local directory; each rank builds its ModelRunner from it."""
        size, local = config.world_size, config.ranks_per_node
        if config.node_rank:
            raise ValueError(f"node_rank {config.node_rank} runs that node's ranks, not an engine: `pagoda serve MODEL "
                             f"--node-rank {config.node_rank} ...` (only node 0 builds the engine)")
        if device.type == "cuda" and local > torch.cuda.device_count():
            raise ValueError(f"{local} ranks per node (tensor_parallel_size x pipeline_parallel_size / nnodes) "
                             f"exceed the {torch.cuda.device_count()} visible CUDA devices")
        host = config.master_addr if config.nnodes > 1 else "127.0.0.1"
        self.store = torch.distributed.TCPStore(host, config.master_port or 0, size, True, wait_for_workers=False,
                                                timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
        key = secrets.token_bytes(16)
        listener = multiprocessing.connection.Listener((host, 0), authkey=key)
        env = {**os.environ, "PAGODA_TP_AUTHKEY": key.hex()}
        host, port = listener.address
        if config.nnodes > 1:  # the store is the rendezvous: whoever reaches it may join (a trusted network)
            self.store.set(LISTENER_KEY, str(port))
            self.store.set(AUTHKEY_KEY, key.hex())
            log.info("waiting for nodes 1..%d (ranks %d..%d) to connect to %s:%d", config.nnodes - 1, local,
                     size - 1, config.master_addr, self.store.port)
        self.procs = [subprocess.Popen([sys.executable, "-m", "pagoda.engine.executor.rank", str(rank), f"{host}:{port}"],
                                       env=env, stdin=subprocess.DEVNULL) for rank in range(1, local)]
        self.per_node = local
        self._finalizer = weakref.finalize(self, _stop, [], self.procs)
        try:
            self.conns = _accept(listener, self.procs, size - 1)
        finally:
            listener.close()
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _stop, self.conns, self.procs)
        for rank, conn in enumerate(self.conns, 1):
            conn.send((config, self.store.port))
        self.group, self.pipeline = pipeline.process_groups(self.store, 0, config, device)

    def call(self, method: str, *args, wait: bool = True, ranks: range | None = None) -> list:
        """Every other rank (or those of `ranks`) runs its ModelRunner's method(*args) (the driver runs its
        own); with wait, their results in rank order. A step is sent without waiting: the collectives keep
        the ranks in step, and a reply would cost a round trip per step."""
        if not wait:
            self.check()
        conns = self.conns if ranks is None else [self.conns[r - 1] for r in ranks]
        for conn in conns:
            try:
                conn.send((method, args, wait))
            except (OSError, ValueError):
                if wait:
                    continue  # its reply says why (or that it exited)
                self.check()
                raise EngineDeadError("a tensor-parallel rank is gone") from None
        return [self._reply(rank, conn) for rank, conn in enumerate(self.conns, 1)
                if ranks is None or rank in ranks] if wait else []

    def _reply(self, rank: int, conn):
        try:
            ok, value = conn.recv()
        except (EOFError, OSError):
            ok, value = False, (f"exited (code {self.procs[rank - 1].wait(5)})" if rank <= len(self.procs)
                                else f"its connection closed (node {rank // self.per_node})")
        if not ok:
            raise RuntimeError(f"tensor-parallel rank {rank} failed: {value}")
        return value

    def check(self, wait: float = 0.0) -> None:
        """EngineDeadError if a rank has exited (within `wait` seconds); another node's rank, if its
        connection closed (a node cut off without closing it shows as a collective's timeout)."""
        deadline = time.monotonic() + wait
        while True:
            for rank, proc in enumerate(self.procs, 1):
                if proc.poll() is not None:
                    raise EngineDeadError(f"tensor-parallel rank {rank} exited (code {proc.returncode})")
            for rank in range(len(self.procs) + 1, len(self.conns) + 1):
                if _closed(self.conns[rank - 1]):
                    raise EngineDeadError(f"tensor-parallel rank {rank} of node {rank // self.per_node} is gone "
                                          f"(its connection closed)")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def close(self) -> None:
        self._finalizer()


def _closed(conn) -> bool:
    """Whether a rank's connection was closed: a rank sends nothing unasked, so readable means closed."""
    try:
        return conn.poll()
    except (OSError, ValueError):
        return True


def _accept(listener, procs, n: int) -> list:
    """A connection from each of ranks 1..n, in rank order (procs: this node's, which may not exit
    first); an error if one exits first (or not all come in time)."""
    got: dict[int, object] = {}
    errors: list[BaseException] = []

    def accept_all():
        try:
            for _ in range(n):
                conn = listener.accept()
                rank = conn.recv()  # each says its rank first
                if not 1 <= rank <= n or rank in got:
                    raise RuntimeError(f"rank {rank} connected, expected ranks 1..{n} once each: give every node "
                                       f"the same --tensor-parallel-size and --nnodes, and each its own --node-rank")
                got[rank] = conn
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
    return [got[rank] for rank in range(1, n + 1)]


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
    return max(1, (os.cpu_count() or 1) // config.ranks_per_node)


"""Tensor-parallel ranks: the engine core is rank 0 (the driver: scheduler, block manager, sampler);
it starts ranks 1..N-1 as processes that each build their shard of the model and their KV cache,
then run every step the driver sends them.

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
import signal
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from pagoda.engine import parallel
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


@dataclass
class WorkerSetup:
    """The driver's resolved configuration, sent once every rank has loaded its shard."""
    num_kv_blocks: int
    block_size: int
    dtype: str
    max_model_len: int


def to_host(t: torch.Tensor | None):
    return None if t is None else t.cpu().numpy()


def process_group(store, rank: int, size: int, device: torch.device, timeout_s: float):
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        opts = torch.distributed.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return torch.distributed.ProcessGroupNCCL(store, rank, size, opts)
    return torch.distributed.ProcessGroupGloo(store, rank, size, timeout)


class Workers:
    """The driver's handle on ranks 1..N-1: each a `python -m pagoda.engine.workers` process (a fresh
    interpreter: nothing of the caller's __main__ is re-run), connected back over an authenticated
    local socket."""

    def __init__(self, config, path: str, device: torch.device):
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
        self.procs = [subprocess.Popen([sys.executable, "-m", "pagoda.engine.workers", str(rank), f"{host}:{port}"],
                                       env=env, stdin=subprocess.DEVNULL) for rank in range(1, size)]
        self._finalizer = weakref.finalize(self, _stop, [], self.procs)
        try:
            self.conns = _accept(listener, self.procs)
        finally:
            listener.close()
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _stop, self.conns, self.procs)
        for rank, conn in enumerate(self.conns, 1):
            conn.send((config, path, self.store.port))
        self.group = parallel.TPGroup(0, size, process_group(self.store, 0, size, device, config.tp_timeout_s))

    def setup(self, setup: WorkerSetup) -> None:
        """Send the resolved configuration; wait until every rank has its KV cache."""
        for conn in self.conns:
            conn.send(setup)
        for rank, conn in enumerate(self.conns, 1):
            try:
                msg = conn.recv()
            except EOFError:
                msg = f"exited while loading (code {self.procs[rank - 1].wait(5)})"
            if msg != "ready":
                raise RuntimeError(f"tensor-parallel rank {rank} failed: {msg}")

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

    def send(self, step: StepInputs) -> None:
        self.check()
        for conn in self.conns:
            try:
                conn.send(step)
            except (OSError, ValueError):
                self.check()
                raise EngineDeadError("a tensor-parallel rank is gone") from None

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


def step_inputs(input_ids, positions, meta, logits_rows) -> StepInputs:
    fields = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)}
    host = {k: to_host(v) if isinstance(v, torch.Tensor) else v for k, v in fields.items()}
    rows = [to_host(r) if isinstance(r, torch.Tensor) else r for r in logits_rows]
    return StepInputs(to_host(input_ids), to_host(positions), host, rows)


def main(argv=None) -> None:
    """`python -m pagoda.engine.workers RANK HOST:PORT`: a rank's process. Its shard, its KV cache, then
    the driver's steps until told to stop."""
    argv = sys.argv[1:] if argv is None else argv
    rank, (host, port) = int(argv[0]), argv[1].rsplit(":", 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver's to handle; a dead driver ends the pipe
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{rank} %(levelname)s %(message)s")
    conn = multiprocessing.connection.Client((host, int(port)), authkey=bytes.fromhex(os.environ["PAGODA_TP_AUTHKEY"]))
    conn.send(rank)
    try:
        config, path, store_port = conn.recv()
        runner = _load(config, path, rank, store_port, conn)
    except (EOFError, OSError):
        return  # the driver is gone
    except Exception as e:  # noqa: BLE001 - told to the driver, which fails the engine's start
        log.exception("loading failed")
        conn.send(f"{type(e).__name__}: {e}")
        return
    conn.send("ready")
    while True:
        try:
            step = conn.recv()
        except (EOFError, OSError):
            return  # the driver is gone
        if step is None:
            return
        try:
            runner.replay(step)
        except Exception:  # noqa: BLE001 - the ranks are out of step: end; the driver fails the engine
            log.exception("step failed")
            os._exit(1)


def _load(config, path: str, rank: int, port: int, conn):
    from pagoda.engine.llm_engine import _attention_backend, _device, _dtype
    from pagoda.engine.loader import load_hf_config, load_weights
    from pagoda.engine.model_runner import ModelRunner
    from pagoda.engine.models import build_model

    device = _device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(cpu_threads(config))
    hf_config = load_hf_config(path)
    store = torch.distributed.TCPStore("127.0.0.1", port, config.tensor_parallel_size, False,
                                       timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
    group = parallel.TPGroup(rank, config.tensor_parallel_size,
                             process_group(store, rank, config.tensor_parallel_size, device, config.tp_timeout_s))
    dtype = _dtype(config.dtype, hf_config, device)
    torch.manual_seed(config.seed)
    parallel.use_group(group)
    try:
        with torch.device(device):
            model = build_model(hf_config).to(dtype)
    finally:
        parallel.use_group(None)
    load_weights(model, path)
    setup: WorkerSetup = conn.recv()
    head_dim = next(m.head_dim for m in model.modules() if hasattr(m, "head_dim"))
    backend = _attention_backend(config.attention_backend, device, head_dim)
    runner = ModelRunner(model.eval(), setup.num_kv_blocks, setup.block_size, dtype, device, config.seed,
                         hf_config.vocab_size, backend, quantization=config.quantization)
    runner.group_store = store  # keep the store alive as long as the group
    return runner


def cpu_threads(config) -> int:
    """Torch threads per rank on CPU: the configured number, else the cores shared among the ranks."""
    if config.cpu_threads is not None:
        return config.cpu_threads
    return max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)


if __name__ == "__main__":
    main()

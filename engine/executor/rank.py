"""A tensor- or pipeline-parallel rank's process (ranks 1..N-1; engine/executor/workers.py starts them, or on
another node engine/executor/node.py): its ModelRunner, built as the driver's is, then the driver's
calls until told to stop (exit 0), or until the driver is gone (exit 1)."""
import argparse
import ctypes
import dataclasses
import datetime
import logging
import multiprocessing.connection
import os
import signal
import sys

import torch

from pagoda.engine.executor import pipeline
from pagoda.engine.executor.model_runner import ModelRunner
from pagoda.engine.executor.workers import AUTHKEY_KEY, LISTENER_KEY, START_TIMEOUT_S
from pagoda.engine.loader import device_of

log = logging.getLogger("pagoda.engine")


def main(argv=None) -> int:
    """`python -m pagoda.engine.executor.rank RANK HOST:PORT`: a rank's process, HOST:PORT the driver's
    listener (its store on HOST too), the key in PAGODA_TP_AUTHKEY. Its ModelRunner (built as the driver's
    is), then the driver's calls until told to stop. On another node (engine/executor/node.py): --node
    MODEL, that node's name for the checkpoint; HOST:PORT the driver's store, where the listener's port and
    key are; --parent, the node's process, whose end ends this one; --ready-fd, written once loaded."""
    p = argparse.ArgumentParser(prog="python -m pagoda.engine.executor.rank")
    p.add_argument("rank", type=int)
    p.add_argument("address")
    p.add_argument("--node", metavar="MODEL")
    p.add_argument("--parent", type=int)
    p.add_argument("--ready-fd", type=int)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    rank, (host, port) = args.rank, args.address.rsplit(":", 1)
    if args.parent is not None:
        _exit_with_parent(args.parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver's to handle; a dead driver ends the pipe
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{rank} %(levelname)s %(message)s")
    try:
        model = _checkpoint(args.node) if args.node is not None else None
    except ValueError as e:
        log.error("%s", e)
        return 1
    try:
        conn = _connect(host, int(port), args.node is not None)
    except (OSError, RuntimeError) as e:  # RuntimeError: torch's DistStoreError, no store in time
        log.error("cannot reach the driver at %s:%s: %s", host, port, e)
        return 1
    conn.send(rank)
    try:
        config, store_port = conn.recv()
        if model is not None:
            config = dataclasses.replace(config, model=model)
        store, runner = _load(config, rank, host, store_port)  # the store lives as long as the group
    except (EOFError, OSError):
        return 1  # the driver is gone
    except Exception as e:  # noqa: BLE001 - told to the driver, which fails the engine's start
        log.exception("loading failed")
        conn.send((False, f"{type(e).__name__}: {e}"))
        return 1
    if args.ready_fd is not None:
        os.write(args.ready_fd, b"1")
        os.close(args.ready_fd)
    return _serve(runner, conn)


def _connect(host: str, port: int, via_store: bool):
    """The connection to the driver's listener; via_store: HOST:PORT is its store, where the listener's
    port and key are (waiting up to START_TIMEOUT_S for the driver to start)."""
    if not via_store:
        return multiprocessing.connection.Client((host, port), authkey=bytes.fromhex(os.environ["PAGODA_TP_AUTHKEY"]))
    store = torch.distributed.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
    listener_port, key = int(store.get(LISTENER_KEY)), bytes.fromhex(store.get(AUTHKEY_KEY).decode())
    return multiprocessing.connection.Client((host, listener_port), authkey=key)


def _checkpoint(model: str) -> str:
    """This node's local directory of the model as named on its command line ("": the demo model)."""
    from pagoda.engine.demo import demo_model_path
    from pagoda.engine.loader import resolve_model_path

    return resolve_model_path(model) if model else demo_model_path()


def _exit_with_parent(pid: int) -> None:
    """SIGKILL when the parent process ends (Linux), so that no rank outlives a node's process killed
    outright; the parent of a driver's ranks is a thread's, and a thread's end would count."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (AttributeError, OSError):
        pass
    if os.getppid() != pid:  # it ended before the call above
        sys.exit(1)


def _serve(runner, conn) -> int:
    """0 once told to stop; 1 when the driver is gone."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return 1  # the driver is gone
        if msg is None:
            return 0
        method, args, wait = msg
        try:
            result = getattr(runner, method)(*args)
        except Exception as e:  # noqa: BLE001
            log.exception("%s failed", method)
            if not wait:  # a step: the ranks are out of step; end, and the driver fails the engine
                os._exit(1)
            conn.send((False, f"{type(e).__name__}: {e}"))
            return 1
        if wait:
            conn.send((True, result))


def _load(config, rank: int, host: str, port: int):
    store = torch.distributed.TCPStore(host, port, config.world_size, False,
                                       timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
    device = device_of(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank % config.ranks_per_node)
        torch.cuda.set_device(device)
    group, stages = pipeline.process_groups(store, rank, config, device)
    return store, ModelRunner(config, rank, group, pipeline=stages)


if __name__ == "__main__":
    sys.exit(main())

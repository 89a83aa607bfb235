"""A tensor-parallel rank's process (ranks 1..N-1; engine/executor/workers.py starts them): its
ModelRunner, built as the driver's is, then the driver's calls until told to stop."""
import datetime
import logging
import multiprocessing.connection
import os
import signal
import sys

import torch

from pagoda.engine.executor import parallel
from pagoda.engine.executor.model_runner import ModelRunner
from pagoda.engine.executor.workers import START_TIMEOUT_S, process_group
from pagoda.engine.loader import device_of

log = logging.getLogger("pagoda.engine")


def main(argv=None) -> None:
    """`python -m pagoda.engine.executor.rank RANK HOST:PORT`: a rank's process. Its ModelRunner (built as the
    driver's is), then the driver's calls until told to stop."""
    argv = sys.argv[1:] if argv is None else argv
    rank, (host, port) = int(argv[0]), argv[1].rsplit(":", 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver's to handle; a dead driver ends the pipe
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{rank} %(levelname)s %(message)s")
    conn = multiprocessing.connection.Client((host, int(port)), authkey=bytes.fromhex(os.environ["PAGODA_TP_AUTHKEY"]))
    conn.send(rank)
    try:
        config, store_port = conn.recv()
        store, runner = _load(config, rank, store_port)  # the store lives as long as the group
    except (EOFError, OSError):
        return  # the driver is gone
    except Exception as e:  # noqa: BLE001 - told to the driver, which fails the engine's start
        log.exception("loading failed")
        conn.send((False, f"{type(e).__name__}: {e}"))
        return
    _serve(runner, conn)


def _serve(runner, conn) -> None:
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the driver is gone
        if msg is None:
            return
        method, args, wait = msg
        try:
            result = getattr(runner, method)(*args)
        except Exception as e:  # noqa: BLE001
            log.exception("%s failed", method)
            if not wait:  # a step: the ranks are out of step; end, and the driver fails the engine
                os._exit(1)
            conn.send((False, f"{type(e).__name__}: {e}"))
            return
        if wait:
            conn.send((True, result))


def _load(config, rank: int, port: int):
    size = config.tensor_parallel_size
    store = torch.distributed.TCPStore("127.0.0.1", port, size, False,
                                       timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
    device = device_of(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    group = parallel.TPGroup(rank, size, process_group(store, rank, size, device, config.tp_timeout_s))
    return store, ModelRunner(config, rank, group)


if __name__ == "__main__":
    main()

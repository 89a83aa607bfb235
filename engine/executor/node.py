"""A node other than the driver's under multi-node tensor or pipeline parallelism (EngineConfig.nnodes > 1,
node_rank k > 0): `pagoda serve MODEL --tensor-parallel-size T [--pipeline-parallel-size P] --nnodes M
--node-rank k --master-addr HOST --master-port P` runs ranks k*N/M .. (k+1)*N/M - 1 (N = T x P ranks in
all: with M = P, node k runs pipeline stage k) as processes (engine/executor/rank.py) that
read from the driver's store at HOST:P where its step listener is, connect to it, build their shards
from the driver's config and this node's copy of the checkpoint, and replay its steps. The node
serves no API; its process only watches its ranks (server/main.py serve_node), and imports no torch:
the ranks start at once."""
from __future__ import annotations

import os
import subprocess
import sys


class Node:
    def __init__(self, config):
        per = config.ranks_per_node
        self.ranks = range(config.node_rank * per, (config.node_rank + 1) * per)
        ready, write = os.pipe()  # each rank writes a byte once loaded
        cmd = [sys.executable, "-m", "pagoda.engine.executor.rank"]
        try:
            self.procs = [subprocess.Popen(cmd + [str(rank), f"{config.master_addr}:{config.master_port}",
                                                  "--node", config.model or "", "--parent", str(os.getpid()),
                                                  "--ready-fd", str(write)], pass_fds=(write,), stdin=subprocess.DEVNULL)
                          for rank in self.ranks]
        finally:
            os.close(write)
        os.set_blocking(ready, False)
        self._ready, self._loaded = ready, 0

    def loaded(self) -> bool:
        """Whether every rank of this node has built its shard."""
        try:
            self._loaded += len(os.read(self._ready, 64))
        except BlockingIOError:
            pass
        return self._loaded >= len(self.procs)

    def poll(self) -> int | None:
        """1 once a rank has ended otherwise than told to stop (the driver gone, a failure); 0 once every
        one was told to stop; else None."""
        codes = [proc.poll() for proc in self.procs]
        if any(code not in (None, 0) for code in codes):
            return 1
        return None if None in codes else 0

    def close(self) -> None:
        """Kills the ranks still running (they ignore SIGTERM: the driver stops them, and without this
        node's ranks the driver's engine is dead anyway)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
        os.close(self._ready)

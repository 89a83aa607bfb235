"""Multi-node tensor parallelism as two "nodes" on one machine: two `pagoda serve` process trees with
--nnodes 2 --node-rank 0|1 over gloo on 127.0.0.1 (node 0: the server and rank 0; node 1: rank 1).
Greedy float32 output token-identical to one rank; node 1 killed mid-stream fails node 0's calls and
server, node 0 killed ends node 1, and no process is left on either."""
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from grpc_fixtures import ServeProcess, assert_all_gone, children, rendezvous_port
from pagoda.client.client import Client
from pagoda.engine import LLM, EngineConfig, SamplingParams

pytestmark = pytest.mark.timeout(300)

PROMPTS = [[5, 9, 200, 14], list(range(3, 40))]



def _nodes(path: str, *node0_flags: str) -> tuple[ServeProcess, ServeProcess]:
    common = ["--model", path, "--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "64",
              "--max-model-len", "512", "--tensor-parallel-size", "2", "--nnodes", "2",
              "--master-addr", "127.0.0.1", "--master-port", str(rendezvous_port()), "--grace-period", "5"]
    with ThreadPoolExecutor(2) as pool:  # both start at once, as two machines would
        started = [pool.submit(ServeProcess, *common, "--node-rank", "0", *node0_flags),
                   pool.submit(ServeProcess, *common, "--node-rank", "1")]
    if any(f.exception() for f in started):
        for f in started:
            if not f.exception():
                f.result().kill()
        raise next(f.exception() for f in started if f.exception())
    return started[0].result(), started[1].result()


def _tree(pid: int) -> list[int]:
    """pid and its descendants."""
    pids = [pid]
    for child in children(pid):
        pids += _tree(child)
    return pids


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_two_nodes_match_one_rank_and_a_dead_node_fails_the_server(checkpoint):
    path = checkpoint("llama")
    llm = LLM(path, dtype="float32", num_kv_blocks=64)
    try:
        want = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12,
                                                                          ignore_eos=True))]
    finally:
        llm.engine.close()
    node0, node1 = _nodes(path, "--engine-process", "on")  # as users run node 0: the engine in a child
    pids = []
    try:
        node0.wait_ready(120)
        node1.wait_ready(30)  # its ranks loaded: health SERVING
        pids = _tree(node0.proc.pid) + _tree(node1.proc.pid)
        assert len(_tree(node1.proc.pid)) == 2  # node 1: its process and rank 1
        with Client(node0.target, timeout=60) as c:
            for ids, tokens in zip(PROMPTS, want):
                assert list(c.generate(ids, max_tokens=12, temperature=0, ignore_eos=True).token_ids) == tokens
            stream = c.generate_stream("Hello", max_tokens=400, ignore_eos=True)
            assert next(stream).token_ids
            os.kill(node1.proc.pid, signal.SIGKILL)  # node 1's process; its rank must not outlive it
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                for _ in stream:
                    pass
            assert time.monotonic() - t0 < 60  # within tp_timeout_s (120 s): the closed connection says so
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
            assert "tensor-parallel rank 1" in e.value.details(), e.value.details()
        assert node0.proc.wait(60) == 1  # node 0 drained and exited with an error
        assert_all_gone(pids, timeout=30)  # before the cleanup below kills what is left
    finally:
        _kill(pids)
        node0.kill()
        node1.kill()


def test_node_0_killed_ends_node_1(checkpoint):
    node0, node1 = _nodes(checkpoint("llama"))
    pids = []
    try:
        node0.wait_ready(120)
        node1.wait_ready(30)
        pids = _tree(node0.proc.pid) + _tree(node1.proc.pid)
        node1_pids = _tree(node1.proc.pid)
        _kill(_tree(node0.proc.pid))  # the machine goes: every process of node 0 at once
        assert node1.proc.wait(60) == 1
        assert_all_gone(node1_pids, timeout=30)
        time.sleep(0.5)  # the last log lines
        assert "node 0 is gone" in node1.output()
    finally:
        _kill(pids)
        node0.kill()
        node1.kill()


def test_flags_that_do_not_fit_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 must be a multiple of nnodes 2 "
                                         r"\(--tensor-parallel-size, --nnodes\)"):
        EngineConfig(tensor_parallel_size=3, nnodes=2, master_port=29500)
    with pytest.raises(ValueError, match=r"master_port \(--master-port\) is required with nnodes > 1"):
        EngineConfig(tensor_parallel_size=2, nnodes=2)
    with pytest.raises(ValueError, match=r"node_rank \(--node-rank\) must be in 0..nnodes-1 \(1\), got 2"):
        EngineConfig(tensor_parallel_size=2, nnodes=2, node_rank=2, master_port=29500)

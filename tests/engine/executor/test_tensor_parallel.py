"""Tensor parallelism on CPU (gloo, 2 ranks): greedy output token-identical to one rank for every
supported family (tiny checkpoints with peaky weights, float32), with fewer KV heads than ranks, with
chunked prefill and preemption, over gRPC too; sizes that do not divide are refused at start; a rank
killed mid-stream fails the calls and the server cleanly (no hang, no process left behind)."""
import datetime
import multiprocessing
import os
import signal
import time

import grpc
import pytest
import torch

from conftest import FAMILIES
from grpc_fixtures import InProcessServer, ServeProcess, assert_all_gone, engine_config
from pagoda.client.client import Client
from pagoda.engine import LLM, SamplingParams
from pagoda.engine.demo import build_tiny_checkpoint
from pagoda.engine.executor.workers import process_group

pytestmark = pytest.mark.timeout(300)

PROMPTS = [[5, 9, 200, 14], list(range(3, 40)), list(range(100, 121))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _greedy(path, **options):
    llm = LLM(path, dtype="float32", **options)
    try:
        outs = llm.generate(PROMPTS, GREEDY)
        return [o.token_ids for o in outs], llm.engine.scheduler.num_preemptions
    finally:
        llm.engine.close()


# OLMo 2's q/k norms span every head: refused under tensor parallelism (below)
@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"olmo2"}))
def test_two_ranks_match_one_for_every_family(checkpoint, family):
    path = checkpoint(family)
    want, _ = _greedy(path, num_kv_blocks=64)
    got, _ = _greedy(path, num_kv_blocks=64, tensor_parallel_size=2)
    assert got == want
    # chunked prefill (16-token steps) and preemption (14 blocks of 4 hold fewer than the 3 requests; a model
    # whose every layer slides holds only its window's: 10 then; Gemma's and gpt-oss's blocks hold one of their
    # two KV groups, the sliding one a window's: 20 then)
    tight, preempted = _greedy(path, num_kv_blocks={"mistral": 10, "gemma2": 20, "gemma3": 20, "gpt_oss": 20}.get(
                               family, 14),
                               block_size=4, max_num_batched_tokens=16, tensor_parallel_size=2)
    assert tight == want and preempted > 0


def test_olmo2_is_refused_across_ranks_naming_the_flag(checkpoint):
    with pytest.raises(ValueError, match="OLMo 2.*--tensor-parallel-size 1"):
        LLM(checkpoint("olmo2"), num_kv_blocks=16, tensor_parallel_size=2)


def test_fewer_kv_heads_than_ranks_are_replicated(tmp_path):
    path = build_tiny_checkpoint(str(tmp_path / "mqa"), "llama", initializer_range=0.3, num_key_value_heads=1)
    want, _ = _greedy(path, num_kv_blocks=64)
    got, _ = _greedy(path, num_kv_blocks=64, tensor_parallel_size=2)
    assert got == want


def test_a_size_that_does_not_divide_is_refused_before_any_rank_starts(checkpoint):
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 must divide the number of attention heads \(4\)"):
        LLM(checkpoint("llama"), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM(checkpoint("llama"), tensor_parallel_size=0)


def test_grpc_with_two_ranks(checkpoint):
    path = checkpoint("qwen2")
    want, _ = _greedy(path, num_kv_blocks=64)
    srv = InProcessServer.for_config(engine_config(path, tensor_parallel_size=2, num_kv_blocks=64)).wait_ready()
    try:
        with Client(srv.target, timeout=60) as c:
            for ids, tokens in zip(PROMPTS, want):
                r = c.generate(ids, max_tokens=12, temperature=0, ignore_eos=True)
                assert list(r.token_ids) == tokens
                streamed = [t for m in c.generate_stream(ids, max_tokens=12, temperature=0, ignore_eos=True)
                            for t in m.token_ids]
                assert streamed == tokens
    finally:
        srv.stop()
    assert srv.engine.core.workers.procs[0].poll() is not None  # the rank ended with the server


def _rank_pids(server_pid: int) -> list[int]:
    """Processes running `pagoda.engine.executor.rank` below the server (its engine process's children)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{ppid}/stat") as f:
                grandparent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"pagoda.engine.executor.rank" in cmd and server_pid in (ppid, grandparent):
            pids.append(int(entry))
    return pids


def test_killing_a_rank_mid_stream_fails_the_calls_and_the_server(checkpoint):
    srv = ServeProcess("--model", checkpoint("llama"), "--engine-process", "on", "--tensor-parallel-size", "2", "--num-kv-blocks", "64",
                       "--max-model-len", "512", "--grace-period", "5")
    try:
        srv.wait_ready()
        ranks = _rank_pids(srv.proc.pid)
        assert len(ranks) == 1
        with Client(srv.target, timeout=60) as c:
            stream = c.generate_stream("Hello", max_tokens=500, ignore_eos=True)
            assert next(stream).token_ids
            os.kill(ranks[0], signal.SIGKILL)
            with pytest.raises(grpc.RpcError) as e:
                for _ in stream:
                    pass
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
            assert "tensor-parallel rank 1 exited (code -9)" in e.value.details()
        assert srv.proc.wait(60) == 1  # the server drained and exited with an error
        time.sleep(0.5)  # the last log lines
        assert "tensor-parallel rank 1 exited" in srv.output()
    finally:
        srv.kill()
    assert_all_gone(ranks, timeout=30)


def test_a_hung_rank_fails_the_engine_within_its_timeout(checkpoint):
    """A rank that stops answering (SIGSTOP) is caught by the collectives' timeout."""
    config = engine_config(checkpoint("llama"), tensor_parallel_size=2, num_kv_blocks=64, tp_timeout_s=3.0)
    srv = InProcessServer.for_config(config).wait_ready()
    rank = srv.engine.core.workers.procs[0]
    try:
        with Client(srv.target, timeout=60) as c:
            stream = c.generate_stream("Hello", max_tokens=400, ignore_eos=True)
            assert next(stream).token_ids
            os.kill(rank.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                for _ in stream:
                    pass
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "tensor-parallel" in e.value.details()
            assert time.monotonic() - t0 < 50
            with pytest.raises(grpc.RpcError) as e:
                c.generate("Hello", max_tokens=2)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert c.health() == "NOT_SERVING"
    finally:
        os.kill(rank.pid, signal.SIGKILL)
        srv.stop()
    assert rank.wait(10) is not None


def test_serve_refuses_a_size_that_does_not_divide_in_one_line(checkpoint):
    srv = ServeProcess("--model", checkpoint("llama"), "--engine-process", "on", "--tensor-parallel-size", "3")
    try:
        assert srv.proc.wait(120) != 0
        time.sleep(0.5)
        lines = [line for line in srv.output().splitlines() if "ERROR" in line]
        assert lines and lines[0].endswith("loading the engine failed: tensor_parallel_size 3 must divide the number "
                                           "of attention heads (4)")
    finally:
        srv.kill()


def test_prompt_logprobs_and_structured_outputs_with_two_ranks(checkpoint):
    """The logits calls a step makes beyond sampling (prompt scoring, chunk by chunk) reach every rank."""
    from pagoda.engine.structured.manager import StructuredOutputs

    params = [SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=2),
              SamplingParams(temperature=0, max_tokens=30, structured_outputs=StructuredOutputs(regex="[a-z]{3}-[0-9]{2}"))]
    prompts = [[3 + i % 250 for i in range(297)], "Hello"]  # 297 prompt tokens: scored in two chunks
    results = []
    for tp in (1, 2):
        llm = LLM(checkpoint("llama"), dtype="float32", num_kv_blocks=64, tensor_parallel_size=tp)
        try:
            results.append(llm.generate(prompts, params))
        finally:
            llm.engine.close()
    one, two = results
    assert [o.token_ids for o in one] == [o.token_ids for o in two]
    a, b = one[0].prompt_logprobs[1:], two[0].prompt_logprobs[1:]
    assert len(a) == len(b) == 296
    assert [x.logprob for x in b] == pytest.approx([x.logprob for x in a], abs=1e-4)
    assert [x.top[0][0] for x in b] == [x.top[0][0] for x in a]


def test_sigterm_stops_every_rank(checkpoint):
    srv = ServeProcess("--model", checkpoint("llama"), "--engine-process", "on", "--tensor-parallel-size", "2", "--num-kv-blocks", "64")
    try:
        srv.wait_ready()
        ranks = _rank_pids(srv.proc.pid)
        assert len(ranks) == 1
        with Client(srv.target, timeout=60) as c:
            assert c.generate("Hello", max_tokens=4).usage.completion_tokens == 4
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0
    finally:
        srv.kill()
    assert_all_gone(ranks, timeout=30)


def _late_rank(port: int, delay_s: float, q) -> None:
    time.sleep(delay_s)  # still importing torch on a busy machine
    store = torch.distributed.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))
    pg = process_group(store, 1, 2, torch.device("cpu"), 2.0)
    x = torch.ones(2)
    pg.allreduce([x]).wait()
    q.put(x.tolist())
    time.sleep(60)  # hung: rank 0's next collective must time out


def test_a_rank_slower_to_start_than_the_collective_timeout_still_joins():
    """The ranks meet under the start's timeout; only collectives run under tp_timeout_s (a rank that
    took longer than that to import torch failed the engine's start in CI)."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=60))
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_late_rank, args=(store.port, 5.0, q))
    proc.start()
    try:
        pg = process_group(store, 0, 2, torch.device("cpu"), 2.0)
        x = torch.ones(2)
        pg.allreduce([x]).wait()
        assert x.tolist() == [2.0, 2.0] and q.get(timeout=60) == [2.0, 2.0]
        t0 = time.monotonic()
        with pytest.raises(RuntimeError):
            pg.allreduce([x]).wait()
        assert time.monotonic() - t0 < 50
    finally:
        proc.kill()
        proc.join(10)
    assert proc.exitcode is not None

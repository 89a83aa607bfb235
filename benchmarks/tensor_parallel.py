"""Tensor and pipeline parallelism's cost on this machine: offline throughput with the model split over N
ranks (tensor parallel) and in P stages (pipeline parallel, one rank each) against one rank, same workload,
same cores (one rank with every core's threads; N or P ranks with the cores shared among them), runs
alternating; where a split step's time goes on rank 0 (the model's collectives, sending the step to the
other ranks); the bytes moved per step; the step record sent over the ranks' sockets against a gloo
broadcast of the same bytes; and for the pipeline, the stages' micro-batches (tokens each, the share of
its time each stage was busy, and how many micro-batches stage 0 ran while stage 1 ran the previous one).

On one machine of C cores this shows the cost of the split (messages, point-to-point sends, Python per
micro-batch) at a fixed compute budget, never a speed-up: P stages of C/P threads do the same arithmetic as
one rank of C threads, and on 2 cores each stage has one thread. What a pipeline buys across machines (a
model that does not fit one, more memory for the KV cache) needs as many machines; docs/serving.md, "Across
nodes", has the bytes per token that then cross the network.

    python benchmarks/tensor_parallel.py --model-config tiny --num-requests 64 --input-len 32 256 --output-len 128 128 --repeats 3
"""
import argparse
import datetime
import json
import os
import pickle
import statistics
import sys
import time

import common
import torch


class Counted:
    """Wraps a function: calls, seconds, and the bytes of its first tensor argument."""

    def __init__(self, fn):
        self.fn, self.calls, self.seconds, self.bytes = fn, 0, 0.0, 0

    def __call__(self, x, *a, **kw):
        t0 = time.perf_counter()
        try:
            return self.fn(x, *a, **kw)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1
            self.bytes += x.numel() * x.element_size()


def run(llm, workload) -> float:
    from pagoda.engine import SamplingParams

    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for _, n in workload]
    t0 = time.perf_counter()
    outs = llm.generate([ids for ids, _ in workload], params)
    elapsed = time.perf_counter() - t0
    assert all(o.finish_reason == "length" for o in outs)
    return sum(len(o.token_ids) for o in outs) / elapsed


def where_time_goes(llm, workload) -> dict:
    """One split run with rank 0's collectives and step sends timed (per engine step)."""
    import pagoda.engine.executor.model_runner as runner_module
    from pagoda.engine.executor import parallel

    reduce, gather = Counted(parallel.all_reduce), Counted(parallel.all_gather_last)
    workers, engine = llm.engine.workers, llm.engine
    timers = {"send": 0.0, "step": 0.0, "steps": 0}
    sizes = []
    real_inputs, real_call, real_step = runner_module.step_inputs, workers.call, engine.step

    def step_inputs(*a):
        record = real_inputs(*a)
        sizes.append(len(pickle.dumps(record)))
        return record

    def call(method, *args, **kw):
        t0 = time.perf_counter()
        try:
            return real_call(method, *args, **kw)
        finally:
            timers["send"] += time.perf_counter() - t0

    def step(*a, **kw):
        t0 = time.perf_counter()
        try:
            return real_step(*a, **kw)
        finally:
            timers["step"] += time.perf_counter() - t0
            timers["steps"] += 1
    parallel.all_reduce, parallel.all_gather_last = reduce, gather
    runner_module.step_inputs, workers.call, engine.step = step_inputs, call, step
    try:
        run(llm, workload)
    finally:
        parallel.all_reduce, parallel.all_gather_last = reduce.fn, gather.fn
        runner_module.step_inputs = real_inputs
        del workers.call, engine.step
    n = timers["steps"]
    return {"steps": n, "step_ms": 1e3 * timers["step"] / n, "send_ms": 1e3 * timers["send"] / n,
            "all_reduce_ms": 1e3 * reduce.seconds / n, "all_reduces": reduce.calls / n,
            "all_reduce_bytes": reduce.bytes / n, "all_gather_ms": 1e3 * gather.seconds / n,
            "all_gather_bytes": gather.bytes / n, "step_record_bytes": statistics.mean(sizes) if sizes else 0}


def pipeline_detail(llm, workload) -> dict:
    """One pipeline run: its micro-batches (from the stages' own timestamps), their tokens and boundary bytes."""
    sizes = []
    engine = llm.engine
    real_submit = engine.runner.submit

    def submit(sched):
        sizes.append(sched.num_tokens)
        return real_submit(sched)
    engine.runner.submit = submit
    before = len(engine.runner.pipeline_times())
    t0 = time.monotonic()
    try:
        run(llm, workload)
    finally:
        del engine.runner.submit
    elapsed = time.monotonic() - t0
    times = [engine.runner.pipeline_times()] + engine.workers.call("pipeline_times")
    times = [t[before:] for t in times]
    busy = [sum(e - s for _, s, e in t) / elapsed for t in times]
    first, second = times[0], times[1]
    overlapped = sum(first[i + 1][1] < second[i][2] and second[i][1] < first[i + 1][2] for i in range(len(first) - 1))
    tokens = statistics.mean(sizes) if sizes else 0.0
    width = llm.engine.hf_config.hidden_size * llm.engine.dtype.itemsize
    return {"micro_batches": len(first), "tokens": tokens, "boundary_bytes": tokens * width, "busy": busy,
            "overlapped": overlapped / max(1, len(first) - 1)}


def socket_vs_broadcast(nbytes: int, repeats: int = 200) -> dict:
    """Send `nbytes` to one other process: over a multiprocessing connection (what pagoda does) and as a
    gloo broadcast (length, then payload), round trips timed on this side."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    store = torch.distributed.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    a, b = ctx.Pipe()
    proc = ctx.Process(target=_echo_peer, args=(b, store.port, repeats))
    proc.start()
    pg = torch.distributed.ProcessGroupGloo(store, 0, 2, datetime.timedelta(seconds=60))
    payload = os.urandom(nbytes)
    t0 = time.perf_counter()
    for _ in range(repeats):
        a.send_bytes(payload)
        a.recv_bytes()
    pipe = (time.perf_counter() - t0) / repeats
    buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    size = torch.tensor([nbytes])
    t0 = time.perf_counter()
    for _ in range(repeats):
        pg.broadcast(size, 0).wait()
        pg.broadcast(buf, 0).wait()
        pg.broadcast(size, 1).wait()  # the peer's answer, as the pipe's
    gloo = (time.perf_counter() - t0) / repeats
    proc.join(30)
    return {"bytes": nbytes, "socket_round_trip_us": 1e6 * pipe, "gloo_broadcast_round_trip_us": 1e6 * gloo}


def _echo_peer(conn, port: int, repeats: int) -> None:
    store = torch.distributed.TCPStore("127.0.0.1", port, 2, False)
    pg = torch.distributed.ProcessGroupGloo(store, 1, 2, datetime.timedelta(seconds=60))
    for _ in range(repeats):
        conn.send_bytes(conn.recv_bytes())
    size = torch.zeros(1, dtype=torch.int64)
    for _ in range(repeats):
        pg.broadcast(size, 0).wait()
        buf = torch.empty(int(size), dtype=torch.uint8)
        pg.broadcast(buf, 0).wait()
        pg.broadcast(size, 1).wait()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model_args(p)
    common.add_workload_args(p, num_requests=64, input_len=(32, 256), output_len=(128, 128))
    p.add_argument("--tensor-parallel-size", type=int, default=2)
    p.add_argument("--pipeline-parallel-size", type=int, default=2, help="stages of the pipeline run (0: none)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each, alternating; medians (default 3)")
    p.add_argument("--json", metavar="PATH")
    common.add_results_args(p)
    return common.finish_args(p.parse_args(argv))


def main(argv=None) -> int:
    args = parse_args(argv)
    from pagoda.engine import LLM

    path = common.model_path(args)
    runs, warmup = common.workloads(args, path, repeats=args.repeats)
    cores = os.cpu_count() or 1
    tp = args.tensor_parallel_size
    one = LLM(path, dtype=args.dtype, quantization=common.quantization(args), device=args.device,
              enable_prefix_caching=False,
              cpu_threads=args.threads or cores)
    split = LLM(path, dtype=args.dtype, quantization=common.quantization(args), device=args.device,
                enable_prefix_caching=False,
                tensor_parallel_size=tp, cpu_threads=max(1, (args.threads or cores) // tp))
    pp = args.pipeline_parallel_size
    staged = LLM(path, dtype=args.dtype, quantization=common.quantization(args), device=args.device,
                 enable_prefix_caching=False, pipeline_parallel_size=pp,
                 cpu_threads=max(1, (args.threads or cores) // pp)) if pp > 1 else None
    try:
        for llm in (one, split, staged):
            if llm is not None:
                run(llm, warmup)
        singles, splits, stageds = [], [], []
        for workload in runs:
            singles.append(run(one, workload))
            splits.append(run(split, workload))
            if staged is not None:
                stageds.append(run(staged, workload))
        detail = where_time_goes(split, runs[0])
        stages = pipeline_detail(staged, runs[0]) if staged is not None else None
    finally:
        split.engine.close()
        if staged is not None:
            staged.engine.close()
    record = socket_vs_broadcast(int(detail["step_record_bytes"]) or 1024)
    a, b = statistics.median(singles), statistics.median(splits)
    result = {"tp1_tok_s": a, f"tp{tp}_tok_s": b, "ratio": b / a, "detail": detail, "record": record,
              "tp1_runs": singles, f"tp{tp}_runs": splits}
    d = detail
    rows = [[f"1 rank, {args.threads or cores} threads", f"{a:.0f}", "1.00"],
            [f"TP {tp}: {tp} ranks, {max(1, (args.threads or cores) // tp)} thread(s) each", f"{b:.0f}", f"{b / a:.2f}"]]
    if stages is not None:
        c = statistics.median(stageds)
        result.update({f"pp{pp}_tok_s": c, "pp_ratio": c / a, f"pp{pp}_runs": stageds, "pipeline": stages})
        rows.append([f"PP {pp}: {pp} stages, {max(1, (args.threads or cores) // pp)} thread(s) each", f"{c:.0f}",
                     f"{c / a:.2f}"])
    body = common.markdown_table(["run", "tokens/s (median)", "ratio"], rows)
    body += (f"\n\nSplit run, rank 0, per engine step ({d['steps']} steps, {d['step_ms']:.2f} ms each): "
             f"{d['all_reduces']:.0f} all-reduces, {d['all_reduce_ms']:.2f} ms, {d['all_reduce_bytes'] / 1024:.0f} KiB; "
             f"logits all-gather {d['all_gather_ms']:.2f} ms, {d['all_gather_bytes'] / 1024:.0f} KiB (this rank's "
             f"share); the step record to each other rank {d['step_record_bytes'] / 1024:.1f} KiB, sent in "
             f"{d['send_ms']:.3f} ms. "
             f"That record, round trip to one other process: over the ranks' socket "
             f"{record['socket_round_trip_us']:.0f} us, as a gloo broadcast {record['gloo_broadcast_round_trip_us']:.0f} us.")
    if stages is not None:
        body += (f"\n\nPipeline run: {stages['micro_batches']} micro-batches of {stages['tokens']:.1f} tokens on "
                 f"average, {stages['boundary_bytes'] / 1024:.1f} KiB across each stage boundary per micro-batch; "
                 f"stages busy {', '.join(f'{b:.0%}' for b in stages['busy'])} of the run; stage 0 ran micro-batch "
                 f"i+1 while stage 1 ran i for {stages['overlapped']:.0%} of them.")
    print(body)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if not args.no_results:
        common.append_results(args.results, f"tensor and pipeline parallelism on CPU (TP {tp}, PP {pp} vs 1 rank)",
                              body)
    return 0


if __name__ == "__main__":
    sys.exit(main())

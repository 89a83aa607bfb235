"""The cost of publishing KV-cache events: offline throughput with --kv-events-config on (a subscriber reading
every batch in a thread) against off, two engines in one process, rounds alternating between them. Prompts
share nothing and the cache is small, so every request stores blocks and evicts others'.

    python benchmarks/kv_events.py --threads 1                 # tiny model, 5 rounds of 32 requests
    python benchmarks/kv_events.py --no-results --rounds 1     # a smoke run
"""
import argparse
import statistics
import tempfile
import threading
import time

import zmq
from common import (add_model_args, add_results_args, add_workload_args, append_results, finish_args, markdown_table,
                    model_path, quantization, workloads)

from pagoda.engine import LLM, SamplingParams


class Reader:
    """A subscriber that reads (and counts) every message until stopped."""

    def __init__(self, endpoint: str):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.num_messages, self.stop = 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if self.sub.poll(50):
                self.sub.recv_multipart()
                self.num_messages += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sub.close(linger=0)
        self.ctx.term()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    add_workload_args(p, num_requests=32, input_len=(64, 512), output_len=(32, 32))
    add_results_args(p)
    p.add_argument("--rounds", type=int, default=5, help="rounds per side, alternating (default: 5)")
    p.add_argument("--num-kv-blocks", type=int, default=256, help="a small cache: requests evict each other")
    p.add_argument("--no-progress", action="store_true", help="accepted for symmetry with the other scripts")
    args = finish_args(p.parse_args())
    path = model_path(args)
    runs, warmup = workloads(args, path, repeats=args.rounds)
    endpoint = f"ipc://{tempfile.mkdtemp(prefix='pagoda-kv-')}/events"
    common = dict(dtype=args.dtype, device=args.device, quantization=quantization(args),
                  num_kv_blocks=args.num_kv_blocks)
    sides = {"off": LLM(path, **common),
             "on": LLM(path, **common, kv_events_config={"enable_kv_cache_events": True, "endpoint": endpoint})}
    reader = Reader(endpoint)
    times = {name: [] for name in sides}
    tokens = 0
    try:
        for name, llm in sides.items():
            llm.generate([w[0] for w in warmup], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        for r, work in enumerate(runs):
            order = ("off", "on") if r % 2 == 0 else ("on", "off")
            params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
            for name in order:
                t0 = time.perf_counter()
                sides[name].generate([w[0] for w in work], params, use_tqdm=False)
                times[name].append(time.perf_counter() - t0)
            tokens = sum(n for _, n in work)
        time.sleep(0.2)
    finally:
        for llm in sides.values():
            llm.engine.close()
        reader.close()
    rate = {name: tokens / statistics.median(t) for name, t in times.items()}
    ratios = [off / on for off, on in zip(times["off"], times["on"])]
    body = markdown_table(["events", "median round (s)", "output tok/s", "rounds (s)"],
                          [(name, f"{statistics.median(t):.3f}", f"{rate[name]:.1f}", " ".join(f"{x:.3f}" for x in t))
                           for name, t in times.items()])
    body += (f"\n\nthroughput on / off: **{rate['on'] / rate['off']:.3f}** (medians); per round: "
             f"{' '.join(f'{x:.3f}' for x in ratios)}; batches read by the subscriber: {reader.num_messages}\n")
    print(body)
    if not args.no_results:
        append_results(args.results, "KV-cache events on vs off (kv_events.py)", body)


if __name__ == "__main__":
    main()

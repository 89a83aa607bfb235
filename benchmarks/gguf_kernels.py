"""pagoda's GGUF linear kernel (engine/layers/csrc/gguf_cpu.cpp, op gguf_linear) per block type: GB/s of
weights read per call for a few rows (decode), at the threads given (default 1). Shapes of Qwen2.5-0.5B
(hidden 896, not a multiple of 256, so llama-quantize's Q4_K_M stores most tensors in Q5_0): gate/up
[4864, 896] by default (the K-quants: [4864, 768]). Types alternate call by call (Q8_0, Q4_0, Q5_0, ...), best of --repeats rounds.

    python benchmarks/gguf_kernels.py --threads 1 --rows 1 4
    python benchmarks/gguf_kernels.py --shape 896 4864 --types Q5_0 Q8_0

measure() takes any number of op namespaces (say, a build of an older gguf_cpu.cpp loaded under another
name) so that before/after runs interleave in one process.
"""
import argparse
import os
import sys
import time

import numpy as np

import common

TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K"]


def random_blocks(qtype, out: int, k: int, rng) -> np.ndarray:
    """Valid blocks: random bytes with sane f16 scales (gguf_fixtures' recipe, quantizing is slow)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from gguf import GGML_QUANT_SIZES
    from gguf_fixtures import _SCALES, blocks
    if qtype in _SCALES:
        return blocks(np.zeros((out, k), np.float32), qtype, rng)
    n, size = GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, (out, k // n, size), dtype=np.uint8)
    scales = (0.01 * rng.uniform(0.5, 1.5, b.shape[:2])).astype(np.float16).view(np.uint8)
    b[..., 0:2] = scales.reshape(*b.shape[:2], 2)
    if qtype.name in ("Q4_1", "Q5_1"):
        b[..., 2:4] = scales.reshape(*b.shape[:2], 2)
    return b.reshape(out, -1)


def _in(t: str, k: int) -> int:
    """The K-quants' super-blocks need a multiple of 256: k rounded down (768 for 896)."""
    return k // 256 * 256 if t.endswith("_K") else k


def measure(ops: dict, types: list[str], shape: tuple[int, int], rows: int, repeats: int, calls: int = 20,
            clock=time.perf_counter) -> dict:
    """{(ops name, type): best GB/s of weights} over `repeats` rounds, each round every (ops, type) in turn.
    clock=time.thread_time (CPU time of this thread: right for 1 thread) discounts a busy machine's waits."""
    import torch
    from gguf import GGMLQuantizationType as Q
    out, k = shape
    rng = np.random.default_rng(0)
    weights = {t: torch.from_numpy(random_blocks(Q[t], out, _in(t, k), rng)) for t in types}
    xs = {t: torch.randn(rows, _in(t, k)) for t in types}
    best = {}
    for _ in range(repeats):
        for t in types:
            for name, op in ops.items():
                op.gguf_linear(xs[t], weights[t], int(Q[t]))  # warm
                t0 = clock()
                for _ in range(calls):
                    op.gguf_linear(xs[t], weights[t], int(Q[t]))
                gbs = weights[t].numel() * calls / (clock() - t0) / 1e9
                best[name, t] = max(best.get((name, t), 0.0), gbs)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", nargs="+", default=TYPES, choices=TYPES)
    p.add_argument("--shape", type=int, nargs=2, metavar=("OUT", "IN"), default=[4864, 896])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=["wall", "thread"], default="thread",
                   help="thread: this thread's CPU time (1 thread only; a busy machine's waits left out)")
    args = p.parse_args(argv)
    common.apply_threads(args.threads)
    from pagoda.engine.layers import cpu_ops
    ops = {"pagoda": cpu_ops.ops()}
    print(f"[{args.shape[0]}, {args.shape[1]}], {args.threads} thread(s), {args.clock} clock, GB/s of weights, best of {args.repeats}")
    print("type    " + "".join(f"{r:>4} row(s)" for r in args.rows))
    clock = time.thread_time if args.clock == "thread" and args.threads == 1 else time.perf_counter
    res = {r: measure(ops, args.types, tuple(args.shape), r, args.repeats, clock=clock) for r in args.rows}
    for t in args.types:
        print(f"{t:<8}" + "".join(f"{res[r]['pagoda', t]:>11.2f}" for r in args.rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

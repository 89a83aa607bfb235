"""pagoda's GGUF linear kernel (engine/layers/csrc/gguf_cpu.cpp, op gguf_linear) per block type: GB/s of
weights read per call for a few rows (decode), at the threads given (default 1). Shapes of Qwen2.5-0.5B
(hidden 896, not a multiple of 256, so llama-quantize's Q4_K_M stores most tensors in Q5_0): gate/up
[4864, 896] by default (the K-quants and IQ4_XS: [4864, 768]). Types alternate call by call (Q8_0, Q4_0,
Q5_0, ...), best of --repeats rounds.

    python benchmarks/gguf_kernels.py --threads 1 --rows 1 4
    python benchmarks/gguf_kernels.py --shape 896 4864 --types Q5_0 Q8_0

    python benchmarks/gguf_kernels.py --paths float integer   # both few-row paths of every type

measure() takes any number of op namespaces (say, a build of an older gguf_cpu.cpp loaded under another
name) and of the op's paths (auto: the type's, as gguf_cpu.cpp's integer_path table picks; float: dequantized
into L1; integer: 16-bit activations and integer dots) so that before/after runs interleave in one process.
"""
import argparse
import os
import sys
import time

import numpy as np

import common

PATHS = {"auto": -1, "float": 0, "integer": 1}  # gguf_linear's path argument
TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"]


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
    """Super-blocks (the K-quants', IQ4_XS's) need a multiple of 256: k rounded down (768 for 896)."""
    return k // 256 * 256 if t.endswith("_K") or t == "IQ4_XS" else k


def measure(ops: dict, types: list[str], shape: tuple[int, int], rows: int, repeats: int, calls: int = 20,
            clock=time.perf_counter, paths=("auto",)) -> dict:
    """{(ops name, type, path): best GB/s of weights} over `repeats` rounds, each round every (ops, type, path)
    in turn.
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
                for path in paths:
                    args = (xs[t], weights[t], int(Q[t]), PATHS[path])
                    try:
                        op.gguf_linear(*args)  # warm
                    except RuntimeError:  # a type without an integer path
                        best[name, t, path] = float("nan")
                        continue
                    t0 = clock()
                    for _ in range(calls):
                        op.gguf_linear(*args)
                    gbs = weights[t].numel() * calls / (clock() - t0) / 1e9
                    best[name, t, path] = max(best.get((name, t, path), 0.0), gbs)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", nargs="+", default=TYPES, choices=TYPES)
    p.add_argument("--shape", type=int, nargs=2, metavar=("OUT", "IN"), default=[4864, 896])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--paths", nargs="+", default=["auto"], choices=list(PATHS))
    p.add_argument("--clock", choices=["wall", "thread"], default="thread",
                   help="thread: this thread's CPU time (1 thread only; a busy machine's waits left out)")
    args = p.parse_args(argv)
    common.apply_threads(args.threads)
    from pagoda.engine.layers import cpu_ops
    ops = {"pagoda": cpu_ops.ops()}
    print(f"[{args.shape[0]}, {args.shape[1]}], {args.threads} thread(s), {args.clock} clock, GB/s of weights, best of {args.repeats}")
    cols = [(r, path) for r in args.rows for path in args.paths]
    print("type    " + "".join(f"{f'{r} row(s) {path}':>18}" for r, path in cols))
    clock = time.thread_time if args.clock == "thread" and args.threads == 1 else time.perf_counter
    res = {r: measure(ops, args.types, tuple(args.shape), r, args.repeats, clock=clock, paths=args.paths)
           for r in args.rows}
    for t in args.types:
        print(f"{t:<8}" + "".join(f"{res[r]['pagoda', t, path]:>18.2f}" for r, path in cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

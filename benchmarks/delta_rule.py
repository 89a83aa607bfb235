"""Time a linear-attention layer's kernels on CPU: pagoda's C++ ops (csrc/delta_rule_cpu.cpp) against the torch
reference (engine/layers/delta_rule.py), at Qwen3.5-4B's shape (16 key heads, 32 value heads, head dims 128,
conv kernel 4 over 2 * 16 * 128 + 32 * 128 = 8192 channels): a decode step of a batch and one prefill.

    python benchmarks/delta_rule.py                        # decode batch 16, one 512-token prefill, float32
    python benchmarks/delta_rule.py --dtype bf16 --threads 4 --decode-batch 32 --prefill 2048
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagoda.engine.layers import cpu_ops, delta_rule

NUM_K_HEADS, NUM_V_HEADS, HEAD_DIM, KERNEL = 16, 32, 128, 4  # transformers' Qwen3_5TextConfig defaults
CHANNELS = 2 * NUM_K_HEADS * HEAD_DIM + NUM_V_HEADS * HEAD_DIM


def median_ms(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def inputs(lens, dtype):
    n = sum(lens)
    qsl = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    slots = torch.arange(len(lens))
    x = torch.randn(n, CHANNELS).to(dtype)
    weight = torch.randn(CHANNELS, KERNEL).to(dtype)
    conv_state = torch.zeros(len(lens), CHANNELS, KERNEL - 1, dtype=dtype)
    q, k, v = x.split([NUM_K_HEADS * HEAD_DIM, NUM_K_HEADS * HEAD_DIM, NUM_V_HEADS * HEAD_DIM], dim=-1)
    q, k, v = q.view(n, NUM_K_HEADS, HEAD_DIM), k.view(n, NUM_K_HEADS, HEAD_DIM), v.view(n, NUM_V_HEADS, HEAD_DIM)
    g, beta = -torch.rand(n, NUM_V_HEADS), torch.rand(n, NUM_V_HEADS)
    state = torch.zeros(len(lens), NUM_V_HEADS, HEAD_DIM, HEAD_DIM)
    return (x, weight, conv_state, qsl, slots), (q, k, v, g, beta, state, qsl, slots)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--decode-batch", type=int, default=16)
    p.add_argument("--prefill", type=int, default=512, help="tokens of the one prefill")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ok, why = cpu_ops.is_available(torch.device("cpu"))
    if not ok:
        print(why, file=sys.stderr)
        return 2
    ops = cpu_ops.ops()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    print(f"{torch.get_num_threads()} threads, {args.dtype}, CPU {torch.backends.cpu.get_cpu_capability()}")
    print(f"{'case':24s} {'op':18s} {'torch ms':>10s} {'C++ ms':>10s} {'speed-up':>9s}")
    for case, lens in ((f"decode x{args.decode_batch}", [1] * args.decode_batch), (f"prefill {args.prefill}",
                                                                                   [args.prefill])):
        conv_args, rule_args = inputs(lens, dtype)
        for name, ref, op, a in (("causal_conv1d", delta_rule.causal_conv1d_reference, ops.causal_conv1d_, conv_args),
                                 ("gated_delta_rule", delta_rule.gated_delta_rule_reference, ops.gated_delta_rule_,
                                  rule_args)):
            ref_ms = median_ms(lambda ref=ref, a=a: ref(*a), args.reps)
            op_ms = median_ms(lambda op=op, a=a: op(*a), args.reps)
            print(f"{case:24s} {name:18s} {ref_ms:10.2f} {op_ms:10.2f} {ref_ms / op_ms:8.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

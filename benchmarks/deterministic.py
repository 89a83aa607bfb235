"""Deterministic mode (`LLM(..., deterministic=True)`, `pagoda serve --deterministic`): what it costs
and what it buys.

- speed (default): the offline workload and a single stream, deterministic over default, both engines
  loaded once and their runs interleaved (a shared machine's load then weighs on both alike).
- `--variance`: tests/deterministic_cases.py's probes alone, in batches of 2, 7 and 64 mixed requests,
  with prefill chunked at 16 tokens, from the prefix cache and after preemptions, with the mode off and on:
  the largest |logprob difference| from the probe alone.
- `--ops`: which operators compute a row differently depending on how many rows the call holds (the
  sources of the variance), on this machine and ISA (ATEN_CPU_CAPABILITY=avx2 for torch's AVX2 code,
  ONEDNN_MAX_CPU_ISA=AVX2 for oneDNN's).

    python benchmarks/deterministic.py --model-config tiny --num-requests 64 --input-len 32 256 --output-len 128 128 --repeats 3
    python benchmarks/deterministic.py --variance --ops --no-results
"""
import argparse
import os
import statistics
import sys
import time

import common

sys.path.insert(0, os.path.join(common.ROOT, "tests"))


def throughput(llm, workload) -> float:
    from pagoda.engine import SamplingParams
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for _, n in workload]
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in workload], params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


def speed(args) -> str:
    from pagoda.engine import LLM
    from single_stream import decode_rate
    path = common.model_path(args)
    engines = {name: LLM(path, dtype=args.dtype, enable_prefix_caching=False, deterministic=det)
               for name, det in (("default", False), ("deterministic", True))}
    runs, warmup = common.workloads(args, path, repeats=args.repeats)
    prompt = runs[0][0][0][:128]
    for llm in engines.values():
        throughput(llm, warmup)
    tput = {name: [] for name in engines}
    single = {name: [] for name in engines}
    for i, workload in enumerate(runs):
        order = list(engines) if i % 2 == 0 else list(engines)[::-1]
        for name in order:
            tput[name].append(throughput(engines[name], workload))
        for name in order:
            single[name].append(decode_rate(engines[name], prompt, args.single_stream_tokens))
    rows = []
    for what, v in (("offline workload, generated tokens/s", tput), ("single stream, decode tokens/s", single)):
        ratios = [b / a for a, b in zip(v["default"], v["deterministic"])]  # each round's pair: alike load
        rows.append([what, f"{statistics.median(v['default']):.0f}", f"{statistics.median(v['deterministic']):.0f}",
                     f"**{statistics.median(ratios):.2f}**", " / ".join(f"{r:.2f}" for r in ratios),
                     " / ".join(f"{x:.0f}" for x in v["default"]), " / ".join(f"{x:.0f}" for x in v["deterministic"])])
    body = common.markdown_table(["", "default (median)", "deterministic (median)", "ratio (median of rounds)",
                                  "each round's ratio", "default runs", "deterministic runs"], rows)
    return body + (f"\n\n{args.num_requests} requests, prompts {args.input_len[0]}..{args.input_len[1]} tokens, "
                   f"{args.output_len[0]}..{args.output_len[1]} new tokens, greedy, prefix caching off, "
                   f"{args.dtype}; single stream: a 128-token prompt, {args.single_stream_tokens} new tokens. "
                   f"Medians of {args.repeats} runs each, the two modes interleaved in one process.")


def variance(args) -> str:
    import deterministic_cases as cases
    path = common.model_path(args) if args.model else common.cached_checkpoint("tiny")
    rows = []
    for det in (False, True):
        results = cases.scenarios(path, deterministic=det, dtype=args.dtype)
        alone = results.pop("alone")
        rows.append([f"deterministic {'on' if det else 'off'}"] + [
            f"{max(map(cases.max_logprob_diff, alone, sigs)):.3g}" + ("" if sigs == alone else " (differs)")
            for sigs in results.values()])
    return common.markdown_table(["max \\|logprob diff\\| from alone", *results], rows)


def ops_table() -> str:
    """Operators, each over the same rows in calls of 1..300 rows: the call sizes where a row came out
    different from the same row in a 300-row call."""
    import torch
    import torch.nn.functional as F

    from pagoda.engine.layers import cpu_ops, deterministic
    sizes = [1, 2, 3, 4, 5, 7, 9, 11, 16, 33, 64, 100, 255]
    g = torch.Generator().manual_seed(0)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(688, 256, generator=g).to(dtype)
        try:
            invariant = deterministic.BatchInvariantLinear(w, None)
        except ValueError as e:  # bfloat16 without AVX-512
            rows.append(["deterministic BatchInvariantLinear, 256 -> 688", str(dtype).removeprefix("torch."), str(e)])
            invariant = None
        cands = {
            "F.linear (MKL fp32 / oneDNN bf16), 256 -> 688": lambda x, w=w.t().contiguous().t(): F.linear(x, w),
            "deterministic BatchInvariantLinear, 256 -> 688": invariant,
            "torch SiLU, 688 wide": lambda x: F.silu(x[:, :688] if x.shape[1] >= 688 else x),
            "pagoda fused silu_and_mul, 688 wide": lambda x: cpu_ops.silu_and_mul(torch.cat([x, x], -1)[:, :1376]),
            "log_softmax, 256 wide": lambda x: x.float().log_softmax(-1),
        }
        x = (torch.randn(300, 256, generator=g) * 3).to(dtype)
        wide = (torch.randn(300, 688, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
        for name, f in cands.items():
            if f is None:
                continue
            inp = wide if "688 wide" in name else x
            ref = f(inp)
            bad = [m for m in sizes if not torch.equal(f(inp[300 - m:]), ref[300 - m:])]
            rows.append([name, str(dtype).removeprefix("torch."), ", ".join(map(str, bad)) or "none"])
    rows += _attention_rows()
    return common.markdown_table(["operator", "dtype", "call sizes (rows) where a row differs"], rows) + (
        f"\n\ntorch's {torch.backends.cpu.get_cpu_capability()} code, {torch.get_num_threads()} threads.")


def _attention_rows() -> list:
    """pagoda's paged attention: a prompt's tokens in one prefill call against each as a decode step."""
    import torch

    from pagoda.engine.layers.cpu_attention import cache_views, ops
    g = torch.Generator().manual_seed(0)
    rows = []
    for invariant in (False, True):
        for dtype in (torch.float32, torch.bfloat16):
            n = 40
            k_cache, v_cache = (torch.randn(4, 16, 2, 64, generator=g).to(dtype) for _ in range(2))
            kc, vc = cache_views(k_cache, v_cache)
            q = torch.randn(n, 4, 64, generator=g).to(dtype)
            table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
            whole = ops().paged_attention(q, kc, vc, table, torch.tensor([0, n], dtype=torch.int32),
                                          torch.tensor([n], dtype=torch.int32), 0.125, invariant)
            bad = [t for t in range(n) if not torch.equal(
                ops().paged_attention(q[t:t + 1], kc, vc, table, None, torch.tensor([t + 1], dtype=torch.int32),
                                      0.125, invariant)[0], whole[t])]
            rows.append([f"paged attention{' (batch_invariant)' if invariant else ''}: prefill vs decode, "
                         f"head_dim 64", str(dtype).removeprefix("torch."),
                         f"{len(bad)} of {n} prompt tokens differ from their decode" if bad else "none"])
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model_args(p)
    common.add_workload_args(p, num_requests=64, input_len=(32, 256), output_len=(128, 128))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--single-stream-tokens", type=int, default=64)
    p.add_argument("--variance", action="store_true", help="the variance table (mode off and on)")
    p.add_argument("--ops", action="store_true", help="the per-operator table")
    common.add_results_args(p)
    args = common.finish_args(p.parse_args(argv))
    parts = []
    if args.ops:
        parts.append(("where the variance comes from", ops_table()))
    if args.variance:
        parts.append(("what it buys", variance(args)))
    if not (args.ops or args.variance):
        parts.append(("deterministic over default", speed(args)))
    for title, body in parts:
        print(f"\n{title}\n\n{body}")
        if not args.no_results:
            common.append_results(args.results, f"deterministic mode: {title}", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())

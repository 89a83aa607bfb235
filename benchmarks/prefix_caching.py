"""Shared-prefix workload: N requests share one long system prompt, each adds its own tokens.
Runs the same requests with prefix caching off and on, in one process, and reports prompt
tokens computed and time to first token.

    python benchmarks/prefix_caching.py                      # 64 x (1000 shared + 32 own) tokens
    python benchmarks/prefix_caching.py --results benchmarks/results/log.md
"""
import argparse
import asyncio
import datetime
import os
import platform
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from pagoda.engine import AsyncEngine, EngineConfig, SamplingParams  # noqa: E402


def workload(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    system = [rng.randrange(256) for _ in range(args.prefix_len)]
    return [system + [rng.randrange(256) for _ in range(args.own_len)] for _ in range(args.num_requests)]


async def run(engine: AsyncEngine, prompts, max_tokens: int) -> list[float]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()

    async def one(prompt) -> float:
        ttft = None
        async for _ in engine.generate(prompt, params):
            ttft = ttft if ttft is not None else time.perf_counter() - start
        return ttft
    return await asyncio.gather(*[one(p) for p in prompts])


def measure(args, caching: bool, prompts) -> dict:
    engine = AsyncEngine(EngineConfig(model=args.model, enable_prefix_caching=caching,
                                      max_num_batched_tokens=args.max_num_batched_tokens))
    engine.start()
    try:
        asyncio.run(run(engine, [prompts[0][:8]], 2))  # warm-up, shares nothing with the workload
        before = engine.engine.stats().num_prompt_tokens_processed
        t0 = time.perf_counter()
        ttfts = asyncio.run(run(engine, prompts, args.max_tokens))
        wall = time.perf_counter() - t0
        return dict(caching=caching, prompt_tokens_computed=engine.engine.stats().num_prompt_tokens_processed - before,
                    mean_ttft_s=statistics.mean(ttfts), p50_ttft_s=statistics.median(ttfts),
                    wall_s=wall, hit_rate=engine.stats().prefix_cache_hit_rate)
    finally:
        engine.shutdown()


def table(rows: list[dict]) -> str:
    off, on = rows
    lines = ["| prefix caching | prompt tokens computed | mean TTFT (s) | p50 TTFT (s) | wall (s) |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {'on' if r['caching'] else 'off'} | {r['prompt_tokens_computed']} | "
                     f"{r['mean_ttft_s']:.3f} | {r['p50_ttft_s']:.3f} | {r['wall_s']:.2f} |")
    lines.append(f"\nmean TTFT off / on: **{off['mean_ttft_s'] / on['mean_ttft_s']:.1f}x**; prompt tokens "
                 f"computed off / on: {off['prompt_tokens_computed'] / on['prompt_tokens_computed']:.1f}x")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory or hub id (default: the demo model)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=1000)
    p.add_argument("--own-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", help="append a section to this markdown file")
    args = p.parse_args()
    prompts = workload(args)
    rows = [measure(args, False, prompts), measure(args, True, prompts)]
    out = table(rows)
    print(out)
    if args.results:
        machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
                   + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", CPU only"))
        with open(args.results, "a") as f:
            f.write(f"\n## Prefix caching, {datetime.date.today()}\n\n`python {' '.join(sys.argv)}`\n\n"
                    f"Machine: {machine}. Model: {args.model or 'built-in demo (Llama, hidden 256, 4 layers)'}; "
                    f"{args.num_requests} requests of {args.prefix_len} shared + {args.own_len} own tokens, "
                    f"{args.max_tokens} new tokens each.\n\n{out}\n")


if __name__ == "__main__":
    main()

"""Time per output token as the context grows, one sequence at a time: a hybrid linear-attention model
(three in four layers keep a fixed-size state) against a full-attention one of the same width.

    python benchmarks/long_context.py --models qwen3.5-4b-8l qwen3-4b-8l --context 1024 8192 32768
"""
import argparse
import os
import sys

import common


def time_per_token(llm, pool, context: int, new_tokens: int) -> tuple[float, float]:
    """(prefill seconds, seconds per output token after the first) for one prompt of `context` tokens."""
    from pagoda.engine import SamplingParams

    prompt = [int(pool[(j * 7919) % len(pool)]) for j in range(context)]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=new_tokens))[0]
    m = out.metrics
    return m.first_token_time - m.first_scheduled_time, (m.finished_time - m.first_token_time) / (new_tokens - 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model_args(p)
    p.add_argument("--models", nargs="+", default=["qwen3.5-4b-8l", "qwen3-4b-8l"],
                   help="model configs (benchmarks/common.py MODEL_CONFIGS) or checkpoint directories")
    p.add_argument("--context", type=int, nargs="+", default=[1024, 8192, 32768])
    p.add_argument("--new-tokens", type=int, default=32)
    common.add_results_args(p)
    args = common.finish_args(p.parse_args(argv))
    from pagoda.engine import LLM

    rows = []
    for name in args.models:
        path = name if os.path.isdir(name) else common.cached_checkpoint(name)
        longest = max(args.context) + args.new_tokens
        llm = LLM(path, dtype=args.dtype, device=args.device, max_model_len=longest, max_num_seqs=1,
                  enable_prefix_caching=False, kv_cache_memory=max(2**30, longest * 2**16))
        pool = common.token_pool(common.load_tokenizer(path))
        time_per_token(llm, pool, 64, 4)  # warm-up
        for context in args.context:
            prefill, per_token = time_per_token(llm, pool, context, args.new_tokens)
            rows.append([name, context, f"{prefill:.1f}", f"{per_token * 1000:.1f}", f"{1 / per_token:.2f}"])
            print(rows[-1], file=sys.stderr, flush=True)
        del llm
    table = common.markdown_table(["model", "context", "prefill s", "ms / output token", "tok/s"], rows)
    print(table)
    if not args.no_results:
        common.append_results(args.results, "Long context: time per output token",
                              f"{common.machine()}\n\n`{common.command_line()}`\n\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

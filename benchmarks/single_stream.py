"""One request at a time (the single-stream case): decode tokens/s with paged attention's
one-thread threshold for small calls on (the default) and off (`set_attention_min_work(0)`: every
call split over the threads), runs alternating, optionally while `--busy N` processes spin on the
CPU (a machine shared with other work, or `pagoda serve`'s front-end on the same cores).

    python benchmarks/single_stream.py --model-config tiny --busy 2 --repeats 5
"""
import argparse
import multiprocessing
import statistics
import sys
import time

import common


def _spin() -> None:
    while True:
        pass


def decode_rate(llm, prompt: list[int], new_tokens: int) -> float:
    from pagoda.engine import SamplingParams

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=new_tokens)
    t0 = time.perf_counter()
    llm.generate([prompt], params)
    return new_tokens / (time.perf_counter() - t0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model_args(p)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--busy", type=int, default=0, help="processes spinning on the CPU meanwhile (default 0)")
    p.add_argument("--repeats", type=int, default=5)
    common.add_results_args(p)
    args = common.finish_args(p.parse_args(argv))
    from pagoda.engine import LLM
    from pagoda.engine.layers import cpu_ops

    llm = LLM(common.model_path(args), dtype=args.dtype, quantization=common.quantization(args),
              device=args.device, enable_prefix_caching=False)
    pool = common.token_pool(common.load_tokenizer(common.model_path(args)))
    prompts = [[int(pool[(i * 7919 + j * 31) % len(pool)]) for j in range(args.prompt_len)]
               for i in range(2 * args.repeats + 1)]
    decode_rate(llm, prompts[-1], 8)  # warm-up
    spinners = [multiprocessing.get_context("spawn").Process(target=_spin, daemon=True) for _ in range(args.busy)]
    for s in spinners:
        s.start()
    rates = {"one thread below the threshold (default)": [], "always split (min work 0)": []}
    try:
        for i in range(args.repeats):
            for k, (name, work) in enumerate(zip(rates, (1 << 18, 0))):
                cpu_ops.ops().set_attention_min_work(work)
                rates[name].append(decode_rate(llm, prompts[2 * i + k], args.new_tokens))
    finally:
        cpu_ops.ops().set_attention_min_work(1 << 18)
        for s in spinners:
            s.kill()
    body = common.markdown_table(["paged attention", "tokens/s (median)", "every run"],
                                 [[name, f"{statistics.median(v):.0f}", " / ".join(f"{x:.0f}" for x in v)]
                                  for name, v in rates.items()])
    body += (f"\n\nOne request at a time, {args.prompt_len}-token prompt, {args.new_tokens} new tokens, greedy; "
             f"{args.busy} other processes spinning on the CPU meanwhile.")
    print(body)
    if not args.no_results:
        common.append_results(args.results, f"single stream, paged attention's one-thread threshold on/off "
                                            f"(busy {args.busy})", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())

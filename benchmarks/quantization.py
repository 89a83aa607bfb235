"""What a cheaper precision costs in accuracy: pagoda in float32 (the oracle-tested path) against
pagoda in other precisions (int8 weight-only, bfloat16, both) on the same greedy workload.

For each variant, over every completion token of the workload:
- free-running: share of requests whose whole greedy completion equals float32's, and share of
  tokens before a request's first difference (after one, the two continue from different text);
- teacher-forced: the variant scores float32's own prompt + completion (prompt_logprobs), so every
  position is judged on the same context: the share where float32's greedy token is also the
  variant's top-1 (rank 1), and the mean / max |logprob difference| of that token.

Random weights make near-ties common (a random model's next-token distribution is flat), so these
shares understate what a trained model keeps; the teacher-forced numbers are the fairer ones.

    python benchmarks/quantization.py --model-config qwen2.5-0.5b --num-requests 16 --input-len 128 128 --output-len 64 64
"""
import argparse
import gc
import json
import statistics

import common

VARIANTS = {"int8": ("float32", "int8"), "bfloat16": ("bfloat16", None), "bfloat16+int8": ("bfloat16", "int8")}


def completions(llm, workload) -> list[list[int]]:
    from pagoda.engine import SamplingParams
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for _, n in workload]
    return [list(o.token_ids) for o in llm.generate([ids for ids, _ in workload], params)]


def scored(llm, workload, outputs) -> list[list[tuple[float, int]]]:
    """(logprob, rank) of each completion token given everything before it."""
    from pagoda.engine import SamplingParams
    full = [ids + out for (ids, _), out in zip(workload, outputs)]
    res = llm.generate(full, SamplingParams(max_tokens=1, prompt_logprobs=0))
    return [[(lp.logprob, lp.rank) for lp in r.prompt_logprobs[len(ids):]] for r, (ids, _) in zip(res, workload)]


def compare(ref_out, ref_scores, out, scores) -> dict:
    same = [a == b for a, b in zip(ref_out, out)]
    prefix = []
    for a, b in zip(ref_out, out):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        prefix.append(k / len(a))
    diffs = [abs(x[0] - y[0]) for rs, ss in zip(ref_scores, scores) for x, y in zip(rs, ss)]
    top1 = [y[1] == 1 for ss in scores for y in ss]
    return {"requests_identical": sum(same) / len(same), "tokens_before_first_difference": statistics.mean(prefix),
            "teacher_forced_top1": sum(top1) / len(top1), "mean_abs_logprob_diff": statistics.mean(diffs),
            "max_abs_logprob_diff": max(diffs)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model_args(p)
    common.add_workload_args(p, num_requests=16, input_len=(128, 128), output_len=(64, 64))
    p.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=["int8", "bfloat16"])
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    common.add_results_args(p)
    args = common.finish_args(p.parse_args(argv))
    from pagoda.engine import LLM

    path = common.model_path(args)
    workload, _ = common.workloads(args, path)

    def engine(dtype, quantization):
        return LLM(path, dtype=dtype, quantization=quantization, device=args.device, enable_prefix_caching=False)

    llm = engine("float32", None)
    ref_out = completions(llm, workload)
    ref_scores = scored(llm, workload, ref_out)
    del llm
    rows, results = [], {}
    for name in args.variants:
        gc.collect()
        llm = engine(*VARIANTS[name])
        r = compare(ref_out, ref_scores, completions(llm, workload), scored(llm, workload, ref_out))
        del llm
        results[name] = r
        rows.append([name, f"{100 * r['requests_identical']:.0f}%", f"{100 * r['tokens_before_first_difference']:.0f}%",
                     f"{100 * r['teacher_forced_top1']:.1f}%", f"{r['mean_abs_logprob_diff']:.4f}",
                     f"{r['max_abs_logprob_diff']:.3f}"])
        print(name, r, flush=True)
    model = args.model or f"{args.model_config} (random weights)"
    text = (f"Model {model}, {args.device}; against pagoda float32 (greedy, EOS ignored). {len(workload)} requests, "
            f"prompts {args.input_len[0]}..{args.input_len[1]} tokens, {args.output_len[0]}..{args.output_len[1]} "
            f"new tokens, seed {args.seed}. Teacher-forced: the variant scores float32's own completions.\n\n"
            + common.markdown_table(["variant", "completions identical", "tokens before first difference",
                                     "teacher-forced top-1 = float32's", "mean abs. logprob difference",
                                     "max abs. logprob difference"], rows))
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "quantization", "command": common.command_line(), "machine": common.machine(),
                       "num_requests": len(workload), "variants": results}, f, indent=2)
    if not args.no_results:
        common.append_results(args.results, "accuracy of cheaper precisions (benchmarks/quantization.py)", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Speculative decoding (n-gram prompt lookup, a draft model) against none, on a model trained here
(benchmarks/trained_model.py: random weights would make acceptance meaningless). Runs alternate
(off, on, off, on, ...) so that a busy machine slows both alike; greedy, so both give the same
tokens (checked).

Workloads, from the standard library's source (held out: files the model was not trained on
first, taken from the end of the sorted list):
  edit      the prompt is a piece of code, then a comment asking for it again, then its first
            line: the answer copies the code (small changes where the model makes them), where
            prompt lookup shines;
  continue  free continuation of a piece of code, where it has little to look up (and a draft
            trained like the target should predict it).

    python benchmarks/speculative.py --streams 1 16 64 --repeats 3
    python benchmarks/speculative.py --methods draft --workloads continue --streams 1
    python benchmarks/speculative.py --target-size large --methods ngram draft --streams 1
"""
import argparse
import glob
import os
import statistics
import sys
import sysconfig
import time

import common
import trained_model

SNIPPET_LINES = 24


def snippets(tokenizer, count: int, max_tokens: int) -> list[str]:
    """Pieces of stdlib code (a top-level function's first SNIPPET_LINES lines, fewer to fit in
    max_tokens) from files late in the sorted list (the training corpus is read from the start)."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for path in sorted(glob.glob(os.path.join(root, "*.py")), reverse=True):
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
        start = next((i for i, line in enumerate(lines) if line.startswith("def ")), None)
        if start is None:
            continue
        piece = lines[start:start + SNIPPET_LINES]
        while len(piece) > 1 and len(tokenizer("\n".join(piece) + "\n")["input_ids"]) > max_tokens:
            piece.pop()
        out.append("\n".join(piece) + "\n")
        if len(out) == count:
            break
    return out


def prompts(tokenizer, workload: str, count: int, max_tokens: int) -> list[list[int]]:
    texts = snippets(tokenizer, count, max_tokens)
    if workload == "edit":
        texts = [f"{t}\n\n# The same function again, with its names unchanged:\n{t.splitlines()[0]}\n" for t in texts]
    return [tokenizer(t)["input_ids"] for t in texts]


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def run(llm, batch: list[list[int]], new_tokens: int, clock=time.perf_counter) -> tuple[float, list[list[int]]]:
    from pagoda.engine import SamplingParams

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=new_tokens)
    t0 = clock()
    outs = llm.generate(batch, params)
    return len(batch) * new_tokens / (clock() - t0), [o.token_ids for o in outs]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train-steps", type=int, default=600, help="the trained model's steps (its cache key)")
    p.add_argument("--model", help="an existing checkpoint instead of the trained model (with random weights: "
                                   "what failed speculation costs, not what it saves)")
    p.add_argument("--model-config", choices=sorted(common.MODEL_CONFIGS),
                   help="random weights of this shape (benchmarks/common.py) instead of the trained model")
    p.add_argument("--draft", help="the draft checkpoint for --methods draft (default: the trained draft)")
    p.add_argument("--methods", nargs="+", default=["ngram"], choices=["ngram", "draft"])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--workloads", nargs="+", default=["edit", "continue"], choices=["edit", "continue"])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--snippet-tokens", type=int, default=192, help="most tokens of a code snippet")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", help="float32 by default (what the speculative numbers were measured in)")
    p.add_argument("--target-size", choices=["small", "large"], default="small",
                   help="the trained target: small (6 layers, hidden 256: its weights fit in the CPU's caches) or "
                        "large (8 layers, hidden 384, ~60 MB: they do not); the same trained draft for both")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="cpu: the process's CPU time instead of wall time (with --threads 1 on a machine shared "
                        "with other work: time spent descheduled is not counted)")
    p.add_argument("--note", default="", help="a sentence on the conditions, for RESULTS.md")
    common.add_results_args(p)
    args = common.finish_args(p.parse_args(argv))
    from pagoda.engine import LLM

    if args.model or args.model_config:
        path = args.model or common.cached_checkpoint(args.model_config)
        what = f"checkpoint {args.model or args.model_config + ' (random weights)'}"
    elif args.target_size == "large":
        path = trained_model.build_large(small_steps=args.train_steps)["target"]
        what = (f"larger trained target ({trained_model.LARGE_SHAPE['num_hidden_layers']} layers, hidden "
                f"{trained_model.LARGE_SHAPE['hidden_size']}, benchmarks/trained_model.py --target-size large)")
    else:
        path = trained_model.build(args.train_steps)["target"]
        what = f"trained target ({args.train_steps} steps, benchmarks/trained_model.py)"
    draft = args.draft
    if "draft" in args.methods and draft is None:
        if args.model or args.model_config:
            sys.exit("--methods draft with --model or --model-config needs --draft PATH")
        draft = trained_model.build(args.train_steps)["draft"]
        what += ", its trained draft"
    specs = {"ngram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 3},
             "draft": {"model": draft, "num_speculative_tokens": args.k}}
    kw = dict(dtype=args.dtype, device=args.device, enable_prefix_caching=False, num_kv_blocks=4096)
    engines = {"off": LLM(path, **kw)}
    engines.update((m, LLM(path, speculative_config=specs[m], **kw)) for m in args.methods)
    tokenizer = engines["off"].tokenizer
    rows = []
    for workload in args.workloads:
        pool = prompts(tokenizer, workload, max(args.streams), args.snippet_tokens)
        for streams in args.streams:
            batch = (pool * streams)[:streams]
            rates = {name: [] for name in engines}
            accepted = {m: [] for m in args.methods}
            for name, llm in engines.items():  # warm-up
                run(llm, batch[:1], 8)
            for _ in range(args.repeats):
                outputs = {}
                for name, llm in engines.items():
                    s = llm.engine.speculator
                    before = (s.num_accepted, s.num_verifications) if s else None
                    rate, outputs[name] = run(llm, batch, args.new_tokens, CLOCKS[args.clock])
                    rates[name].append(rate)
                    if s:
                        n = s.num_verifications - before[1]
                        accepted[name].append(1 + (s.num_accepted - before[0]) / n if n else 1.0)
                if any(outputs["off"] != outputs[m] for m in args.methods):
                    sys.exit("greedy outputs differ with speculation: a bug")
            off = statistics.median(rates["off"])
            for m in args.methods:
                on = statistics.median(rates[m])
                rows.append([workload, streams, m, f"{off:.0f}", f"{on:.0f}", f"{on / off:.2f}x",
                             f"{statistics.mean(accepted[m]):.2f}"])
                print(rows[-1], flush=True)
    table = common.markdown_table(["workload", "streams", "method", "off tok/s", "spec tok/s", "spec / off",
                                   "mean accepted length"], rows)
    print(table)
    if not args.no_results:
        common.append_results(
            args.results, f"speculative decoding ({', '.join(args.methods)}) vs none",
            f"Model: {what}, {args.dtype}; greedy, {args.new_tokens} new "
            f"tokens per stream, k={args.k}, prompt_lookup_max 3 (ngram), default switch-off (disable_by_batch_size 8, "
            f"min_acceptance_rate 0.2); medians of {args.repeats} alternating runs; outputs identical with and "
            f"without; tokens/s by {'the process CPU time' if args.clock == 'cpu' else 'wall time'}. Mean accepted "
            f"length: tokens per verifying step (accepted + 1). {args.note}\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The offline LLM on CPU cores shared with a busy process: OpenMP's wait policy as the library sets it.

LLM() sets OMP_WAIT_POLICY=PASSIVE before it imports torch (engine/openmp.py); GNU OpenMP reads the
policy once, when torch loads, so a program that imported torch first runs with libgomp's default
(spin, then sleep). Each side runs in a fresh process, the demo model, greedy, EOS ignored, timed
around one generate call after a warm-up; "busy" starts a second Python burning one core beside it.

    python benchmarks/openmp_shared_cores.py                    # 200 prompts x 64 tokens, 2 rounds
    python benchmarks/openmp_shared_cores.py --child library    # one side, prints its JSON

Sides: `library` (`from pagoda import LLM` first: the library's behaviour), `torch-first` (`import torch`
before pagoda: too late to set the policy, libgomp's default), `torch-first-1-thread` (the same, then
torch.set_num_threads(1): the knob that is left once torch has loaded). Each child's libgomp reports the
spin count it read (OMP_DISPLAY_ENV=VERBOSE; 0 is the passive policy, 300000 the default), so the table
says what really ran.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

SIDES = ("library", "torch-first", "torch-first-1-thread")


def child(side: str, num_prompts: int, max_tokens: int) -> dict:
    if side.startswith("torch-first"):
        import torch
        if side.endswith("1-thread"):
            torch.set_num_threads(1)
    from pagoda import LLM, SamplingParams

    llm = LLM()
    prompts = [f"Prompt {i}: " + "once upon a time " * (1 + i % 8) for i in range(num_prompts)]
    llm.generate(prompts[:8], SamplingParams(max_tokens=8), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    took = time.perf_counter() - t0
    import torch
    return {"side": side, "seconds": took, "tokens": sum(o.num_generated_tokens for o in outs),
            "threads": torch.get_num_threads(), "dtype": str(llm.config.dtype)}


def run_side(side: str, busy: bool, args) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"  # each libgomp prints what it read, on stderr, when it loads
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        out = subprocess.run([sys.executable, __file__, "--child", side, "--num-prompts", str(args.num_prompts),
                              "--max-tokens", str(args.max_tokens)], capture_output=True, text=True, env=env,
                             timeout=1800, check=False)
    finally:
        if burner is not None:
            burner.kill()
            burner.wait()
    if out.returncode != 0:
        raise SystemExit(f"{side} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # its display says PASSIVE for the default too; the spin count tells them apart (0: passive)
    spins = sorted(set(re.findall(r"GOMP_SPINCOUNT = '(\d+)'", out.stderr)))
    result["libgomp_policy"] = "spin count " + "/".join(spins) if spins else "?"
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    p.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    common.add_results_args(p)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.num_prompts, args.max_tokens)))
        return
    runs: dict[tuple[str, bool], list[dict]] = {}
    for r in range(args.rounds):
        for busy in (False, True):
            for side in args.sides:
                res = run_side(side, busy, args)
                runs.setdefault((side, busy), []).append(res)
                print(f"round {r}: {side:22s} {'busy' if busy else 'quiet'}: {res['seconds']:.2f} s "
                      f"(libgomp {res['libgomp_policy']}, threads {res['threads']})", file=sys.stderr, flush=True)
    rows = []
    for side in args.sides:
        cells = [side, runs[(side, False)][0]["libgomp_policy"], runs[(side, False)][0]["threads"]]
        for busy in (False, True):
            secs = [x["seconds"] for x in runs[(side, busy)]]
            tokens = runs[(side, busy)][0]["tokens"]
            cells.append(f"{statistics.median(secs):.2f} s ({'/'.join(f'{s:.2f}' for s in secs)}), "
                         f"{tokens / statistics.median(secs):.0f} tok/s")
        rows.append(cells)
    body = (f"Demo model ({runs[(args.sides[0], False)][0]['dtype']}), {args.num_prompts} prompts x "
            f"{args.max_tokens} tokens, greedy, EOS ignored, one generate call timed after a warm-up, a fresh "
            f"process per run; busy: a second Python burning one core meanwhile. Median (every round's seconds):\n\n"
            + common.markdown_table(["side", "libgomp", "torch threads", "quiet", "one busy process"], rows))
    print(body)
    if args.results:
        common.append_results(args.results, "offline LLM on shared cores, OpenMP's wait policy "
                                            "(benchmarks/openmp_shared_cores.py)", body)


if __name__ == "__main__":
    main()

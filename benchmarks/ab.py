"""pagoda against itself: two or more variants (engine options and/or environment), each an offline `LLM`
in a process of its own, given the same workloads in alternation (A, B, A, B, ...), so that a shared,
noisy machine weighs on every variant alike. Reports each variant's median output tok/s and its ratio
to the first. Optionally with one busy process pinned to a core meanwhile (--busy-core), to see how a
variant holds up when the cores are shared.

A variant: NAME=JSON, the JSON an object of LLM options, plus "env": {VAR: value} for the variant's
process environment (read before torch starts, e.g. OMP_WAIT_POLICY).

    python benchmarks/ab.py --model-config qwen2.5-0.5b --num-requests 16 --input-len 128 128 --output-len 64 64 --repeats 3 \\
        --variant 'mkl={"cpu_linear": "mkl"}' --variant 'onednn={"cpu_linear": "onednn"}'

A CPU without native bf16 on one that has it: oneDNN capped at AVX2 refuses bf16 as an AVX2-only CPU does
(deterministic.computes_bf16), so --dtype bfloat16's 128-token prompt against float32's (seconds = 1 / tok/s):

    E='"env": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}'
    python benchmarks/ab.py --model-config qwen2.5-0.5b --num-requests 1 --input-len 128 128 --output-len 1 1 \\
        --threads 2 --repeats 5 --variant "f32={\\"dtype\\": \\"float32\\", $E}" --variant "bf16={\\"dtype\\": \\"bfloat16\\", $E}"
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import common

MARK = "AB_RESULT "


def worker(spec: dict) -> None:
    """In the variant's process: build the LLM, then answer one JSON line per workload line on stdin."""
    from pagoda.engine import LLM, SamplingParams
    llm = LLM(spec["model"], **spec["options"])
    print(MARK + json.dumps({"dtype": llm.engine.config.dtype}), flush=True)
    for line in sys.stdin:
        workload = json.loads(line)
        params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for _, n in workload]
        t0 = time.perf_counter()
        outs = llm.generate([ids for ids, _ in workload], params)
        elapsed = time.perf_counter() - t0
        lengths = [len(o.token_ids) for o in outs]
        if lengths != [n for _, n in workload]:
            raise SystemExit(f"a request did not generate its output length: {lengths}")
        print(MARK + json.dumps({"elapsed_s": elapsed, "tokens": [list(o.token_ids) for o in outs]}), flush=True)


class Variant:
    def __init__(self, name: str, options: dict, path: str, threads: int | None):
        self.name = name
        self.env = {k: str(v) for k, v in options.pop("env", {}).items()}
        env = dict(os.environ) | self.env
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
            options.setdefault("cpu_threads", threads)
        self.options = options
        spec = {"model": path, "options": options}
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.dtype = self._read()["dtype"]

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        raise RuntimeError(f"variant {self.name} exited with code {self.proc.wait()}")

    def run(self, workload) -> tuple[float, list]:
        self.proc.stdin.write(json.dumps(workload) + "\n")
        self.proc.stdin.flush()
        out = self._read()
        return out["elapsed_s"], out["tokens"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def busy_loop(core: int) -> subprocess.Popen:
    return subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-c", "while True: pass"])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p)
    common.add_workload_args(p, num_requests=16, input_len=(128, 128), output_len=(64, 64))
    p.add_argument("--variant", action="append", required=True, metavar="NAME=JSON",
                   help="a variant: its name, =, a JSON object of LLM options (+ \"env\"); two or more")
    p.add_argument("--repeats", type=int, default=3, help="runs of each variant, alternating (default 3)")
    p.add_argument("--busy-core", type=int, metavar="N",
                   help="also run every round with one busy process pinned to core N (taskset)")
    common.add_results_args(p)
    args = p.parse_args(argv)
    variants = []
    for v in args.variant:
        name, _, js = v.partition("=")
        try:
            options = json.loads(js)
            assert isinstance(options, dict) and name
        except (ValueError, AssertionError):
            p.error(f"--variant must be NAME=JSON object, got {v!r}")
        variants.append((name, options))
    if len(variants) < 2:
        p.error("give at least two --variant")
    args.variants = variants
    return common.finish_args(args)


def main(argv=None) -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
        return 0
    args = parse_args(argv)
    path = common.model_path(args)
    runs, warmup = common.workloads(args, path, repeats=args.repeats)
    for name, options in args.variants:
        options.setdefault("dtype", args.dtype)
        options.setdefault("device", args.device)
        options.setdefault("enable_prefix_caching", False)
    variants = [Variant(name, dict(options), path, args.threads) for name, options in args.variants]
    conditions = ["quiet"] + (["busy"] if args.busy_core is not None else [])
    tok_s = {(v.name, c): [] for v in variants for c in conditions}
    first = {}
    try:
        for v in variants:
            v.run(warmup)
        for i, workload in enumerate(runs):
            out_tokens = sum(n for _, n in workload)
            for c in conditions:
                busy = busy_loop(args.busy_core) if c == "busy" else None
                try:
                    for v in (variants if i % 2 == 0 else variants[::-1]):  # each goes first in turn
                        common.settle()
                        elapsed, tokens = v.run(workload)
                        tok_s[v.name, c].append(out_tokens / elapsed)
                        first.setdefault(v.name, tokens)
                        print(f"[ab] {v.name} {c} run {i + 1}: {elapsed:.2f} s, {out_tokens / elapsed:.1f} tok/s",
                              file=sys.stderr, flush=True)
                finally:
                    if busy is not None:
                        busy.kill()
                        busy.wait()
    finally:
        for v in variants:
            v.close()
    text = report(args, path, variants, conditions, tok_s, first, runs[0])
    print(text)
    if not args.no_results:
        common.append_results(args.results, "pagoda variants A/B (benchmarks/ab.py)", text)
    return 0


def report(args, path, variants, conditions, tok_s, first, workload) -> str:
    model = args.model or f"{args.model_config} (random weights, {path})"
    base = variants[0].name
    rows = []
    for v in variants:
        for c in conditions:
            med = statistics.median(tok_s[v.name, c])
            row = [v.name, json.dumps(v.options | ({"env": v.env} if v.env else {})), v.dtype, c, f"{med:.1f}",
                   " / ".join(f"{x:.1f}" for x in tok_s[v.name, c]),
                   f"{med / statistics.median(tok_s[base, c]):.2f}"]
            if "busy" in conditions:
                row.append(f"{statistics.median(tok_s[v.name, 'busy']) / statistics.median(tok_s[v.name, 'quiet']):.2f}"
                           if c == "busy" else "")
            rows.append(row)
    headers = ["variant", "options", "dtype", "cores", "output tok/s (median)", "every run", f"/ {base}"]
    if "busy" in conditions:
        headers.append("busy / quiet")
    same = sum(1 for v in variants[1:] if first[v.name] == first[base])
    busy = (f" \"busy\": the same round again with one `while True: pass` process pinned to core {args.busy_core}."
            if "busy" in conditions else "")
    return (f"Model {model}; {len(workload)} requests at once, prompts {args.input_len[0]}..{args.input_len[1]} "
            f"tokens, {args.output_len[0]}..{args.output_len[1]} new tokens, greedy, EOS ignored, prefix caching "
            f"off; threads {args.threads or 'default'}; each variant in its own process, runs alternate (the first to run in a round alternates too; a settle pause before each), "
            f"{args.repeats} rounds.{busy}\n\n" + common.markdown_table(headers, rows)
            + f"\n\nFirst run's tokens identical to {base}'s: {same} of {len(variants) - 1} variant(s).\n")


if __name__ == "__main__":
    sys.exit(main())

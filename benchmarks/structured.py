"""Structured outputs at batch speed: offline throughput with every request under a JSON schema
against the same requests unconstrained, in one process, runs alternating; the per-step cost of
the masks (filling every constrained row's bitmask, applying them to the logits, advancing the
matchers); and compile times (cold and cached) over the tests' constraints (tests/structured_cases.py).

The schema asks for at least 100 records of four fields, so no request can finish it within its
output length: constrained and free requests generate the same number of tokens, greedy, EOS ignored,
on the same prompts (prefix caching off, so that each run computes them).

    python benchmarks/structured.py --model-config tiny --num-requests 64 --input-len 32 256 --output-len 128 128 --repeats 3
"""
import argparse
import json
import os
import statistics
import sys
import time

import common

sys.path.insert(0, os.path.join(common.ROOT, "tests"))

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["records"], "properties": {"records": {
    "type": "array", "minItems": 100, "items": {
        "type": "object", "additionalProperties": False, "required": ["id", "name", "score", "tag"],
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                       "name": {"type": "string", "pattern": "^[a-z]{3,8}$"},
                       "score": {"type": "number", "minimum": 0, "maximum": 1},
                       "tag": {"enum": ["red", "green", "blue"]}}}}}}


class Timed:
    """Wraps a function and adds up the seconds spent in it."""

    def __init__(self, fn):
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


def run(llm, workload, constrained: bool) -> tuple[float, int]:
    from pagoda.engine import SamplingParams
    from pagoda.engine.structured.manager import StructuredOutputs

    so = StructuredOutputs(json=SCHEMA) if constrained else None
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n, structured_outputs=so)
              for _, n in workload]
    t0 = time.perf_counter()
    outs = llm.generate([ids for ids, _ in workload], params)
    elapsed = time.perf_counter() - t0
    bad = [o for o in outs if o.finish_reason != "length"]
    if bad:
        raise RuntimeError(f"{len(bad)} request(s) ended with {bad[0].finish_reason}: {bad[0].text[:80]!r}")
    head = '{"records":[{"id":'
    # (a random prompt may end inside a character: the completion's text then starts with U+FFFD)
    texts = [o.text.lstrip("\ufffd") for o in outs]
    if constrained and not all(t.startswith(head) or head.startswith(t) for t in texts):
        wrong = next(t for t in texts if not (t.startswith(head) or head.startswith(t)))
        raise RuntimeError(f"a constrained completion does not follow the schema: {wrong[:60]!r}")
    return elapsed, sum(len(o.token_ids) for o in outs)


def mask_costs(llm, workload) -> dict:
    """One constrained run with the mask work timed: ms per engine step."""
    import pagoda.engine.layers.sampler as sampler
    import pagoda.engine.structured.manager as structured

    manager = llm.engine.structured
    fill, apply = Timed(structured.fill_bitmasks), Timed(sampler.apply_allowed)
    advance = Timed(manager.accept)
    step = Timed(llm.engine.step)
    structured.fill_bitmasks, sampler.apply_allowed = fill, apply
    manager.accept, llm.engine.step = advance, step
    try:
        run(llm, workload, constrained=True)
    finally:
        structured.fill_bitmasks, sampler.apply_allowed = fill.fn, apply.fn
        del manager.accept, llm.engine.step
    steps = step.calls
    return {"steps": steps, "step_ms": 1e3 * step.seconds / steps, "fill_ms": 1e3 * fill.seconds / steps,
            "apply_ms": 1e3 * apply.seconds / steps, "advance_ms": 1e3 * advance.seconds / steps}


def compile_times(llm) -> dict:
    """Seconds to compile each of the tests' constraints: cold (a new compiler: no cache) and cached."""
    from structured_cases import CHOICES, GRAMMAR, REGEXES, SCHEMAS

    from pagoda.engine.structured.manager import GrammarCompiler, StructuredOutputs

    cases = ([StructuredOutputs(json=s) for s in SCHEMAS + [SCHEMA]] + [StructuredOutputs(json_object=True)]
             + [StructuredOutputs(regex=r) for r in REGEXES] + [StructuredOutputs(choice=c) for c in CHOICES]
             + [StructuredOutputs(grammar=GRAMMAR)])
    cold, cached = [], []
    for so in cases:
        for _ in range(3):
            compiler = GrammarCompiler(llm.tokenizer, llm.engine.hf_config.vocab_size, llm.engine.eos_token_ids)
            compiler.tokenizer  # built once per model: not part of a grammar's compile
            t0 = time.perf_counter()
            compiler.compile(so)
            cold.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            compiler.compile(so)
            cached.append(time.perf_counter() - t0)
            compiler.close()
    return {"cases": len(cases), "cold": common.percentiles(cold), "cached": common.percentiles(cached),
            "cold_max": max(cold)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    common.add_model_args(p)
    common.add_workload_args(p, num_requests=64, input_len=(32, 256), output_len=(128, 128))
    p.add_argument("--repeats", type=int, default=3, help="runs of each kind, alternating; medians (default 3)")
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    common.add_results_args(p)
    return common.finish_args(p.parse_args(argv))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.repeats < 1:
        sys.exit("--repeats must be at least 1")
    from pagoda.engine import LLM

    path = common.model_path(args)
    runs, warmup = common.workloads(args, path, repeats=args.repeats)
    # both kinds run the same prompts: no prefix cache, or the second would skip its prefill
    llm = LLM(path, dtype=args.dtype, quantization=common.quantization(args), device=args.device,
              enable_prefix_caching=False)
    run(llm, warmup, constrained=False)
    run(llm, warmup, constrained=True)
    free, bound = [], []
    for workload in runs:  # alternating, so both kinds see the same machine
        for kind, into in ((False, free), (True, bound)):
            elapsed, tokens = run(llm, workload, kind)
            into.append(tokens / elapsed)
    masks = mask_costs(llm, runs[0])
    compiles = compile_times(llm)
    free_tps, bound_tps = statistics.median(free), statistics.median(bound)
    result = {"free_tok_s": free_tps, "json_schema_tok_s": bound_tps, "ratio": bound_tps / free_tps,
              "free_runs": free, "json_schema_runs": bound, "masks": masks, "compile": compiles}
    ms = lambda s: f"{1e3 * s:.2f}"  # noqa: E731
    body = common.markdown_table(
        ["run", "tokens/s (median)", "ratio"],
        [["unconstrained", f"{free_tps:.0f}", "1.00"], ["every request under a JSON schema", f"{bound_tps:.0f}",
                                                         f"{bound_tps / free_tps:.2f}"]])
    body += ("\n\nPer engine step of the constrained run (batch up to "
             f"{args.num_requests}, {masks['steps']} steps, {masks['step_ms']:.2f} ms a step): fill the bitmasks "
             f"{masks['fill_ms']:.3f} ms, apply them {masks['apply_ms']:.3f} ms, advance the matchers "
             f"{masks['advance_ms']:.3f} ms.\n\n")
    body += common.markdown_table(
        ["compile (ms)", "p50", "p99", "max"],
        [["cold", ms(compiles["cold"]["p50"]), ms(compiles["cold"]["p99"]), ms(compiles["cold_max"])],
         ["cached", ms(compiles["cached"]["p50"]), ms(compiles["cached"]["p99"]), ""]])
    body += f"\n\n{compiles['cases']} constraints (tests/structured_cases.py and the run's schema), 3 cold compiles each."
    print(body)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if not args.no_results:
        common.append_results(args.results, "structured outputs (JSON schema vs unconstrained)", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())

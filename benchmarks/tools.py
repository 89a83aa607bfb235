"""Tool calls at batch speed: offline throughput of the same requests free, under tool_choice
"required" (the whole output a Hermes call, grammar-enforced), and under tool_choice "auto" with no
call made (free text under the auto grammar, which watches for the trigger); in one process, runs
interleaved. The grammars are the server's own (server/chat/tools.py, as a chat request with these tools
makes them); the prompts are the same token ids for every kind, so the ratios are the grammar's cost.
"required" fills each step's masks while the model runs; "required_serial" fills them after it (the
overlap's A/B, in the same run).

The function's parameters ask for at least 100 records, so no call can end within the output length:
every kind generates (nearly) the same number of tokens (greedy, EOS ignored, prefix caching off; a
request the grammar ends early is reported on stderr, and tokens/s counts the tokens made).

    python benchmarks/tools.py --model-config tiny --num-requests 64 --input-len 32 256 --output-len 128 128 --repeats 3
"""
import argparse
import json
import statistics
import sys
import time

import common
from structured import SCHEMA

TOOLS = [{"type": "function", "function": {"name": "save_records", "description": "Store records.",
                                           "parameters": SCHEMA}}]
KINDS = ("free", "required", "auto", "required_serial")


def params_for(llm, kind: str, workload):
    from pagoda.engine import SamplingParams
    from pagoda.server.chat.tools import FORMATS, check_tools, constrain

    base = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for _, n in workload]
    if kind == "free":
        return base
    tools = check_tools(TOOLS, kind.removesuffix("_serial"))
    return [constrain(tools, FORMATS["hermes"], p, llm.tokenizer)[0] for p in base]


def run(llm, workload, kind: str) -> tuple[float, int]:
    params = params_for(llm, kind, workload)
    manager = llm.engine.structured
    if kind.endswith("_serial"):  # the masks filled after the model, as before the overlap: its A/B
        manager.start_bitmasks = lambda *a, **k: None
    t0 = time.perf_counter()
    try:
        outs = llm.generate([ids for ids, _ in workload], params)
    finally:
        manager.__dict__.pop("start_bitmasks", None)
    elapsed = time.perf_counter() - t0
    early = sum(o.finish_reason != "length" for o in outs)
    if early:  # the grammar ended it (rare; tokens/s still counts the tokens made)
        print(f"{kind}: {early} of {len(outs)} requests ended before max_tokens", file=sys.stderr)
    head = '<tool_call>\n{"name": "'
    texts = [o.text.lstrip("\ufffd") for o in outs]  # a random prompt may end inside a character
    wrong = [t for t in texts if not (t.startswith(head) or head.startswith(t))]
    if kind.startswith("required") and wrong:
        raise RuntimeError(f"a required completion is not a call: {wrong[0]!r}")
    if kind == "auto" and any(t.startswith("<tool_call>") for t in texts):
        raise RuntimeError("an auto completion made a call: the run must measure free text under the auto grammar")
    return elapsed, sum(len(o.token_ids) for o in outs)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    common.add_model_args(p)
    common.add_workload_args(p, num_requests=64, input_len=(32, 256), output_len=(128, 128))
    p.add_argument("--repeats", type=int, default=3, help="rounds of the interleaved runs (default: 3)")
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
    llm = LLM(path, dtype=args.dtype, quantization=common.quantization(args), device=args.device,
              enable_prefix_caching=False)
    for kind in KINDS:
        run(llm, warmup, kind)
    tps = {k: [] for k in KINDS}
    for workload in runs:  # interleaved, so every kind sees the same machine
        for kind in KINDS:
            elapsed, tokens = run(llm, workload, kind)
            tps[kind].append(tokens / elapsed)
    med = {k: statistics.median(v) for k, v in tps.items()}
    body = common.markdown_table(
        ["run", "tokens/s (median)", "per round", "ratio to free"],
        [["free (no tools)", f"{med['free']:.0f}", ", ".join(f"{x:.0f}" for x in tps["free"]), "1.00"],
         ["tool_choice required (a Hermes call, enforced)", f"{med['required']:.0f}",
          ", ".join(f"{x:.0f}" for x in tps["required"]), f"{med['required'] / med['free']:.2f}"],
         ["tool_choice auto, no call made", f"{med['auto']:.0f}", ", ".join(f"{x:.0f}" for x in tps["auto"]),
          f"{med['auto'] / med['free']:.2f}"],
         ["required, masks filled after the model (no overlap: the A/B)", f"{med['required_serial']:.0f}",
          ", ".join(f"{x:.0f}" for x in tps["required_serial"]), f"{med['required_serial'] / med['free']:.2f}"]])
    print(body)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tok_s": tps, "median": med}, f, indent=2)
    if not args.no_results:
        common.append_results(args.results, "tool calls (required, auto without a call) vs free", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())

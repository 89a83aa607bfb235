"""pagoda's few-row float32 linear (engine/layers/csrc/linear_cpu.cpp) against torch's (MKL's sgemm) in the
engine, on the model trained here (benchmarks/trained_model.py): one forward of a sequence's last 1, 5 or 9
tokens over a cached context (a decode step, a verification of 4 or 8 proposals), and one stream's greedy
decoding. Runs alternate (torch, pagoda, torch, ...) in one process; greedy outputs are checked identical.

    python benchmarks/few_row_linear.py --threads 1 --clock cpu
"""
import argparse
import statistics
import time

import numpy as np

import common
import trained_model

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target-size", choices=["small", "large"], default="small")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 5, 9])
    p.add_argument("--context", type=int, default=300, help="cached tokens before the query rows")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    p.add_argument("--note", default="")
    common.add_results_args(p)
    args = p.parse_args(argv)
    common.apply_threads(args.threads)
    import torch

    from pagoda.engine import LLM, SamplingParams, parallel
    from pagoda.engine.model_runner import _positions_and_slots

    paths = trained_model.build_large() if args.target_size == "large" else trained_model.build(600)
    llm = LLM(paths["target"], dtype="float32", device="cpu", enable_prefix_caching=False, num_kv_blocks=512)
    runner, clock, few = llm.engine.runner, CLOCKS[args.clock], parallel.FEW_ROWS
    tables = np.arange(0, -(-(args.context + max(args.rows)) // runner.block_size), dtype=np.int32)[None, :]

    @torch.inference_mode()
    def forward(start: int, count: int) -> None:
        starts, counts = np.array([start]), np.array([count])
        pos, slots = _positions_and_slots(starts, counts, tables, runner.block_size)
        meta = runner._attention_metadata(slots, tables, counts, starts + counts, int(count == 1))
        hidden = runner._forward(torch.randint(0, runner.vocab_size, (count,)), torch.from_numpy(pos), meta, [])
        runner.sampler.argmax(runner._logits(hidden).float()).tolist()

    forward(0, args.context)
    times = {}
    for _ in range(args.repeats):
        for name, limit in (("torch", 0), ("pagoda", few)):
            parallel.FEW_ROWS = limit
            for rows in args.rows:
                t0 = clock()
                for _ in range(50):
                    forward(args.context, rows)
                times.setdefault((name, rows), []).append((clock() - t0) / 50)
    prompt = llm.tokenizer("def add(a, b):\n    return a + b\n\n\ndef")["input_ids"]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.new_tokens)
    rates, outs = {}, {}
    for _ in range(args.repeats):
        for name, limit in (("torch", 0), ("pagoda", few)):
            parallel.FEW_ROWS = limit
            t0 = clock()
            outs[name] = llm.generate([prompt], params)[0].token_ids
            rates.setdefault(name, []).append(args.new_tokens / (clock() - t0))
    parallel.FEW_ROWS = few
    same = outs["torch"] == outs["pagoda"]
    rows_out = []
    for rows in args.rows:
        t, o = statistics.median(times[("torch", rows)]), statistics.median(times[("pagoda", rows)])
        rows_out.append([f"forward, {rows} query rows", f"{t * 1e3:.2f} ms", f"{o * 1e3:.2f} ms", f"{t / o:.2f}x"])
    t, o = statistics.median(rates["torch"]), statistics.median(rates["pagoda"])
    rows_out.append(["one stream, greedy", f"{t:.0f} tok/s", f"{o:.0f} tok/s", f"{o / t:.2f}x"])
    table = common.markdown_table(["what", "torch linear (MKL)", "pagoda few-row linear", "speed-up"], rows_out)
    print(table)
    print("greedy outputs identical" if same else "greedy outputs differ (a near-tie rounded otherwise)")
    if not args.no_results:
        common.append_results(
            args.results, "few-row float32 linear (pagoda) vs torch's, in the engine",
            f"Model: trained target ({args.target_size}), float32, context {args.context} tokens; medians of "
            f"{args.repeats} alternating runs, by {'process CPU time' if args.clock == 'cpu' else 'wall time'}; "
            f"greedy outputs {'identical' if same else 'NOT identical'}. {args.note}\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

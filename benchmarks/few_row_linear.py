"""pagoda's few-row linear (engine/layers/csrc/linear_cpu.cpp; float32 or bfloat16) against torch's in the
engine (oneDNN's packed weights, pagoda's CPU default, or MKL's sgemm with --cpu-linear mkl), on the model
trained here (benchmarks/trained_model.py) or a random one (--model-config): one forward of a sequence's
last 1, 5 or 9 tokens over a cached context (a decode step, a verification of 4 or 8 proposals), and one
stream's greedy decoding. Runs alternate (torch, pagoda, torch, ...) in one process; greedy outputs are
compared.

    python benchmarks/few_row_linear.py --threads 1 --clock cpu
    python benchmarks/few_row_linear.py --model-config qwen2.5-0.5b --dtype bfloat16 --rows 1 5 --new-tokens 32 --repeats 3
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
    p.add_argument("--model-config", choices=sorted(common.MODEL_CONFIGS),
                   help="a random checkpoint of this shape in place of the trained model")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--cpu-linear", choices=["onednn", "mkl"], default="onednn", help="the torch side's GEMM")
    p.add_argument("--fused", choices=["linear", "all"], default="linear",
                   help="pagoda's ops the torch side goes without: the few-row linear (default), or all of "
                        "them but attention (also the norms, SiLU and rotary)")
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

    if args.model_config:
        path = common.cached_checkpoint(args.model_config)
    else:
        path = (trained_model.build_large() if args.target_size == "large" else trained_model.build(600))["target"]
    llm = LLM(path, dtype=args.dtype, device="cpu", enable_prefix_caching=False, num_kv_blocks=512,
              cpu_linear=args.cpu_linear)
    runner, clock = llm.engine.runner, CLOCKS[args.clock]
    few = parallel.FEW_ROWS, parallel.FEW_ROWS_PACKED

    bound = [m for m in llm.engine.model.modules() if getattr(m, "fused_ops", None) is not None
             and not isinstance(m, parallel.Linear)] if args.fused == "all" else []
    ops = bound[0].fused_ops if bound else None

    def use(limit) -> None:
        parallel.FEW_ROWS, parallel.FEW_ROWS_PACKED = limit
        for m in bound:
            m.fused_ops = ops if limit == few else None
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
        for name, limit in (("torch", (0, 0)), ("pagoda", few)):
            use(limit)
            for rows in args.rows:
                t0 = clock()
                for _ in range(50):
                    forward(args.context, rows)
                times.setdefault((name, rows), []).append((clock() - t0) / 50)
    prompt = llm.tokenizer("def add(a, b):\n    return a + b\n\n\ndef")["input_ids"] * (1 if args.model_config is None else 16)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.new_tokens)
    rates, outs = {}, {}
    for _ in range(args.repeats):
        for name, limit in (("torch", (0, 0)), ("pagoda", few)):
            use(limit)
            t0 = clock()
            outs[name] = llm.generate([prompt], params)[0].token_ids
            rates.setdefault(name, []).append(args.new_tokens / (clock() - t0))
    use(few)
    same = outs["torch"] == outs["pagoda"]
    rows_out = []
    for rows in args.rows:
        t, o = statistics.median(times[("torch", rows)]), statistics.median(times[("pagoda", rows)])
        rows_out.append([f"forward, {rows} query rows", f"{t * 1e3:.2f} ms", f"{o * 1e3:.2f} ms", f"{t / o:.2f}x"])
    t, o = statistics.median(rates["torch"]), statistics.median(rates["pagoda"])
    rows_out.append(["one stream, greedy", f"{t:.1f} tok/s", f"{o:.1f} tok/s", f"{o / t:.2f}x"])
    torch_side = {"onednn": "torch linear (oneDNN packed)", "mkl": "torch linear (MKL)"}[args.cpu_linear]
    if args.fused == "all":
        torch_side += ", torch norms, SiLU, rotary"
    pagoda_side = "pagoda few-row linear" + (", fused norms, SiLU, rotary" if args.fused == "all" else "")
    table = common.markdown_table(["what", torch_side, pagoda_side, "speed-up"], rows_out)
    print(table)
    print("greedy outputs identical" if same else "greedy outputs differ (a near-tie rounded otherwise)")
    if not args.no_results:
        common.append_results(
            args.results, f"few-row {args.dtype} linear (pagoda) vs torch's, in the engine",
            f"Model: {args.model_config or f'trained target ({args.target_size})'} ({path}), {args.dtype}, context {args.context} tokens; medians of "
            f"{args.repeats} alternating runs, by {'process CPU time' if args.clock == 'cpu' else 'wall time'}; "
            f"greedy outputs {'identical' if same else 'NOT identical'}. {args.note}\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

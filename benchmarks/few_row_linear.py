"""pagoda's few-row linear (engine/layers/csrc/linear_cpu.cpp: float32 layers beside oneDNN's packed
weights over a copy packed in panels, cpu_ops.PanelLinear, up to its rows; bfloat16 and MKL's over a
column-major copy) against torch's in the engine (oneDNN's packed weights, pagoda's CPU default, or
MKL's sgemm with --cpu-linear mkl), on the model trained here (benchmarks/trained_model.py) or a random
one (--model-config): one forward of a sequence's last 1, 5 or 9 tokens over a cached context (a decode
step, a verification of 4 or 8 proposals), and one stream's greedy decoding. Runs alternate (torch, pagoda, torch, ...) in one process; greedy outputs are
compared.

    python benchmarks/few_row_linear.py --threads 1 --clock cpu
    python benchmarks/few_row_linear.py --model-config qwen2.5-0.5b --dtype bfloat16 --rows 1 5 --new-tokens 32 --repeats 3
    python benchmarks/few_row_linear.py --per-call --model-config qwen2.5-0.5b --rows 1 8 16 28 32

--per-call times one layer's linears (q/k/v, o, gate/up, down of the config's shape, random float32 weights)
alone, per call: the panel kernel, the column-major few-row op and oneDNN's packed weights (as PackedLinear
runs them), best of --repeats x 10 alternating calls.
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
    p.add_argument("--per-call", action="store_true", help="time a layer's linears alone (see above)")
    p.add_argument("--note", default="")
    common.add_results_args(p)
    args = p.parse_args(argv)
    common.apply_threads(args.threads)
    import torch

    if args.per_call:
        return per_call(args)

    from pagoda.engine import LLM, SamplingParams

    from pagoda.engine.executor import parallel
    from pagoda.engine.executor.batch import positions_and_slots as _positions_and_slots

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

    panels = {m: m.panels for m in llm.engine.model.modules() if isinstance(m, parallel.Linear)}

    def use(limit) -> None:
        parallel.FEW_ROWS, parallel.FEW_ROWS_PACKED = limit
        for m in bound:
            m.fused_ops = ops if limit == few else None
        for m, p in panels.items():  # float32 beside oneDNN: pagoda's panel kernel (cpu_ops.PanelLinear)
            m.panels = p if limit == few else None
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
    pagoda_side = "pagoda few-row linear" + (" (panels)" if any(panels.values()) else "")
    if args.fused == "all":
        pagoda_side += ", fused norms, SiLU, rotary"
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


def per_call(args) -> int:
    import torch

    from pagoda.engine.layers import cpu_ops
    from pagoda.engine.layers.deterministic import PackedLinear

    cfg = common.MODEL_CONFIGS[args.model_config or "qwen2.5-0.5b"][1]
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim", h // heads)
    shapes = [((heads + 2 * kv) * d, h), (h, heads * d), (2 * i, h), (h, i)]  # qkv, o, gate_up, down: (out, in)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, k, generator=g) for o, k in shapes]
    kinds = {"panels": [cpu_ops.PanelLinear(w, None) for w in weights],
             "few-row op": [lambda x, w=w.t().contiguous().t(): cpu_ops.ops().linear_few_rows(x, w, None)
                            for w in weights],
             "oneDNN packed": [PackedLinear(w, None) for w in weights]}
    rows_out = []
    for rows in args.rows:
        xs = [torch.randn(rows, w.shape[1], generator=g) for w in weights]
        best = dict.fromkeys(kinds, float("inf"))
        for _ in range(args.repeats * 10):
            for name, fs in kinds.items():
                t0 = time.perf_counter()
                for f, x in zip(fs, xs):
                    f(x)
                best[name] = min(best[name], time.perf_counter() - t0)
        rows_out.append([str(rows)] + [f"{best[n] * 1e3:.2f} ms" for n in kinds] +
                        [f"{best['oneDNN packed'] / best['panels']:.2f}x"])
    table = common.markdown_table(["rows", *kinds, "oneDNN / panels"], rows_out)
    print(table)
    if not args.no_results:
        common.append_results(
            args.results, "float32 linears per call: panels, few-row op, oneDNN (few_row_linear.py --per-call)",
            f"One layer of {args.model_config or 'qwen2.5-0.5b'}'s shape: {', '.join(f'{o} x {k}' for o, k in shapes)} "
            f"(out x in), random weights; the four calls' sum, best of {args.repeats * 10} alternating. "
            f"{args.note}\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

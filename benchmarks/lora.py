"""Multi-LoRA serving: the offline workload with LoRA adapters against the base model alone.

- base: a plain engine (no LoRA configured), every request on the base model;
- 8 adapters: an engine with 8 random rank-r adapters on every projection (q, k, v, o, gate, up,
  down), resident at once (max_loras 8), the 64 requests spread round-robin over them (every step
  mixes all 8);
- 1 adapter: the same engine, every request on one adapter.

Both engines are loaded once and the three runs interleaved per round (a shared machine's load then
weighs on all alike); the ratios are each round's, their median reported. Targets: 8 adapters >= 0.8
of the base's throughput, 1 adapter >= 0.9.

    python benchmarks/lora.py --model-config tiny --num-requests 64 --input-len 32 256 --output-len 128 128 --repeats 3
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import common

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: str, hf_config, rank: int, seed: int) -> str:
    """A random LoRA adapter in PEFT's format (llama-family names) for this model's shapes."""
    import torch
    from safetensors.torch import save_file

    c = hf_config
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * hd, (c.num_key_value_heads or c.num_attention_heads) * hd
    shapes = {"q_proj": (c.hidden_size, q), "k_proj": (c.hidden_size, kv), "v_proj": (c.hidden_size, kv),
              "o_proj": (q, c.hidden_size), "gate_proj": (c.hidden_size, c.intermediate_size),
              "up_proj": (c.hidden_size, c.intermediate_size), "down_proj": (c.intermediate_size, c.hidden_size)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(c.num_hidden_layers):
        for name, (fan_in, fan_out) in shapes.items():
            part = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.02
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
                   "bias": "none"}, f)
    return path


def throughput(llm, workload, adapters) -> tuple[float, float]:
    """Generated tokens per second of wall-clock time, and per second of this process's CPU time (on a
    shared machine with --threads 1 the latter hardly sees the other processes' load)."""
    from pagoda.engine import SamplingParams
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for _, n in workload]
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate([p for p, _ in workload], params, adapter=adapters)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    if any(len(o.token_ids) != n for o, (_, n) in zip(outs, workload)):
        raise RuntimeError("a request did not generate its output length")
    tokens = sum(len(o.token_ids) for o in outs)
    return tokens / elapsed, tokens / cpu


def run(args) -> str:
    from pagoda.engine import LLM
    from pagoda.engine.loader import load_hf_config
    path = common.model_path(args)
    hf = load_hf_config(path)
    root = tempfile.mkdtemp(prefix="pagoda-lora-bench-")
    names = [f"a{i}" for i in range(args.num_adapters)]
    modules = {n: write_adapter(os.path.join(root, n), hf, args.rank, seed=i) for i, n in enumerate(names)}
    options = dict(dtype=args.dtype, quantization=common.quantization(args), device=args.device,
                   enable_prefix_caching=False)
    base = LLM(path, **options)
    lora = LLM(path, lora_modules=modules, max_loras=args.num_adapters, max_lora_rank=args.rank, **options)
    runs, warmup = common.workloads(args, path, repeats=args.repeats)
    cases = {  # name -> (engine, the adapter of each request)
        "base": (base, lambda w: None),
        f"{args.num_adapters} adapters": (lora, lambda w: [names[i % len(names)] for i in range(len(w))]),
        "1 adapter": (lora, lambda w: names[0]),
    }
    for engine, adapters in cases.values():
        throughput(engine, warmup, adapters(warmup))
    tput = {name: [] for name in cases}
    for i, workload in enumerate(runs):
        order = list(cases) if i % 2 == 0 else list(cases)[::-1]
        for name in order:
            engine, adapters = cases[name]
            tput[name].append(throughput(engine, workload, adapters(workload)))
    rows = []
    for clock, c in (("wall", 0), ("CPU", 1)):
        for name, target in ((f"{args.num_adapters} adapters", 0.8), ("1 adapter", 0.9)):
            base_t, lora_t = [t[c] for t in tput["base"]], [t[c] for t in tput[name]]
            ratios = [b / a for a, b in zip(base_t, lora_t)]
            rows.append([name, clock, f"{statistics.median(base_t):.0f}", f"{statistics.median(lora_t):.0f}",
                         f"**{statistics.median(ratios):.2f}**", f">= {target}",
                         " / ".join(f"{r:.2f}" for r in ratios)])
    body = common.markdown_table(["LoRA", "clock", "base tokens/s (median)", "LoRA tokens/s (median)",
                                  "ratio (median of rounds)", "target", "each round's ratio"], rows)
    return body + (f"\n\n{args.num_requests} requests, prompts {args.input_len[0]}..{args.input_len[1]} tokens, "
                   f"{args.output_len[0]}..{args.output_len[1]} new tokens, greedy, prefix caching off, "
                   f"{args.dtype}; adapters of rank {args.rank} on q/k/v/o/gate/up/down of every layer, "
                   f"requests spread round-robin. Medians of {args.repeats} rounds, the runs interleaved in "
                   f"one process. wall: tokens per second; CPU: tokens per second of this process's CPU time "
                   f"(with --threads 1 on a shared machine, the steadier of the two).")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model_args(p)
    common.add_workload_args(p, num_requests=64, input_len=(32, 256), output_len=(128, 128))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16, help="every adapter's rank (and max_lora_rank)")
    common.add_results_args(p)
    args = common.finish_args(p.parse_args(argv))
    body = run(args)
    print(body)
    if not args.no_results:
        common.append_results(args.results, "multi-LoRA throughput against the base model", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())

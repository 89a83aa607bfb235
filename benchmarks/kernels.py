"""Benchmark the Triton PagedAttention kernels against a device-to-device copy and torch.

    python benchmarks/kernels.py                       # default grid, table on stdout
    python benchmarks/kernels.py --kernels decode --batches 32 64 --contexts 4096 8192 --out bench.json
    python benchmarks/kernels.py --sweep               # try decode launch configs on a few shapes

For each shape: the kernel's median time (triton.testing.do_bench, L2 flushed between runs), the
bandwidth it achieves on the bytes that must move (K/V read once + q read + out written; for the
cache write: k/v read + cache written), that bandwidth as a fraction of a large device-to-device
copy measured in the same run, and the times of the engine's torch implementation
(pagoda.engine.layers.attention) and of torch's scaled_dot_product_attention on K/V already gathered into
contiguous tensors (the gather is not timed). Needs a CUDA GPU (exit status 2 without one);
--cpu-smoke runs tiny shapes through Triton's interpreter on CPU to check this script only.

--compile-only needs no GPU: it compiles every kernel variant for sm_90 (or --arch) with Triton's
own ptxas and prints registers, register spills (stack bytes) and shared memory per variant; the
exit status is 1 when a variant fails to compile or spills. It compiles the linear-attention kernels
(engine/layers/triton_delta_rule.py: causal conv1d, gated delta rule) and the mixture-of-experts ones
(engine/layers/triton_moe.py: the gate_up and down grouped GEMMs, SiLU experts in float32, bfloat16 and float16,
gpt-oss's and int8 ones in --dtype) too.
"""
import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODELS = {  # attention shapes: (num_heads, num_kv_heads, head_dim)
    "llama3-8b": (32, 8, 128),
    "qwen3-0.6b": (16, 8, 128),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernels", nargs="+", default=["decode", "prefill", "write"],
                   choices=["decode", "prefill", "write"])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batches", type=int, nargs="+",
                   help="default 1 8 32 64 128 256 (with --sweep: 1 32 128)")
    p.add_argument("--contexts", type=int, nargs="+",
                   help="default 128 1024 4096 16384 32768 (with --sweep: 4096 32768)")
    p.add_argument("--max-cache-gb", type=float, default=24.0,
                   help="skip shapes whose K+V cache would exceed this (GiB)")
    p.add_argument("--max-prefill-tokens", type=int, default=16384,
                   help="prefill: skip shapes with more query tokens (batch * context) than this")
    p.add_argument("--no-torch", action="store_true", help="skip the torch implementation and SDPA")
    p.add_argument("--cuda-graph", action="store_true",
                   help="time the triton kernels inside a CUDA graph (triton.testing.do_bench_cudagraph)")
    p.add_argument("--sweep", action="store_true",
                   help="decode only: try launch configs (tile_n, num_warps, num_stages, programs per SM)")
    p.add_argument("--out", help="write results to this .json or .md file")
    p.add_argument("--compile-only", action="store_true",
                   help="no GPU needed: compile all kernel variants for --arch, report registers/spills")
    p.add_argument("--arch", type=int, default=90, help="--compile-only: CUDA compute capability (90: Hopper)")
    p.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.batches is None:
        args.batches = [1, 32, 128] if args.sweep else [1, 8, 32, 64, 128, 256]
    if args.contexts is None:
        args.contexts = [4096, 32768] if args.sweep else [128, 1024, 4096, 16384, 32768]
    return args


# --------------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------------


def bench_ms(fn, device, cuda_graph=False) -> float:
    if device.type != "cuda":  # --cpu-smoke: only checks that everything runs
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing

    if cuda_graph:
        return triton.testing.do_bench_cudagraph(fn, return_mode="median")
    return triton.testing.do_bench(fn, return_mode="median")


def bench_or_none(fn, device):
    # the torch references gather (and upcast) the whole cache: the biggest shapes may not fit
    try:
        return bench_ms(fn, device)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def copy_bandwidth(device, gib=2.0) -> float:
    """GB/s of a large device-to-device copy, counting bytes read + written."""
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device)
    return 2 * src.numel() * src.element_size() / ms / 1e6


# --------------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------------


def make_inputs(batch, context, query_len, model, dtype, block_size, device, gen):
    num_heads, num_kv_heads, head_dim = MODELS[model]
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = batch * blocks_per_seq + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device, generator=gen)
    v_cache = torch.randn(shape, dtype=dtype, device=device, generator=gen)
    # fragmented: a random permutation of the physical blocks, one -1 padding column
    perm = torch.randperm(num_blocks - 1, device=device, generator=gen).to(torch.int32)
    block_tables = torch.full((batch, blocks_per_seq + 1), -1, dtype=torch.int32, device=device)
    block_tables[:, :blocks_per_seq] = perm.view(batch, blocks_per_seq)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch * query_len, num_heads, head_dim, dtype=dtype, device=device, generator=gen)
    query_start_loc = torch.arange(0, batch * query_len + 1, query_len, dtype=torch.int32, device=device)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, context_lens=context_lens,
                query_start_loc=query_start_loc, scale=head_dim ** -0.5)


_GATHERED = {}


def gathered(k_cache, v_cache, block_tables, context):
    """K, V: [batch, num_kv_heads, context, head_dim], contiguous: the layout SDPA wants. Built on the
    first call (do_bench's warm-up), outside the timed calls."""
    key = (k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), context)
    if key not in _GATHERED:
        _GATHERED.clear()
        idx = block_tables[:, :-1].long()  # [batch, blocks]
        _GATHERED[key] = tuple(c[idx].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
                               for c in (k_cache, v_cache))
    return _GATHERED[key]


# --------------------------------------------------------------------------------------------------
# one shape per kernel
# --------------------------------------------------------------------------------------------------


def run_decode(ta, ref, x, batch, context, args, device):
    q, kc, vc, bt, cl, scale = x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["context_lens"], x["scale"]
    out = torch.empty_like(q)
    row = {"splits": ta.decode_split_plan(batch, kc.shape[2], context, ta._num_sms(device))[0]}
    row["triton_ms"] = bench_ms(lambda: ta.decode_attention(q, kc, vc, bt, cl, scale, max_context_len=context, out=out), device,
                                args.cuda_graph)
    kv_bytes = 2 * batch * context * kc.shape[2] * kc.shape[3] * kc.element_size()
    row["bytes"] = kv_bytes + 2 * q.numel() * q.element_size()
    if not args.no_torch:
        if ref is not None:
            row["torch_ms"] = bench_or_none(lambda: ref.decode_attention(q, kc, vc, bt, cl, scale), device)
            if row["torch_ms"] is not None:
                row["rel_err_vs_torch"] = rel_err(out, ref.decode_attention(q, kc, vc, bt, cl, scale))
        qs = q[:, :, None]  # [batch, num_heads, 1, head_dim]
        row["sdpa_ms"] = bench_or_none(lambda: F.scaled_dot_product_attention(
            qs, *gathered(kc, vc, bt, context), scale=scale, enable_gqa=True), device)
    return row


def run_prefill(ta, ref, x, batch, context, args, device):
    q, kc, vc, bt, cl, qsl, scale = (x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["context_lens"],
                                     x["query_start_loc"], x["scale"])
    out = torch.empty_like(q)
    row = {"query_len": context}
    row["triton_ms"] = bench_ms(
        lambda: ta.prefill_attention(q, kc, vc, bt, qsl, cl, scale, context, out=out), device, args.cuda_graph)
    num_heads, head_dim = q.shape[1], q.shape[2]
    row["bytes"] = 2 * batch * context * kc.shape[2] * head_dim * kc.element_size() + 2 * q.numel() * q.element_size()
    row["flops"] = 4 * batch * num_heads * head_dim * context * (context + 1) / 2  # causal QK^T + PV
    if not args.no_torch:
        if ref is not None:
            run_ref = lambda: ref.prefill_attention(q, kc, vc, bt, qsl, cl, scale, context)  # noqa: E731
            row["torch_ms"] = bench_or_none(run_ref, device)
            if row["torch_ms"] is not None:
                row["rel_err_vs_torch"] = rel_err(out, run_ref())
        qs = q.view(batch, context, num_heads, head_dim).transpose(1, 2)
        row["sdpa_ms"] = bench_or_none(lambda: F.scaled_dot_product_attention(
            qs, *gathered(kc, vc, bt, context), scale=scale, is_causal=True, enable_gqa=True), device)
    return row


def run_write(ta, ref, x, batch, context, args, device):
    # one step's new tokens: batch * min(context, 512) of them, to random free slots
    kc, vc = x["k_cache"], x["v_cache"]
    num_tokens = batch * min(context, 512)
    gen = torch.Generator(device=device).manual_seed(1)
    slots = torch.randperm(kc.shape[0] * kc.shape[1], device=device, generator=gen)[:num_tokens]
    k = torch.randn(num_tokens, kc.shape[2], kc.shape[3], dtype=kc.dtype, device=device, generator=gen)
    v = torch.randn_like(k)
    row = {"num_tokens": num_tokens}
    row["triton_ms"] = bench_ms(lambda: ta.write_kv_cache(k, v, kc, vc, slots), device, args.cuda_graph)
    row["bytes"] = 4 * k.numel() * k.element_size()
    if not args.no_torch and ref is not None:
        row["torch_ms"] = bench_or_none(lambda: ref.write_kv_cache(k, v, kc, vc, slots), device)
    return row


RUNNERS = {"decode": run_decode, "prefill": run_prefill, "write": run_write}


def rel_err(out, want) -> float:
    return ((out.float() - want.float()).norm() / want.float().norm()).item()


def shapes(kernel, args, elem):
    for model in args.models:
        num_kv_heads, head_dim = MODELS[model][1:]
        for batch in args.batches:
            for context in args.contexts:
                cache_gb = 2 * batch * context * num_kv_heads * head_dim * elem / 2**30
                if cache_gb > args.max_cache_gb:
                    continue
                if kernel == "prefill" and batch * context > args.max_prefill_tokens:
                    continue
                yield model, batch, context


def run_all(ta, ref, args, device, copy_gbs):
    dtype = DTYPES[args.dtype]
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for kernel in args.kernels:
        for model, batch, context in shapes(kernel, args, torch.empty(0, dtype=dtype).element_size()):
            query_len = context if kernel == "prefill" else 1
            x = make_inputs(batch, context, query_len, model, dtype, args.block_size, device, gen)
            row = {"kernel": kernel, "model": model, "batch": batch, "context": context}
            row.update(RUNNERS[kernel](ta, ref, x, batch, context, args, device))
            row["gbs"] = row["bytes"] / row["triton_ms"] / 1e6
            row["frac_copy"] = row["gbs"] / copy_gbs
            if "flops" in row:
                row["tflops"] = row["flops"] / row["triton_ms"] / 1e9
            rows.append(row)
            print(format_row(row), flush=True)
            del x
            _GATHERED.clear()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------------------------------
# decode launch-config sweep
# --------------------------------------------------------------------------------------------------


def sweep(ta, args, device, copy_gbs):
    dtype = DTYPES[args.dtype]
    gen = torch.Generator(device=device).manual_seed(0)
    default = (dict(ta.DECODE_CONFIG), ta._PROGRAMS_PER_SM)
    configs = [(dict(tile_n=t, num_warps=w, num_stages=s), p)
               for t in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4) for p in (4, 8, 16)]
    if device.type != "cuda":
        configs = configs[:2]
    rows = []
    for model, batch, context in shapes("decode", args, torch.empty(0, dtype=dtype).element_size()):
        x = make_inputs(batch, context, 1, model, dtype, args.block_size, device, gen)
        q, kc, vc, bt, cl = x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["context_lens"]
        out = torch.empty_like(q)
        nbytes = 2 * batch * context * kc.shape[2] * kc.shape[3] * kc.element_size() + 2 * q.numel() * q.element_size()
        results = []
        for cfg, per_sm in configs:
            ta.DECODE_CONFIG.update(cfg)
            ta._PROGRAMS_PER_SM = per_sm
            try:
                ms = bench_ms(lambda: ta.decode_attention(q, kc, vc, bt, cl, x["scale"], max_context_len=context, out=out), device)
            except Exception as e:  # e.g. out of shared memory
                print(f"  {cfg} per_sm={per_sm}: {type(e).__name__}: {str(e)[:80]}")
                continue
            results.append((ms, cfg, per_sm))
        ta.DECODE_CONFIG.update(default[0])
        ta._PROGRAMS_PER_SM = default[1]
        results.sort(key=lambda r: r[0])
        for ms, cfg, per_sm in results[:3]:
            gbs = nbytes / ms / 1e6
            row = {"kernel": "decode-sweep", "model": model, "batch": batch, "context": context, **cfg,
                   "programs_per_sm": per_sm, "triton_ms": ms, "gbs": gbs, "frac_copy": gbs / copy_gbs}
            rows.append(row)
            print(f"{model:11s} b={batch:<4d} ctx={context:<6d} {cfg} per_sm={per_sm:<3d} "
                  f"{ms * 1e3:9.1f} us {gbs:8.0f} GB/s {gbs / copy_gbs:6.1%} of copy", flush=True)
    return rows


# --------------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------------


COLUMNS = [("kernel", "{}"), ("model", "{}"), ("batch", "{}"), ("context", "{}"), ("splits", "{}"),
           ("triton_us", "{:.1f}"), ("GB/s", "{:.0f}"), ("%copy", "{:.1%}"), ("TFLOP/s", "{:.1f}"),
           ("torch_us", "{:.1f}"), ("sdpa_us", "{:.1f}"), ("x torch", "{:.2f}"), ("x sdpa", "{:.2f}"),
           ("err vs torch", "{:.1e}")]


def cells(row):
    us = lambda k: row[k] * 1e3 if row.get(k) is not None else None  # noqa: E731
    values = {
        "kernel": row["kernel"], "model": row["model"], "batch": row["batch"], "context": row["context"],
        "splits": row.get("splits"), "triton_us": us("triton_ms"), "GB/s": row["gbs"], "%copy": row["frac_copy"],
        "TFLOP/s": row.get("tflops"), "torch_us": us("torch_ms"), "sdpa_us": us("sdpa_ms"),
        "x torch": row["torch_ms"] / row["triton_ms"] if row.get("torch_ms") else None,
        "x sdpa": row["sdpa_ms"] / row["triton_ms"] if row.get("sdpa_ms") else None,
        "err vs torch": row.get("rel_err_vs_torch"),
    }
    return [fmt.format(values[name]) if values[name] is not None else "-" for name, fmt in COLUMNS]


def format_row(row):
    return "  ".join(f"{c:>12s}" for c in cells(row))


def header():
    return "  ".join(f"{name:>12s}" for name, _ in COLUMNS)


def markdown(rows, meta):
    lines = [f"# Kernel benchmark: {meta['device']}", "",
             f"copy bandwidth (read + write): {meta['copy_gbs']:.0f} GB/s; dtype {meta['dtype']}; "
             f"block_size {meta['block_size']}; triton {meta['triton']}; torch {meta['torch']}; "
             f"cuda graph {meta['cuda_graph']}"]
    main_rows = [r for r in rows if not r["kernel"].endswith("sweep")]
    if main_rows:
        lines += ["", "| " + " | ".join(name for name, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(cells(r)) + " |" for r in main_rows]
    sweep_rows = [r for r in rows if r["kernel"].endswith("sweep")]
    if sweep_rows:
        lines += ["", "## decode sweep (best 3 per shape)", "",
                  "| model | batch | context | tile_n | warps | stages | programs/SM | us | GB/s | %copy |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['batch']} | {r['context']} | {r['tile_n']} | {r['num_warps']} | "
                  f"{r['num_stages']} | {r['programs_per_sm']} | {r['triton_ms'] * 1e3:.1f} | {r['gbs']:.0f} | "
                  f"{r['frac_copy']:.1%} |" for r in sweep_rows]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# ahead-of-time compile check (no GPU)
# --------------------------------------------------------------------------------------------------

# (num_heads, num_kv_heads, head_dim) beyond MODELS: MHA, wide and non-power-of-two heads
COMPILE_SHAPES = [(16, 16, 64), (8, 1, 256), (16, 8, 80), (28, 4, 96)]


def capture_launches(ta, dtype, block_size):
    """Call the wrappers on CPU tensors with kernel launches intercepted: -> [(kernel, args, kwargs)]."""
    from triton.runtime.jit import JITFunction

    from pagoda.engine.layers.attention import Variant

    launches = []
    run = JITFunction.run
    JITFunction.run = lambda self, *a, grid, warmup, **kw: launches.append((self, a, kw))
    try:
        for num_heads, num_kv_heads, head_dim in [*MODELS.values(), *COMPILE_SHAPES]:
            kc = torch.empty(64, block_size, num_kv_heads, head_dim, dtype=dtype)
            q = torch.empty(4, num_heads, head_dim, dtype=dtype)
            bt, cl = torch.zeros(4, 8, dtype=torch.int32), torch.ones(4, dtype=torch.int32)
            # plain, and the variants models combine: Gemma 2's window and soft-cap, gpt-oss's window and sinks
            for var in (Variant(), Variant(window=4096, softcap=50.0), Variant(window=128, sinks=torch.zeros(num_heads))):
                for num_splits in (1, 4):
                    ta.decode_attention(q, kc, kc, bt, cl, 0.1, var, max_context_len=4096, num_splits=num_splits)
                ta.prefill_attention(q, kc, kc, bt, torch.zeros(5, dtype=torch.int32), cl, 0.1, 100, var)
            ta.write_kv_cache(q[:, :num_kv_heads], q[:, :num_kv_heads], kc, kc, torch.zeros(4, dtype=torch.int64))
            # --kv-cache-dtype int8, fp8 (a scale per token and head), under 16-bit models: under float32 ones (rare
            # on GPUs) the widened tiles still spill ~200 bytes (head size 96-128) to 3 KB (256) on sm_90
            for kv8 in (torch.int8, torch.float8_e4m3fn) if dtype != torch.float32 else ():
                c8, s = kc.to(kv8), dict(k_scale=torch.ones(kc.shape[:3]), v_scale=torch.ones(kc.shape[:3]))
                for num_splits in (1, 4):
                    ta.decode_attention(q, c8, c8, bt, cl, 0.1, max_context_len=4096, num_splits=num_splits, **s)
                ta.prefill_attention(q, c8, c8, bt, torch.zeros(5, dtype=torch.int32), cl, 0.1, 100, **s)
                ta.write_kv_cache(q[:, :num_kv_heads], q[:, :num_kv_heads], c8, c8, torch.zeros(4, dtype=torch.int64), **s)
    finally:
        JITFunction.run = run
    return launches


# linear-attention shapes: (num_k_heads, num_v_heads, head_k_dim, head_v_dim, conv kernel): Qwen3.5-4B and
# Qwen3-Next, and one with narrower, non-power-of-two value heads
LINEAR_SHAPES = [(16, 32, 128, 128, 4), (8, 16, 64, 96, 4)]


def capture_delta_rule_launches(dtype):
    """As capture_launches, for triton_delta_rule's two wrappers."""
    from triton.runtime.jit import JITFunction

    from pagoda.engine.layers import triton_delta_rule as td

    launches = []
    run = JITFunction.run
    JITFunction.run = lambda self, *a, grid, warmup, **kw: launches.append((self, a, kw))
    try:
        for hk, hv, dk, dv, kernel in LINEAR_SHAPES:
            channels, qsl, slots = 2 * hk * dk + hv * dv, torch.tensor([0, 1, 5], dtype=torch.int32), torch.arange(2)
            x = torch.empty(5, channels, dtype=dtype)
            td.causal_conv1d(x, torch.empty(channels, kernel, dtype=dtype), torch.empty(2, channels, kernel - 1,
                                                                                        dtype=dtype), qsl, slots)
            q, v, g = torch.empty(5, hk, dk, dtype=dtype), torch.empty(5, hv, dv, dtype=dtype), torch.empty(5, hv)
            td.gated_delta_rule(q, q, v, g, g, torch.empty(2, hv, dk, dv), qsl, slots)
    finally:
        JITFunction.run = run
    return launches


# MoE shapes: (experts, hidden, intermediate, top_k, gpt-oss): Qwen3-30B-A3B's, gpt-oss-20b's
MOE_SHAPES = [(128, 2048, 768, 8, False), (32, 2880, 2880, 4, True)]


def capture_moe_launches(dtype):
    """As capture_launches, for triton_moe.fused_experts: a decode step's row blocks and a prefill's, SiLU experts
    in each float dtype and int8, gpt-oss's (biases, clamped SwiGLU) in dtype and int8. The weights are allocated,
    never touched."""
    from triton.runtime.jit import JITFunction

    from pagoda.engine.layers import triton_moe as tm

    launches = []
    run = JITFunction.run
    JITFunction.run = lambda self, *a, grid, warmup, **kw: launches.append((self, a, kw))
    try:
        for e, hidden, inter, top_k, gpt_oss in MOE_SHAPES:
            for wdtype in ((dtype,) if gpt_oss else (torch.float32, torch.bfloat16, torch.float16)) + (torch.int8,):
                xdtype = dtype if wdtype == torch.int8 else wdtype
                if wdtype == torch.int8:  # row-major, a float32 scale per row (Experts.quantize_int8_)
                    w13 = torch.empty(e, 2 * inter, hidden, dtype=wdtype)
                    w2 = torch.empty(e, hidden, inter, dtype=wdtype)
                    scales = dict(s13=torch.empty(e, 2 * inter), s2=torch.empty(e, hidden))
                else:  # k-major, as Experts holds them
                    w13 = torch.empty(e, hidden, 2 * inter, dtype=wdtype).transpose(1, 2)
                    w2 = torch.empty(e, inter, hidden, dtype=wdtype).transpose(1, 2)
                    scales = {}
                extra = dict(b13=torch.empty(e, 2 * inter, dtype=xdtype), b2=torch.empty(e, hidden, dtype=xdtype),
                             swiglu_alpha=1.702, swiglu_limit=7.0) if gpt_oss else {}
                for num_tokens in (1, 256):  # row blocks of 16 and of 64
                    ids = torch.arange(num_tokens * top_k).view(num_tokens, top_k) % e
                    tm.fused_experts(torch.empty(num_tokens, hidden, dtype=xdtype), w13, w2,
                                     torch.empty(num_tokens, top_k), ids, **scales, **extra)
    finally:
        JITFunction.run = run
    return launches


def compile_launch(fn, args, kwargs, target):
    # the signature / constexprs / divisibility attributes JITFunction.run would derive
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    bound = {**dict(zip(fn.arg_names, args)), **kwargs}
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        value = bound[param.name]
        ty, attr = ("constexpr", None) if param.is_constexpr else \
            native_specialize_impl(CUDABackend, value, False, True, True)
        signature[param.name] = ty
        if ty == "constexpr":
            constexprs[param.name] = value
        elif attr:
            attrs[(i,)] = CUDABackend.parse_attr(attr)
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options)
    return kernel, {k: v for k, v in constexprs.items() if k.isupper()}


def resource_usage(cubin: bytes) -> dict:
    import re
    import subprocess
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text)}


def compile_only(args) -> int:
    from triton.backends.compiler import GPUTarget

    from pagoda.engine.layers import triton_attention as ta

    if ta._interpreted():
        print("--compile-only needs TRITON_INTERPRET unset", file=sys.stderr)
        return 2
    target = GPUTarget("cuda", args.arch, 32)
    failed, seen = 0, set()
    launches = capture_launches(ta, DTYPES[args.dtype], args.block_size) + capture_delta_rule_launches(
        DTYPES[args.dtype]) + capture_moe_launches(DTYPES[args.dtype])
    for fn, launch_args, kwargs in launches:
        try:
            kernel, consts = compile_launch(fn, launch_args, kwargs, target)
        except Exception as e:
            print(f"FAILED {fn.__name__} {kwargs}: {type(e).__name__}: {e}")
            failed += 1
            continue
        types = ",".join(dict.fromkeys(str(a.dtype).removeprefix("torch.") for a in launch_args
                                       if isinstance(a, torch.Tensor)))  # one kernel's variants may differ only here
        key = (fn.__name__, str(consts), types)
        if key in seen:
            continue
        seen.add(key)
        use = resource_usage(kernel.asm["cubin"])
        spills = use.get("STACK", 0) + use.get("LOCAL", 0)
        failed += spills > 0
        print(f"{'SPILLS' if spills else 'ok':6s} {fn.__name__:22s} regs={use.get('REG', '?'):<4} "
              f"spill_bytes={spills:<5d} smem={kernel.metadata.shared:<6d} {consts} {types}")
    print(f"sm_{args.arch}, {args.dtype}: {len(seen)} variants, {failed} failed or spilled")
    return 1 if failed else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compile_only:
        return compile_only(args)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels module is imported
        args.models, args.batches, args.contexts = args.models[:1], [2], [40]
        args.max_prefill_tokens = 128
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            print("benchmarks/kernels.py needs a CUDA GPU: torch.cuda.is_available() is False", file=sys.stderr)
            return 2
        if os.environ.get("TRITON_INTERPRET") == "1":
            print("unset TRITON_INTERPRET: the interpreter is not what this benchmark measures", file=sys.stderr)
            return 2
        device = torch.device("cuda")

    import triton

    from pagoda.engine.layers import triton_attention as ta

    ok, why = ta.is_available(device)
    if not ok:
        print(f"triton kernels unavailable: {why}", file=sys.stderr)
        return 2
    try:
        from pagoda.engine.layers import attention as ref
    except Exception as e:  # the engine may be mid-change; the kernels can still be measured
        print(f"torch implementation unavailable ({type(e).__name__}: {e}); skipping it", file=sys.stderr)
        ref = None

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter smoke run)"
    copy_gbs = copy_bandwidth(device, gib=2.0 if device.type == "cuda" else 0.01)
    print(f"{name}: device copy {copy_gbs:.0f} GB/s (read + write), {ta._num_sms(device)} SMs, "
          f"dtype {args.dtype}, block_size {args.block_size}")
    if args.sweep:
        rows = sweep(ta, args, device, copy_gbs)
    else:
        print(header())
        rows = run_all(ta, ref, args, device, copy_gbs)

    if args.out:
        meta = {"device": name, "copy_gbs": copy_gbs, "dtype": args.dtype, "block_size": args.block_size,
                "triton": triton.__version__, "torch": torch.__version__, "cuda_graph": args.cuda_graph,
                "decode_config": ta.DECODE_CONFIG, "prefill_config": ta.PREFILL_CONFIG}
        path = Path(args.out)
        if path.suffix == ".md":
            path.write_text(markdown(rows, meta))
        else:
            path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

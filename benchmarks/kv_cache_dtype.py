"""--kv-cache-dtype int8|fp8 against the 16-bit (and 32-bit) cache: attention throughput, and accuracy.

    python benchmarks/kv_cache_dtype.py attention              # 64 sequences x 2k context, decode, Qwen2.5-0.5B heads
    python benchmarks/kv_cache_dtype.py attention --seqs 8 --context 256 --reps 2   # a quick check
    python benchmarks/kv_cache_dtype.py accuracy               # the trained model (benchmarks/trained_model.py)

attention: one decode step's paged attention (one layer) over every sequence's full context, through
the engine's backend for the device (CPU: pagoda's C++ op; CUDA: the Triton kernels), each cache in
turn, interleaved, median of --reps; the ratios are over the bfloat16 cache. Target: 8-bit >= 1.5x.

accuracy: greedy continuations of --tokens tokens from held-out prompts of the trained model's corpus
with the full-precision cache (the model's --dtype) and with each 8-bit one: the share of continuations
identical throughout, the mean share of tokens before the first difference, and the mean |delta logprob|
of the full-precision continuation's tokens, teacher-forced (prompt logprobs over prompt + continuation).
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_results_args, append_results, apply_threads, markdown_table, machine  # noqa: E402

CACHES = ("bfloat16", "float32", "int8", "fp8")


def _caches(kind: str, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, device, gen):
    """(k_cache, v_cache, scales dict) filled with random values, in the standard layout."""
    from pagoda.engine.layers.attention import KV_CACHE_DTYPES, quantize_kv
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k, v = (torch.randn(shape, generator=gen).to(device) for _ in range(2))
    if kind not in KV_CACHE_DTYPES:
        return k.to(getattr(torch, kind)), v.to(getattr(torch, kind)), {}
    (k8, ks), (v8, vs) = (quantize_kv(x.view(-1, kv_heads, head_dim), KV_CACHE_DTYPES[kind]) for x in (k, v))
    return k8.view(shape), v8.view(shape), dict(k_scale=ks.view(shape[:3]), v_scale=vs.view(shape[:3]))


def attention(args) -> str:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    if device.type == "cuda":
        from pagoda.engine.layers import triton_attention as backend
        views = None
    else:
        from pagoda.engine.layers import cpu_attention as backend
        views = backend
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-args.context // args.block_size)
    num_blocks = args.seqs * per_seq
    tables = torch.randperm(num_blocks, generator=gen).int().view(args.seqs, per_seq).to(device)
    lens = torch.full((args.seqs,), args.context, dtype=torch.int32, device=device)
    calls = {}
    for kind in args.caches:
        kc, vc, scales = _caches(kind, num_blocks, args.block_size, args.kv_heads, args.head_dim, device, gen)
        if views is not None:  # the C++ op's own layout of the same bytes
            kc, vc = views.cache_views(kc, vc)
            if scales:
                scales = dict(zip(("k_scale", "v_scale"), views.scale_views(scales["k_scale"], scales["v_scale"])))
        qdtype = torch.float32 if kind == "float32" else torch.bfloat16
        q = torch.randn(args.seqs, args.heads, args.head_dim, generator=gen).to(device, qdtype)
        calls[kind] = (lambda q=q, kc=kc, vc=vc, s=scales:
                       backend.decode_attention(q, kc, vc, tables, lens, args.head_dim ** -0.5, **s))
        calls[kind]()  # warm-up (Triton: compiles)
    times = {kind: [] for kind in calls}
    for _ in range(args.reps):  # interleaved: every cache sees the same machine
        for kind, call in calls.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            call()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[kind].append((time.perf_counter() - t) * 1e3)
    base = statistics.median(times["bfloat16"]) if "bfloat16" in times else None
    rows = []
    for kind, ts in times.items():
        ms = statistics.median(ts)
        bytes_per_token = {"bfloat16": 2, "float32": 4}.get(kind, 1) * args.head_dim + (4 if kind in ("int8", "fp8") else 0)
        kv_bytes = 2 * args.seqs * args.context * args.kv_heads * bytes_per_token
        rows.append([kind, f"{ms:.2f}", f"{kv_bytes / ms / 1e6:.1f}", f"{base / ms:.2f}x" if base else "-"])
    what = (f"decode attention, {args.seqs} sequences x {args.context} context, {args.heads} heads / "
            f"{args.kv_heads} KV heads x {args.head_dim}, block {args.block_size}, {device.type} "
            f"({backend.__name__.rsplit('.', 1)[-1]}), median of {args.reps}")
    return what + "\n\n" + markdown_table(["KV cache", "ms / call", "KV GB/s", "vs bfloat16"], rows)


def accuracy(args) -> str:
    import trained_model
    from pagoda.engine import LLM, SamplingParams
    from transformers import AutoTokenizer

    path = args.model or trained_model.build(args.train_steps)["target"]
    tok = AutoTokenizer.from_pretrained(path)
    # held-out prompts: the standard library source past what the model was trained on
    text = trained_model.corpus(9 << 20)[8 << 20:]
    ids = tok(text)["input_ids"]
    step = len(ids) // args.prompts
    prompts = [ids[i * step:i * step + args.prompt_len] for i in range(args.prompts)]
    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)

    def run(kv: str):
        llm = LLM(path, dtype=args.dtype, kv_cache_dtype=kv, num_kv_blocks=args.prompts * 16 + 64)
        outs = [o.token_ids for o in llm.generate(prompts, greedy)]
        return llm, outs

    full_llm, full = run("auto")
    forced = [p + o for p, o in zip(prompts, full)]

    def logprobs(llm):  # of the full-precision continuation's tokens
        outs = llm.generate(forced, scored)
        return torch.tensor([t.logprob for o in outs for t in o.prompt_logprobs[args.prompt_len:]])

    base = logprobs(full_llm)
    rows = []
    for kv in ("int8", "fp8"):
        llm, outs = run(kv)
        same = sum(a == b for a, b in zip(outs, full)) / len(full)
        first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), args.tokens) for a, b in zip(outs, full)]
        delta = (logprobs(llm) - base).abs()
        rows.append([kv, f"{same:.0%}", f"{statistics.mean(first_diff) / args.tokens:.0%}",
                     f"{delta.mean():.4f}", f"{delta.max():.3f}"])
    what = (f"trained model ({path}), {args.dtype}, {args.prompts} held-out prompts of {args.prompt_len} tokens, "
            f"{args.tokens} greedy tokens, against the {args.dtype} KV cache")
    return what + "\n\n" + markdown_table(
        ["KV cache", "continuations identical", "mean agreeing prefix", "mean |Δ logprob|", "max |Δ logprob|"], rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["attention", "accuracy"])
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--heads", type=int, default=14, help="query heads (default: Qwen2.5-0.5B's 14)")
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--caches", nargs="+", choices=CACHES, default=list(CACHES))
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--cpu", action="store_true", help="the C++ op even where CUDA is available")
    p.add_argument("--model", help="accuracy: this checkpoint instead of the trained model's target")
    p.add_argument("--train-steps", type=int, default=600, help="accuracy: the trained model's (trained_model.py --steps)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="accuracy: the model's dtype")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int)
    add_results_args(p)
    args = p.parse_args(argv)
    apply_threads(args.threads)
    with torch.inference_mode():
        body = attention(args) if args.what == "attention" else accuracy(args)
    print(f"Machine: {machine()}\n\n{body}")
    if not args.no_results:
        append_results(args.results, f"KV cache dtype: {args.what}", body)


if __name__ == "__main__":
    main()

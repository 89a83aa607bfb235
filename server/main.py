"""`pagoda serve [MODEL]`: one engine behind two doors, gRPC (pagoda.v1, grpc.health.v1, reflection) on
--port (default 50051) and HTTP (OpenAI API) on --http-port (default 8000). Flags (each also a PAGODA_*
environment variable) and the process around server/app.py's PagodaServer. Only the standard library
is imported at module level, so building the `pagoda` parser stays fast.

Start-up: the server listens at once with grpc.health.v1 NOT_SERVING, loads the engine in a thread,
then turns SERVING. SIGTERM (or Ctrl-C): health NOT_SERVING, new calls UNAVAILABLE, in-flight calls
get --grace-period seconds to finish, then the engine shuts down and the process exits 0; a second
signal ends it at once.

The flags come from the fields of engine/config.py's EngineConfig, server/options.py's ServerOptions
(limits, keepalive, TLS / mutual TLS, API key, metrics) and ServeProcess below (add_options).

With --node-rank K > 0 (tensor parallelism across nodes) the process serves no API: serve_node.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import time
from dataclasses import dataclass, field

log = logging.getLogger("pagoda.server")

DEFAULT_PORT = 50051
DEFAULT_GRACE_S = 30.0


@dataclass
class ServeProcess:
    """`pagoda serve`'s own flags, declared as EngineConfig's and ServerOptions' are; serve() and run()
    read them from the parsed args."""
    host: str = field(default="[::]", metadata={"help": "address to listen on (default: [::], all interfaces)"})
    port: int = field(default=DEFAULT_PORT, metadata={"help": (
        f"port of the gRPC API (pagoda.v1), 0 = any free one (default: {DEFAULT_PORT}); the HTTP (OpenAI) API's is "
        "--http-port")})
    grace_period: float = field(default=DEFAULT_GRACE_S, metadata={
        "help": f"seconds in-flight calls get to finish on SIGTERM or Ctrl-C; a second one quits at once (default: "
                f"{DEFAULT_GRACE_S:g})"})
    log_level: str = field(default="INFO", metadata={"help": "logging level (default: INFO)"})
    log_format: str = field(default="text", metadata={
        "choices": ("text", "json"), "help": "text, or json: one JSON object per line (default: text)"})


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The serve flags; each defaults to its PAGODA_* environment variable (read now, not at import)."""
    from pagoda.engine.config import EngineConfig  # torch-free
    from pagoda.server.options import ServerOptions  # standard library only

    p.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                   help="the model, as with --model (as `vllm serve MODEL`)")
    groups = {None: p, **{title: p.add_argument_group(title) for title in ("limits", "security", "observability")}}
    for cls in (EngineConfig, ServerOptions, ServeProcess):
        add_options(groups, cls)


def model_of(args: argparse.Namespace) -> str | None:
    """The model: the positional MODEL or --model (PAGODA_MODEL: a default the positional overrides);
    ValueError when the two name different models."""
    given, flag = getattr(args, "model_arg", None), args.model or None
    if given is None:
        return flag
    if flag is not None and flag != given and flag != os.environ.get("PAGODA_MODEL"):
        raise ValueError(f"MODEL {given!r} and --model {flag!r} name different models: give one of them")
    return given


def check_serve_args(args: argparse.Namespace) -> None:
    """What the flags say together, before anything binds or loads: ValueError with the line to show."""
    from pagoda.server.ports import same_port

    model_of(args)
    clash = same_port([("--port", args.host, args.port), ("--http-port", args.host, args.http_port),
                       ("--metrics-port", args.metrics_host, args.metrics_port)])
    if clash:
        raise ValueError(clash)


def add_options(groups: dict, cls) -> None:
    """Adds a flag for each field of dataclass cls whose metadata has a "help": --NAME-WITH-DASHES (or
    metadata "flag") in groups[metadata "group"] (None: the parser itself), defaulting to PAGODA_NAME
    (none with "env": False), else to "serve_default" where given, else to the field's default.
    "type", "choices", "nargs", "const" and "metavar" go to argparse (an int or float default gives the
    type); a bool is a choice of on/off; "none" is the flag's value for None (and its default then)."""
    for f in dataclasses.fields(cls):
        m = f.metadata
        if "help" not in m:
            continue
        kw = {key: m[key] for key in ("type", "choices", "nargs", "const", "metavar") if key in m}
        default, text = m.get("serve_default", f.default), m["help"]
        if isinstance(f.default, bool):
            default, kw["choices"] = "on" if default else "off", ("on", "off")
        elif default is None:
            default = m.get("none")
        if "type" not in kw and type(default) in (int, float):
            kw["type"] = type(default)
        if m.get("env", True):
            env = "PAGODA_" + _dest(f).upper()
            default, text = os.environ.get(env, default), f"{text} [env {env}]"  # argparse types a str default too
        groups[m.get("group")].add_argument(_flag(f), default=default, help=text, **kw)


def from_args(cls, args: argparse.Namespace, **given):
    """Dataclass cls from the flags add_options made (those not in args: the field's default)."""
    values = {f.name: _value(f, getattr(args, _dest(f))) for f in dataclasses.fields(cls)
              if "help" in f.metadata and hasattr(args, _dest(f))}
    return cls(**{**values, **given})


def _value(f, value):
    m = f.metadata
    if isinstance(f.default, bool):
        return value == "on"
    if m.get("nargs") == "+" and isinstance(value, str):  # from the environment: separated by spaces
        return value.split()
    return None if "none" in m and value == m["none"] else value


def _flag(f) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def _dest(f) -> str:
    return _flag(f)[2:].replace("-", "_")


def server_options(args: argparse.Namespace):
    """The ServerOptions of the parsed flags."""
    from pagoda.server.options import ServerOptions

    return from_args(ServerOptions, args)


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
    """The EngineConfig of the parsed flags; --cpu-threads 0: a core less than usable, over the ranks."""
    from pagoda.engine import EngineConfig

    world = args.tensor_parallel_size * args.pipeline_parallel_size
    per_node = max(1, world // max(1, args.nnodes))
    threads = args.cpu_threads or max(1, serving_cpu_threads() // per_node)
    return from_args(EngineConfig, args, cpu_threads=threads, model=model_of(args))


def _build_engine(args: argparse.Namespace):
    """Runs in the loading thread: importing torch and the engine is part of loading."""
    log.info("loading %s: importing torch, starting the engine", model_of(args) or "the demo model")
    from pagoda.engine import AsyncEngine

    return AsyncEngine(engine_config(args))


async def serve(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    received = []

    def on_signal(sig):
        received.append(sig)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
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
    if received[0] == signal.SIGINT:
        log.info("Ctrl-C: shutting down; press Ctrl-C again to quit now")
    else:
        log.info("SIGTERM: shutting down; a second signal quits at once")
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _quit_now, sig)
    await server.drain(args.grace_period)
    return 0


def _quit_now(sig) -> None:
    """A second signal while draining: out at once, the calls in flight cut off."""
    log.warning("%s again: quitting now", "Ctrl-C" if sig == signal.SIGINT else "signal")
    logging.shutdown()  # flushes the handlers: os._exit does not
    os._exit(1)


def setup_logging(level: str, fmt: str = "text") -> None:
    handler = logging.StreamHandler()
    if fmt == "json":
        from pagoda.server.metrics import JsonFormatter

        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=str(level).upper(), handlers=[handler])


def run(args: argparse.Namespace) -> int:
    try:
        check_serve_args(args)
    except ValueError as e:  # a usage error: argparse's exit 2, after the usage line
        args.parser.error(str(e))
    setup_logging(args.log_level, getattr(args, "log_format", "text"))
    if args.node_rank:
        return serve_node(args)
    return asyncio.run(serve(args))


def serve_node(args: argparse.Namespace) -> int:
    """--node-rank k > 0 (multi-node tensor parallelism): this node's ranks (engine/executor/node.py) and
    no API (node 0 serves it). It serves grpc.health.v1 on --host:--port: SERVING once its ranks have
    built their shards, while they run. Exits 0 when the driver stops the ranks, 1 when they end otherwise
    (the driver gone, a rank failed) or cannot start; SIGTERM or SIGINT kill the ranks and exit 0."""
    from pagoda.engine.executor.node import Node  # torch-free: the ranks import it

    try:
        config = engine_config(args)
        server, health, port = _health_only(args.host, args.port)
    except (ValueError, OSError) as e:
        log.error("%s", e)
        return 1
    first = config.node_rank * config.ranks_per_node
    ranks = f"ranks {first}..{first + config.ranks_per_node - 1} of {config.world_size}"
    log.info("node %d of %d (%s): listening on %s:%s (port %d), grpc.health.v1 only (the API is node 0's); "
             "the ranks join node 0 at %s:%d", config.node_rank, config.nnodes, ranks, args.host, args.port, port,
             config.master_addr, config.master_port)
    node = Node(config)
    try:
        code = _watch(node, health, ranks)
    finally:
        health.enter_graceful_shutdown()
        node.close()
        server.stop(None)
    if code is None:
        return 0
    if code:
        log.error("exiting with code 1: this node's ranks ended (node 0 is gone, or a rank failed)")
    else:
        log.info("node 0 stopped this node's ranks")
    return code


def _health_only(host: str, port: int):
    """A gRPC server of grpc.health.v1 alone, NOT_SERVING: (server, its health servicer, the bound port)."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as e:
        raise OSError(f"cannot listen on {host}:{port} (--port): {e}") from None
    server.start()
    return server, servicer, bound


def _watch(node, health, ranks: str) -> int | None:
    """Until the node's ranks end (their code, node.poll) or a signal (None); health SERVING once loaded."""
    from grpc_health.v1 import health_pb2

    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda sig, frame: stop.append(sig))
    serving = False
    while not stop:
        code = node.poll()
        if code is not None:
            return code
        if not serving and node.loaded():
            serving = True
            health.set("", health_pb2.HealthCheckResponse.SERVING)
            log.info("%s loaded: running node 0's steps", ranks)
        time.sleep(0.2)
    log.info("%s: killing this node's ranks", signal.Signals(stop[0]).name)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda serve", description=__doc__)
    add_serve_args(parser)
    parser.set_defaults(parser=parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

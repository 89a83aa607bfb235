"""Serving benchmark: an asyncio gRPC load generator against `pagoda serve` (GenerateStream).

Requests are the same random-token prompts as benchmarks/throughput.py (same flags, same seed),
greedy, EOS ignored, max_tokens = the request's output length; every stream must return exactly
that many tokens (a mismatch or a failed call is an error and makes the exit status 1).
Arrivals: --concurrency N clients, each sending its next request when the last one ends, or
--request-rate R (Poisson arrivals, R requests/s).

    python benchmarks/serving.py --spawn-server --offline-compare --model-config tiny \\
        --num-requests 64 --input-len 32 256 --output-len 128 128 --concurrency 64
"""
import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import common
import numpy as np
from tqdm import tqdm

THROUGHPUT_PY = os.path.join(common.ROOT, "benchmarks", "throughput.py")


@dataclass
class Record:
    """One request as the client saw it (times from time.perf_counter)."""
    index: int
    prompt_len: int
    asked: int
    sent: float = 0.0
    arrivals: list = field(default_factory=list)  # (time, tokens in that message)
    tokens: int = 0
    finish_reason: int = 0
    usage_tokens: int = -1
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.tokens == self.asked == self.usage_tokens

    def problem(self) -> str:
        if self.error:
            return self.error
        return f"asked for {self.asked} tokens, stream carried {self.tokens}, usage said {self.usage_tokens}"


# ---- the client ----

def stream_request(pb, index: int, prompt: list[int], n: int):
    return pb.GenerateStreamRequest(request_id=f"bench-{index}", token_ids=pb.TokenIds(ids=prompt),
                                    sampling=pb.SamplingParams(temperature=0.0),
                                    stopping=pb.StoppingCriteria(max_tokens=n, ignore_eos=True))


async def one_request(stub, pb, index, prompt, n, timeout) -> Record:
    import grpc

    rec = Record(index, len(prompt), n)
    rec.sent = time.perf_counter()
    try:
        async for msg in stub.GenerateStream(stream_request(pb, index, prompt, n), timeout=timeout):
            if msg.token_ids:
                rec.arrivals.append((time.perf_counter(), len(msg.token_ids)))
                rec.tokens += len(msg.token_ids)
            if msg.finish_reason:
                rec.finish_reason, rec.usage_tokens = msg.finish_reason, msg.usage.completion_tokens
    except grpc.aio.AioRpcError as e:
        rec.error = f"{e.code().name}: {e.details()}"
    if rec.error is None and rec.finish_reason != pb.FINISH_REASON_LENGTH:
        rec.error = f"finish_reason {pb.FinishReason.Name(rec.finish_reason)}, expected FINISH_REASON_LENGTH"
    return rec


async def one_http_request(client, url: str, model: str, index, prompt, n, timeout) -> Record:
    """The same request over the OpenAI-compatible HTTP API, streamed (SSE), with each chunk's token
    ids (return_token_ids) and the usage at the end."""
    import orjson

    rec = Record(index, len(prompt), n)
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    finish = None
    rec.sent = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, timeout=timeout) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = orjson.loads(line[6:])
                for c in chunk.get("choices", ()):
                    if c.get("token_ids"):
                        rec.arrivals.append((time.perf_counter(), len(c["token_ids"])))
                        rec.tokens += len(c["token_ids"])
                    finish = c.get("finish_reason") or finish
                if chunk.get("usage"):
                    rec.usage_tokens = chunk["usage"]["completion_tokens"]
    except Exception as e:  # noqa: BLE001 - a failed stream is counted, not fatal
        rec.error = f"{type(e).__name__}: {e}"
    if rec.error is None and finish != "length":
        rec.error = f"finish_reason {finish!r}, expected 'length'"
    return rec


@contextlib.asynccontextmanager
async def client_for(target, protocol: str, timeout: float):
    """send(index, prompt, n) -> Record over `protocol` against target (grpc host:port or http base URL)."""
    if protocol == "grpc":
        import grpc
        from pagoda.v1 import generation_pb2 as pb
        from pagoda.v1 import generation_pb2_grpc as pb_grpc

        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            yield lambda i, prompt, n: one_request(stub, pb, i, prompt, n, timeout)
        return
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = (await client.get(f"{target}/v1/models")).json()["data"][0]["id"]
        yield lambda i, prompt, n: one_http_request(client, f"{target}/v1/completions", model, i, prompt, n, timeout)


async def run_load(target, workload, args, protocol: str = "grpc", bar=None) -> tuple[list[Record], float]:
    """Sends the workload; returns the records and the wall time from first send to last end."""
    async with client_for(target, protocol, args.request_timeout) as request:
        async def send(i):
            rec = await request(i, workload[i][0], workload[i][1])
            if bar is not None:
                bar.update(1)
            return rec

        start = time.perf_counter()
        if args.request_rate:
            records = await poisson(send, len(workload), args.request_rate, args.seed)
        else:
            records = await closed_loop(send, len(workload), args.concurrency)
        return records, time.perf_counter() - start


async def closed_loop(send, count: int, concurrency: int) -> list[Record]:
    """`concurrency` clients; each sends the next request (in order) when its last one ends."""
    pending = iter(range(count))
    records = []

    async def client():
        for i in pending:
            records.append(await send(i))

    await asyncio.gather(*(client() for _ in range(min(concurrency, count))))
    return sorted(records, key=lambda r: r.index)


async def poisson(send, count: int, rate: float, seed: int) -> list[Record]:
    gaps = np.random.default_rng(seed + 2).exponential(1.0 / rate, size=count)
    tasks = []
    for i, gap in enumerate(gaps):
        if i:
            await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(send(i)))
    return list(await asyncio.gather(*tasks))


# ---- metrics ----

def metrics(records: list[Record], duration: float) -> dict:
    good = [r for r in records if r.ok]
    ttft = [r.arrivals[0][0] - r.sent for r in good]
    e2e = [r.arrivals[-1][0] - r.sent for r in good]
    tpot = [(r.arrivals[-1][0] - r.arrivals[0][0]) / (r.tokens - 1) for r in good if r.tokens > 1]
    # one inter-token latency per streamed message after the first (a message may carry several tokens)
    itl = [b[0] - a[0] for r in good for a, b in zip(r.arrivals, r.arrivals[1:])]
    prompt = sum(r.prompt_len for r in good)
    output = sum(r.tokens for r in good)
    return {
        "completed": len(good), "failed": len(records) - len(good), "duration_s": duration,
        "requests_per_s": len(good) / duration, "output_tokens_per_s": output / duration,
        "total_tokens_per_s": (prompt + output) / duration,
        "ttft_ms": ms(common.percentiles(ttft)), "tpot_ms": ms(common.percentiles(tpot)),
        "itl_ms": ms(common.percentiles(itl)), "e2e_ms": ms(common.percentiles(e2e)),
        "tokens_per_message": output / max(1, sum(len(r.arrivals) for r in good)),
    }


def ms(stats: dict) -> dict:
    return {k: v * 1000 for k, v in stats.items()}


def report(m: dict, offline: dict | None) -> str:
    rows = [[name, f"{m[key]['mean']:.1f}", f"{m[key]['p50']:.1f}", f"{m[key]['p90']:.1f}", f"{m[key]['p99']:.1f}"]
            for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))]
    text = [common.markdown_table(["latency (ms)", "mean", "p50", "p90", "p99"], rows), "",
            f"- completed {m['completed']}, failed {m['failed']}, in {m['duration_s']:.1f} s "
            f"({m['tokens_per_message']:.2f} tokens per streamed message)",
            f"- throughput: {m['requests_per_s']:.2f} requests/s, {m['output_tokens_per_s']:.1f} output tok/s, "
            f"{m['total_tokens_per_s']:.1f} total tok/s"]
    if offline:
        text.append(f"- offline pagoda on the same workload: {offline['output_tokens_per_s']:.1f} output tok/s "
                    f"({offline['elapsed_s']:.1f} s); serving/offline = "
                    f"{m['serving_over_offline']:.3f}")
    return "\n".join(text)


# ---- the server process ----

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pagoda_command() -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "pagoda")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "pagoda.client.cli"]


@contextlib.contextmanager
def spawned_server(path: str, args, env: dict | None = None):
    """`pagoda serve` on free loopback ports (gRPC, HTTP), until SERVING; SIGTERM on the way out.
    Yields {"grpc": host:port, "http": base URL}. `env`: its OTEL_* variables (none: tracing off)."""
    port, http_port = free_port(), free_port()
    cmd = pagoda_command() + ["serve", "--model", path, "--host", "127.0.0.1", "--port", str(port),
                              "--http-port", str(http_port),
                              "--dtype", args.dtype, "--quantization", args.quantization,
                              "--device", args.device, "--log-level", "WARNING"]
    if args.threads:
        cmd += ["--cpu-threads", str(args.threads)]
    cmd += shlex.split(args.server_args or "")
    log = tempfile.NamedTemporaryFile("w+", prefix="pagoda-serve-", suffix=".log", delete=False)
    print(f"starting: {shlex.join(cmd)} (log {log.name})", file=sys.stderr)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=common.ROOT, env={**environ, **(env or {})})
    try:
        wait_serving(f"127.0.0.1:{port}", proc, args.server_timeout, log.name)
        yield {"grpc": f"127.0.0.1:{port}", "http": f"http://127.0.0.1:{http_port}"}
    finally:
        stop_server(proc)
        log.close()
    os.unlink(log.name)  # kept when something failed


def wait_serving(target: str, proc, timeout: float, log_path: str) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                sys.exit(f"pagoda serve exited with {proc.returncode}; see {log_path}")
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    sys.exit(f"pagoda serve was not SERVING after {timeout:.0f} s; see {log_path}")


def stop_server(proc) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- tracing on vs off ----

@contextlib.contextmanager
def discarding_otlp_receiver():
    """An OTLP/HTTP endpoint (a thread of this process) that reads each export, counts it and answers
    200 with an empty ExportTraceServiceResponse. Yields (endpoint URL, {"exports", "bytes"})."""
    import http.server
    import threading

    seen = {"exports": 0, "bytes": 0}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            seen["bytes"] += len(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            seen["exports"] += 1
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", seen
    finally:
        server.shutdown()
        server.server_close()


def span_cost(calls: int = 2000) -> float:
    """Seconds the server spends on one finished call's spans (server/tracing.py record_call: a call of
    one completion, 7 spans, with a prefill chunk event) plus their OTLP protobuf encoding, which the
    exporter's thread does; measured here in one process, nothing sent."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    from pagoda.engine.outputs import RequestMetrics, RequestOutput
    from pagoda.server.metrics import RequestRecord
    from pagoda.server.tracing import Tracing

    class Encode(SpanExporter):
        def export(self, spans):
            encode_spans(spans).SerializeToString()
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(Encode()))
    tracing, t = Tracing(provider), time.monotonic()
    metrics = RequestMetrics(t, t + 0.01, t + 0.05, t + 1.0, ((t + 0.01, t + 0.05, 100),), ())
    out = RequestOutput("r", [], "", finished=True, finish_reason="length", stop_reason="length",
                        num_prompt_tokens=100, num_generated_tokens=128, metrics=metrics)

    def one():
        record = RequestRecord("GenerateStream")
        record.t0, record.t_engine, record.t_end, record.lasts[0, 0] = t, t + 0.001, t + 1.01, out
        tracing.record_call(record, "OK")

    for _ in range(calls // 10):
        one()
    start = time.perf_counter()
    for _ in range(calls):
        one()
    return (time.perf_counter() - start) / calls


def tracing_compare(path: str, workload, warmup, args) -> str:
    """--tracing-compare N: N rounds, each of a fresh server with tracing off and one with tracing on
    (OTLP/HTTP to discarding_otlp_receiver), in alternating order (ABBA); output throughput of each,
    and on/off over all rounds."""
    rows, ratios, on_total, off_total = [], [], 0.0, 0.0
    with discarding_otlp_receiver() as (endpoint, seen):
        env_on = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_SERVICE_NAME": "pagoda-bench"}
        for r in range(args.tracing_compare):
            tps = {}
            for name in (("off", "on") if r % 2 == 0 else ("on", "off")):
                with spawned_server(path, args, env_on if name == "on" else None) as targets:
                    records, duration = run_serving(targets["grpc"], workload, warmup, args, "grpc")
                bad = [rec for rec in records if not rec.ok]
                if bad:
                    raise SystemExit(f"ERROR tracing {name}: request {bad[0].index}: {bad[0].problem()}")
                tps[name] = metrics(records, duration)["output_tokens_per_s"]
            on_total, off_total = on_total + tps["on"], off_total + tps["off"]
            ratios.append(tps["on"] / tps["off"])
            rows.append(f"| {r + 1} | {tps['off']:.1f} | {tps['on']:.1f} | {ratios[-1]:.3f} |")
        exports = dict(seen)
    return "\n".join(["| round | tracing off, tok/s | tracing on, tok/s | on/off |", "|---|---|---|---|", *rows,
                      f"| all | {off_total / len(rows):.1f} | {on_total / len(rows):.1f} | "
                      f"{on_total / off_total:.3f} |", f"| median of rounds | | | {float(np.median(ratios)):.3f} |", "",
                      f"The receiver got {exports['exports']} OTLP exports ({exports['bytes']} bytes) from the "
                      f"servers with tracing on. One call's spans cost {span_cost() * 1e6:.0f} us to build and "
                      f"encode (span_cost: 1 completion, 7 spans; this process, nothing sent)."])


# ---- offline comparison ----

def offline_throughput(path: str, args) -> dict:
    """Runs throughput.py (pagoda only) on the same model and workload in a separate process."""
    out = tempfile.NamedTemporaryFile(prefix="pagoda-offline-", suffix=".json", delete=False).name
    cmd = [sys.executable, THROUGHPUT_PY, "--model", path, "--dtype", args.dtype, "--quantization", args.quantization,
           "--device", args.device,
           "--num-requests", str(args.num_requests), "--input-len", *map(str, args.input_len),
           "--output-len", *map(str, args.output_len), "--seed", str(args.seed), "--peers", "pagoda",
           "--json", out, "--no-results"]
    threads = engine_threads(args)
    if threads and args.device != "cuda":
        cmd += ["--threads", str(threads)]
    print(f"offline run: {shlex.join(cmd)}", file=sys.stderr)
    try:
        subprocess.run(cmd, check=True, cwd=common.ROOT)
        return read_offline(out, args)
    finally:
        os.unlink(out)


def engine_threads(args) -> int | None:
    """The spawned server's engine threads on CPU (--threads, else `pagoda serve`'s default of a core
    less than the machine's): the offline run gets as many, so that the ratio measures the service
    layer, not a core given to it. None: a server we did not start (its threads are unknown)."""
    if args.threads or not args.spawn_server:
        return args.threads
    from pagoda.server.main import serving_cpu_threads
    return serving_cpu_threads()


def read_offline(path: str, args) -> dict:
    with open(path) as f:
        doc = json.load(f)
    same = (doc["num_requests"], list(doc["input_len"]), list(doc["output_len"]), doc["seed"]) == \
        (args.num_requests, list(args.input_len), list(args.output_len), args.seed)
    if not same:
        print(f"WARNING: {path} was measured on another workload", file=sys.stderr)
    return next(r for r in doc["results"] if r["peer"] == "pagoda")


# ---- main ----

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p)
    common.add_workload_args(p)
    g = p.add_argument_group("load")
    m = g.add_mutually_exclusive_group()
    m.add_argument("--concurrency", type=int, default=64, help="closed loop: clients in flight (default 64)")
    m.add_argument("--request-rate", type=float, help="open loop: Poisson arrivals, requests per second")
    g.add_argument("--request-timeout", type=float, default=1800, help="deadline of each call, s (default 1800)")
    s = p.add_argument_group("server")
    s.add_argument("--target", default="localhost:50051", help="a running server (default localhost:50051)")
    s.add_argument("--http-target", default="http://localhost:8000",
                   help="its HTTP API, for --protocol http (default http://localhost:8000)")
    s.add_argument("--protocol", choices=["grpc", "http", "both"], default="grpc",
                   help="GenerateStream over gRPC, streamed /v1/completions over HTTP, or both one after the "
                        "other (with --spawn-server each against a fresh server, so that neither finds the "
                        "other's prompts in the prefix cache), with HTTP's throughput over gRPC's (default grpc)")
    s.add_argument("--spawn-server", action="store_true",
                   help="start `pagoda serve` for this run on a free loopback port, stop it afterwards")
    s.add_argument("--server-args", help="extra `pagoda serve` flags, one string (with --spawn-server)")
    s.add_argument("--server-timeout", type=float, default=600, help="seconds to wait for SERVING (default 600)")
    o = p.add_mutually_exclusive_group()
    o.add_argument("--offline-compare", action="store_true",
                   help="also run the workload offline (throughput.py, pagoda only, another process, after "
                        "the serving run) and report serving/offline throughput")
    o.add_argument("--offline-json", metavar="PATH", help="read the offline numbers from a throughput.py --json")
    o.add_argument("--tracing-compare", type=int, metavar="ROUNDS",
                   help="with --spawn-server over gRPC: ROUNDS rounds of a server with tracing off and one with "
                        "OpenTelemetry tracing on (OTLP/HTTP to a receiver here that discards it), interleaved, "
                        "and the throughput ratio")
    p.add_argument("--json", metavar="PATH", help="write the measurements here")
    common.add_results_args(p)
    p.add_argument("--no-progress", action="store_true")
    return common.finish_args(p.parse_args(argv))


def run_serving(target: str, workload, warmup, args, protocol: str) -> tuple[list[Record], float]:
    asyncio.run(run_load(target, warmup, args, protocol))
    with tqdm(total=len(workload), desc=f"serving ({protocol})", unit="req", file=sys.stderr,
              disable=args.no_progress) as bar:
        return asyncio.run(run_load(target, workload, args, protocol, bar))


def describe(args, path: str, workload, target: str) -> str:
    load = f"Poisson arrivals at {args.request_rate} requests/s" if args.request_rate else \
        f"{args.concurrency} concurrent streams"
    server = "spawned `pagoda serve`" if args.spawn_server else "running server"
    if args.spawn_server and args.server_args:
        server += f" {args.server_args}"
    if args.spawn_server and args.device != "cuda":
        server += f", engine CPU threads {engine_threads(args)}"
    model = args.model or f"{args.model_config} (random weights, {path})"
    output = sum(n for _, n in workload)
    what = {"grpc": "gRPC GenerateStream", "http": "HTTP /v1/completions (SSE)",
            "both": "gRPC GenerateStream, then HTTP /v1/completions (SSE), each"}[args.protocol]
    return (f"{what} against {target} ({server}), {load}. Model {model}, {args.device} "
            f"{args.dtype}. {len(workload)} requests, prompts {args.input_len[0]}..{args.input_len[1]} tokens, "
            f"outputs {args.output_len[0]}..{args.output_len[1]} tokens ({output} in all), seed {args.seed}, "
            f"greedy, EOS ignored.")


def main(argv=None) -> int:
    args = parse_args(argv)
    path = common.model_path(args)
    workload, warmup = common.workloads(args, path)
    if args.tracing_compare:
        if not args.spawn_server or args.protocol != "grpc":
            sys.exit("--tracing-compare needs --spawn-server and --protocol grpc")
        text = describe(args, path, workload, "fresh servers") + "\n\n" + tracing_compare(path, workload, warmup, args)
        print(text)
        if not args.no_results:
            common.append_results(args.results, "tracing on vs off (benchmarks/serving.py --tracing-compare)", text)
        return 0
    protocols = ["grpc", "http"] if args.protocol == "both" else [args.protocol]
    given = {"grpc": args.target, "http": args.http_target}
    runs, used = {}, []
    for protocol in protocols:
        # a server of its own for each protocol: the second would otherwise find every prompt in the
        # prefix cache the first one filled
        with (spawned_server(path, args) if args.spawn_server else contextlib.nullcontext(given)) as targets:
            runs[protocol] = run_serving(targets[protocol], workload, warmup, args, protocol)
            used.append(targets[protocol])
    offline = offline_throughput(path, args) if args.offline_compare else \
        read_offline(args.offline_json, args) if args.offline_json else None
    text, bad, measured = describe(args, path, workload, ", ".join(used)) + "\n", [], {}
    for protocol, (records, duration) in runs.items():
        m = measured[protocol] = metrics(records, duration)
        if offline:
            m["offline"] = offline
            m["serving_over_offline"] = m["output_tokens_per_s"] / offline["output_tokens_per_s"]
        text += f"\n{protocol}:\n\n{report(m, offline)}\n" if len(runs) > 1 else f"\n{report(m, offline)}\n"
        bad += [(protocol, r) for r in records if not r.ok]
    if len(runs) > 1:
        ratio = measured["http"]["output_tokens_per_s"] / measured["grpc"]["output_tokens_per_s"]
        fresh = ", a fresh server each" if args.spawn_server else ""
        text += f"\n- HTTP/gRPC output throughput, same workload{fresh}: {ratio:.3f}\n"
    for protocol, r in bad[:10]:
        text += f"- ERROR {protocol} request {r.index}: {r.problem()}\n"
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "serving", "command": common.command_line(), "machine": common.machine(),
                       "model": path, "args": vars(args), "metrics": measured}, f, indent=2)
    if not args.no_results:
        common.append_results(args.results, f"serving over {args.protocol} (benchmarks/serving.py)", text)
    if bad:
        print(f"ERROR: {len(bad)} streams failed or did not end with the tokens they asked for", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

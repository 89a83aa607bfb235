"""The `pagoda` command line.

    pagoda serve [--model DIR|HUB_ID] [--port 50051] ...     run the gRPC server (server/main.py)
    pagoda generate "Hello" [--stream] [sampling flags]      one completion from a server
    pagoda chat                                             an interactive, streamed conversation
    pagoda tokenize "Hello"  |  pagoda info  |  pagoda stats
    pagoda health [--service NAME]                          grpc.health.v1 check: exit 0 only when SERVING
    pagoda offline "Hello"                                  generate in this process, without a server

Heavy imports (torch, grpc, the engine) happen inside the subcommands so `pagoda --help` stays fast.
"""
import argparse
import os
import sys


def _offline(args: argparse.Namespace) -> int:
    from pagoda.engine import LLM, SamplingParams
    from pagoda.engine.errors import InvalidRequestError

    try:
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
        llm = LLM(args.model, dtype=args.dtype)
        out = llm.generate([args.prompt], params)[0]
    except InvalidRequestError as e:  # names the option: --temperature, --max-tokens, --seed or the prompt
        what = "the prompt" if e.field.startswith("prompt") else f"--{e.field.replace('_', '-')}"
        print(f"pagoda offline: {what} {e.message}", file=sys.stderr)
        return 2
    print(out.text)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from pagoda.server.main import run

    return run(args)


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    # server/main.py imports grpc only, not torch/the engine, so this stays cheap.
    from pagoda.server.main import add_serve_args

    add_serve_args(p)


def _default_target() -> str:
    """PAGODA_TARGET, else localhost on PAGODA_PORT (so a container's HEALTHCHECK follows its port)."""
    port = os.environ.get("PAGODA_PORT") or "50051"
    return os.environ.get("PAGODA_TARGET") or f"localhost:{port if port != '0' else '50051'}"


def _add_target(p: argparse.ArgumentParser, timeout: float | None = None) -> None:
    env = os.environ.get
    p.add_argument("--target", default=_default_target(),
                   help="server address host:port (default: localhost:50051, or localhost:$PAGODA_PORT) "
                        "[env PAGODA_TARGET]")
    p.add_argument("--timeout", type=float, default=timeout,
                   help=f"deadline of each call in seconds (default: {timeout if timeout else 'none'})")
    g = p.add_argument_group("security")
    g.add_argument("--api-key", default=env("PAGODA_API_KEY"),
                   help="send 'authorization: Bearer KEY' [env PAGODA_API_KEY]")
    g.add_argument("--tls", action="store_true", default=env("PAGODA_TLS", "").lower() not in ("", "0", "false", "no"),
                   help="connect with TLS, trusting the system's CAs [env PAGODA_TLS=1]")
    g.add_argument("--tls-ca", default=env("PAGODA_TLS_CA"),
                   help="connect with TLS, trusting this PEM CA bundle (e.g. a self-signed server's "
                        "certificate) [env PAGODA_TLS_CA]")
    g.add_argument("--tls-client-cert", default=env("PAGODA_TLS_CLIENT_CERT"),
                   help="PEM client certificate, for mutual TLS [env PAGODA_TLS_CLIENT_CERT]")
    g.add_argument("--tls-client-key", default=env("PAGODA_TLS_CLIENT_KEY"),
                   help="PEM key of --tls-client-cert [env PAGODA_TLS_CLIENT_KEY]")
    g.add_argument("--tls-server-name", default=env("PAGODA_TLS_SERVER_NAME"),
                   help="check the server's certificate against this name instead of the target's host "
                        "[env PAGODA_TLS_SERVER_NAME]")


def _client(args: argparse.Namespace):
    from pagoda.client.client import Client

    return Client(args.target, timeout=args.timeout, api_key=args.api_key, tls=args.tls, tls_ca=args.tls_ca,
                  tls_cert=args.tls_client_cert, tls_key=args.tls_client_key, tls_server_name=args.tls_server_name)


def _add_sampling(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (unset: the server's default)")
    g.add_argument("--temperature", type=float, help="0 = greedy (server default 1.0)")
    g.add_argument("--top-k", type=int)
    g.add_argument("--top-p", type=float)
    g.add_argument("--min-p", type=float)
    g.add_argument("--seed", type=int)
    g.add_argument("--repetition-penalty", type=float)
    g.add_argument("--presence-penalty", type=float)
    g.add_argument("--frequency-penalty", type=float)
    g.add_argument("--max-tokens", type=int, help="server default: 256, capped by the context")
    g.add_argument("--min-tokens", type=int)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stop-token-id", action="append", type=int, default=[], dest="stop_token_ids",
                   help="stop token id (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--priority", type=int, default=0, help="lower is scheduled first (default 0)")


def _sampling_kwargs(args: argparse.Namespace) -> dict:
    names = ("temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "priority")
    return {n: getattr(args, n) for n in names}


def _rpc_errors(fn):
    """Runs a client subcommand; a gRPC error becomes one line on stderr and exit status 1."""
    def wrapped(args):
        import grpc

        try:
            return fn(args)
        except grpc.RpcError as e:
            print(f"pagoda: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        except (OSError, ValueError) as e:  # an unreadable PEM file, a cert without its key
            print(f"pagoda: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
    return wrapped


def _as_dict(msg) -> dict:
    """A message as a dict in .proto order, with .proto field names, enum names and plain ints
    (protojson would quote 64-bit ints). Unset optional fields are left out."""
    out = {}
    for f in msg.DESCRIPTOR.fields:
        if f.has_presence and not msg.HasField(f.name):
            continue
        value = getattr(msg, f.name)
        if f.message_type is not None:
            value = [_as_dict(v) for v in value] if f.is_repeated else _as_dict(value)
        elif f.enum_type is not None:  # a value this client does not know (a newer server): its number
            known = f.enum_type.values_by_number
            name = lambda v: known[v].name if v in known else v  # noqa: E731
            value = [name(v) for v in value] if f.is_repeated else name(value)
        elif f.is_repeated:
            value = list(value)
        out[f.name] = value
    return out


def _print_json(msg, lines: bool = False) -> None:
    """Pretty JSON, or one line per message (lines=True, for streams)."""
    import json

    print(json.dumps(_as_dict(msg), indent=None if lines else 2, ensure_ascii=False), flush=True)


@_rpc_errors
def _generate(args: argparse.Namespace) -> int:
    kw = _sampling_kwargs(args)
    kw.update(logprobs=args.logprobs, top_logprobs=args.top_logprobs, n=args.n)
    prompt = [int(t) for t in args.prompt.split(",")] if args.token_ids else args.prompt
    with _client(args) as c:
        if (args.n or 1) > 1 and not args.json:  # several completions: each printed whole, in order
            for choice in c.generate(prompt, **kw).choices:
                print(f"--- completion {choice.index} ---\n{choice.text}")
            return 0
        if args.json:
            if args.stream:
                for msg in c.generate_stream(prompt, **kw):
                    _print_json(msg, lines=True)
            else:
                _print_json(c.generate(prompt, **kw))
            return 0
        if args.stream:
            last = None
            for msg in c.generate_stream(prompt, **kw):
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                last = msg
        else:
            last = c.generate(prompt, **kw)
            sys.stdout.write(last.text)
        sys.stdout.write("\n")
        if args.verbose and last is not None:
            from pagoda.v1 import generation_pb2 as pb

            u = last.usage
            print(f"[{pb.FinishReason.Name(last.finish_reason)}; prompt {u.prompt_tokens} tokens, "
                  f"completion {u.completion_tokens}, cached {u.cached_prompt_tokens}]", file=sys.stderr)
    return 0


@_rpc_errors
def _chat(args: argparse.Namespace) -> int:
    kw = _sampling_kwargs(args)
    messages = [("system", args.system)] if args.system else []
    interactive = sys.stdin.isatty()
    if interactive:
        print("pagoda chat: empty line or Ctrl-D to quit, /reset to start over", file=sys.stderr)
    with _client(args) as c:
        while True:
            if interactive:
                sys.stderr.write("> ")
                sys.stderr.flush()
            line = sys.stdin.readline()
            if not line or not line.strip():
                return 0
            line = line.rstrip("\n")
            if line.strip() == "/reset":
                messages = messages[:1] if args.system else []
                continue
            messages.append(("user", line))
            reply = []
            for msg in c.generate_stream(messages=messages, **kw):
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                reply.append(msg.text)
            sys.stdout.write("\n")
            sys.stdout.flush()
            messages.append(("assistant", "".join(reply)))


@_rpc_errors
def _tokenize(args: argparse.Namespace) -> int:
    with _client(args) as c:
        print(" ".join(str(t) for t in c.tokenize(args.text)))
    return 0


@_rpc_errors
def _info(args: argparse.Namespace) -> int:
    with _client(args) as c:
        _print_json(c.model_info())
    return 0


@_rpc_errors
def _stats(args: argparse.Namespace) -> int:
    with _client(args) as c:
        _print_json(c.stats())
    return 0


def _health(args: argparse.Namespace) -> int:
    """grpc.health.v1 Check; prints the status; exit 0 only when SERVING (a container HEALTHCHECK)."""
    import grpc

    try:
        with _client(args) as c:
            status = c.health(args.service)
    except grpc.RpcError as e:
        print(f"pagoda: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f"pagoda: {e}", file=sys.stderr)
        return 1
    print(status)
    return 0 if status == "SERVING" else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="LLM text generation over gRPC")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the gRPC server",
                       description="Run the pagoda.v1 gRPC server (with grpc.health.v1 and server reflection). "
                                   "Every flag can also be set as the PAGODA_* environment variable shown.")
    _add_serve_args(p)
    p.set_defaults(func=_serve)

    p = sub.add_parser("generate", help="generate a completion from a server")
    p.add_argument("prompt", help="prompt text (or comma-separated token ids with --token-ids)")
    p.add_argument("--stream", action="store_true", help="print the completion as it is generated")
    p.add_argument("-n", "--n", type=int, default=None, help="completions to generate (default 1; above 1 "
                   "they are printed one after another when all are done, or streamed with --json)")
    p.add_argument("--token-ids", action="store_true", help="the prompt is comma-separated token ids")
    p.add_argument("--logprobs", action="store_true", help="ask for logprobs (shown with --json)")
    p.add_argument("--top-logprobs", type=int, default=None)
    p.add_argument("--json", action="store_true",
                   help="print the response as JSON (with --stream: one JSON line per message)")
    p.add_argument("-v", "--verbose", action="store_true", help="print finish reason and usage to stderr")
    _add_sampling(p)
    _add_target(p)
    p.set_defaults(func=_generate)

    p = sub.add_parser("chat", help="chat interactively (streamed, keeps the conversation)")
    p.add_argument("--system", default=None, help="system message opening the conversation")
    _add_sampling(p)
    _add_target(p)
    p.set_defaults(func=_chat)

    p = sub.add_parser("tokenize", help="print the token ids of a text")
    p.add_argument("text")
    _add_target(p)
    p.set_defaults(func=_tokenize)

    p = sub.add_parser("info", help="print the served model and the server's limits (JSON)")
    _add_target(p)
    p.set_defaults(func=_info)

    p = sub.add_parser("stats", help="print the server's load and KV cache occupancy (JSON)")
    _add_target(p)
    p.set_defaults(func=_stats)

    p = sub.add_parser("health", help="check the server's health (grpc.health.v1); exit 0 only when SERVING")
    p.add_argument("--service", default="", help='service name (default: "", the whole server)')
    _add_target(p, timeout=5.0)
    p.set_defaults(func=_health)

    p = sub.add_parser("offline", help="generate in this process, without a server")
    p.add_argument("prompt")
    p.add_argument("--model", default=None, help="HF directory or hub id (default: built-in demo model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=_offline)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

"""The `pagoda` command line.

    pagoda serve [MODEL] [--port 50051] [--http-port 8000]  run the server: gRPC and HTTP, OpenAI API (server/main.py)
    pagoda generate "Hello" [--stream] [sampling flags]      one completion from a server
    pagoda chat                                             an interactive, streamed conversation
    pagoda tokenize "Hello"  |  pagoda info  |  pagoda stats
    pagoda health [--service NAME]                          grpc.health.v1 check: exit 0 only when SERVING
    pagoda offline "Hello"                                  generate in this process, without a server

A prompt is the argument, `-` (read stdin) or --file PATH. Every mistake is one line on stderr: exit
status 2 for a usage error (after the subcommand's usage), 1 when the call or the server failed.
Heavy imports (torch, grpc, the engine) happen inside the subcommands so `pagoda --help` stays fast.
"""
import argparse
import json
import math
import os
import sys

from pagoda.engine.openmp import waits_passively

# The largest values the request's protobuf fields hold; beyond them protobuf itself fails the call.
UINT32, INT32, UINT64 = 2**32 - 1, 2**31 - 1, 2**64 - 1


class CliError(Exception):
    """A mistake found after parsing: one line; a usage error (exit 2) also shows the subcommand's usage."""

    def __init__(self, message: str, usage: bool = False):
        super().__init__(message)
        self.usage = usage


def _ranged(kind, lo, hi=None, *, lo_open: bool = False, most: int | None = None):
    """An argparse type= function: a finite `kind` (int or float) in [lo, hi] ((lo, hi] with lo_open,
    no upper bound without hi); `most` is the largest value the flag's protobuf field holds."""
    noun = "an integer" if kind is int else "a number"
    if hi is None:
        rule = f"{'>' if lo_open else '>='} {lo}"
    else:
        rule = f"in {'(' if lo_open else '['}{lo}, {hi}]"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {noun} {rule}, got {text!r}") from None
        if ((kind is float and not math.isfinite(value)) or value < lo or (lo_open and value == lo)
                or (hi is not None and value > hi)):
            raise argparse.ArgumentTypeError(f"must be {noun} {rule}, got {text}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"must be at most {most}, got {text}")
        return value
    return parse


def _field(name: str, kind, most: int | None = None, least: int | None = None):
    """An argparse type= function for a sampling flag: a finite `kind`, checked by the engine's own
    rule for that field (pagoda.engine.validation, torch-free), so the CLI and the server agree; what
    depends on the model (max-tokens against the context, ...) stays the server's to judge. `most`:
    the largest value the flag's protobuf field holds (`least`: its smallest)."""
    from pagoda.engine.errors import InvalidRequestError
    from pagoda.engine.validation import FIELD_RULES

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        try:
            FIELD_RULES[name](value)
        except InvalidRequestError as e:
            raise argparse.ArgumentTypeError(e.message) from None
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"must be at most {most}, got {text}")
        if least is not None and value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {text}")
        return value
    return parse


_MAX_TOKENS = _field("max_tokens", int, most=UINT32)
_TEMPERATURE = _field("temperature", float)
_SEED = _field("seed", int, most=UINT64, least=0)


def _clip(text: str, limit: int = 40) -> str:
    """repr(text), shortened: a prompt in an error message may be a whole file."""
    return repr(text if len(text) <= limit else text[:limit - 3] + "...")


def _not_utf8(data: bytes | str) -> str | None:
    """Why bytes, or a string from the command line or stdin, are not UTF-8 text (None when they
    are). Python hands each byte of an argument that is not UTF-8 over as a lone surrogate
    (surrogateescape), which the engine's rule for a request's text refuses."""
    from pagoda.engine.errors import InvalidRequestError
    from pagoda.engine.validation import check_text

    if isinstance(data, str):
        try:
            check_text("", data)
            return None
        except InvalidRequestError as e:
            try:
                data = data.encode("utf-8", "surrogateescape")  # the bytes as they were given
            except UnicodeEncodeError:
                return f"must be UTF-8 text: it {e.message}"
    try:
        data.decode("utf-8")
        return None
    except UnicodeDecodeError as e:
        return (f"must be UTF-8 text, got byte 0x{data[e.start]:02x} at offset {e.start} "
                f"(convert it with iconv -t UTF-8)")


def _text_arg(text: str) -> str:
    """An argparse type= function for a text flag (--stop, --regex, ...): UTF-8 only."""
    why = _not_utf8(text)
    if why:
        raise argparse.ArgumentTypeError(why)
    return text


def _read_bytes(flag: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise CliError(f"{flag}: cannot read {path!r}: {e.strerror or e}", usage=True) from None


def _decode(what: str, data: bytes) -> str:
    why = _not_utf8(data)
    if why:
        raise CliError(f"{what} {why}", usage=True)
    return data.decode("utf-8")


def _read_file(flag: str, path: str) -> str:
    return _decode(f"{flag}: {path!r}", _read_bytes(flag, path))


def _read_prompt(args: argparse.Namespace) -> str:
    """The prompt: the argument as is, stdin for `-`, or the contents of --file (for a prompt too
    long for the command line)."""
    if (args.prompt is None) == (args.file is None):
        raise CliError("give the prompt as an argument, `-` to read stdin, or --file PATH (exactly one)",
                       usage=True)
    if args.prompt == "-" or args.file == "-":
        text, source = sys.stdin.buffer.read(), "stdin"
    elif args.file is not None:
        text, source = _read_bytes("--file", args.file), f"--file {args.file!r}"
    else:
        text, source = args.prompt, "the argument"
    if not text:
        raise CliError(f"the prompt is empty (from {source})", usage=True)
    why = _not_utf8(text)
    if why:
        raise CliError(f"the prompt (from {source}) {why}", usage=True)
    return text.decode("utf-8") if isinstance(text, bytes) else text


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",")]
    except ValueError:
        ids = None
    if ids is None or not all(0 <= t <= UINT32 for t in ids):
        raise CliError(f"--token-ids must be comma-separated integers >= 0, e.g. 1,2,3; got {_clip(text)}",
                       usage=True)
    return ids


def _say(args: argparse.Namespace, message: str) -> None:
    print(f"{args.parser.prog}: {message}", file=sys.stderr)


def _one_line_errors(fn):
    """Runs a subcommand; any expected failure becomes one line on stderr and its exit status."""
    def wrapped(args):
        import grpc

        try:
            return fn(args)
        except CliError as e:
            if e.usage:
                args.parser.error(str(e))  # the subcommand's usage, then the line; exits 2
            _say(args, str(e))
            return 1
        except grpc.RpcError as e:
            _say(args, _rpc_message(args, e))
            return 1
        except (OSError, ValueError) as e:  # a model that cannot be loaded (offline), a bad PEM file
            _say(args, str(e))
            return 1
        except KeyboardInterrupt:
            return 130
    return wrapped


# gRPC's own wording when no connection was made; the server's UNAVAILABLE (loading, draining) differs.
_NO_CONNECTION = ("failed to connect", "errors resolving", "dns resolution failed", "empty address list",
                  "connections to all backends failing")  # the last: round_robin, for several targets
_TLS_WORDS = ("tls", "ssl", "certificate", "handshake", "socket closed", "verification")


def _rpc_message(args: argparse.Namespace, e) -> str:
    """The one place a failed call becomes a line: what went wrong and what to do about it."""
    import grpc

    code, details = e.code(), e.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE and details.lower().startswith(_NO_CONNECTION):
        # gRPC's detail is "failed to connect to all addresses; last error: UNKNOWN: ipv4:...: <why>"
        why = next((s for s in reversed(details.split(": ")) if s.strip(" []") not in ("", "OK")), details)
        if "backend unhealthy" in details:  # several replicas: all connected, none SERVING
            hint = "no replica is SERVING yet (loading) or any more (draining); --wait SECONDS waits"
        elif any(w in details.lower() for w in _TLS_WORDS):
            hint = "check --tls, --tls-ca and --tls-server-name against the server's TLS setup"
        else:
            hint = "is `pagoda serve` running? set --target or PAGODA_TARGET"
        return f"cannot reach a pagoda server at {args.target} (UNAVAILABLE: {why.strip(' []')}; {hint})"
    if code == grpc.StatusCode.NOT_FOUND and args.command == "health":
        from pagoda.client.client import SERVICE_NAME

        return (f"the server does not know the service {args.service!r} (try '' for the whole server "
                f"or {SERVICE_NAME})")
    hint = ""
    if code == grpc.StatusCode.UNAVAILABLE and "loading" in details:
        hint = " (--wait SECONDS waits until it is SERVING)"
    elif code == grpc.StatusCode.UNAUTHENTICATED:
        hint = " (set --api-key or PAGODA_API_KEY)"
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED and args.timeout:
        hint = f" (--timeout {args.timeout:g} ran out)"
    return f"{code.name}: {details}{hint}"


@_one_line_errors
def _offline(args: argparse.Namespace) -> int:
    prompt = _read_prompt(args)  # before torch loads: a missing prompt is reported at once
    from pagoda.engine import LLM, SamplingParams
    from pagoda.engine.errors import InvalidRequestError

    try:
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
        quantization = None if args.quantization == "none" else args.quantization
        out = LLM(args.model, dtype=args.dtype, quantization=quantization).generate([prompt], params)[0]
    except InvalidRequestError as e:  # names the option: --temperature, --max-tokens, --seed or the prompt
        what = "the prompt" if e.field.startswith("prompt") else f"--{e.field.replace('_', '-')}"
        raise CliError(f"{what} {e.message}", usage=True) from None
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
                   help="server address host:port (default: localhost:50051, or localhost:$PAGODA_PORT); "
                        "several replicas as a comma-separated list host1:port1,host2:port2, or "
                        "dns:///NAME:PORT for every address of a DNS name (e.g. a Kubernetes headless "
                        "Service): calls are balanced round_robin over the SERVING replicas and a call "
                        "refused UNAVAILABLE is retried on another (several targets with TLS need "
                        "--tls-server-name) [env PAGODA_TARGET]")
    p.add_argument("--timeout", type=_ranged(float, 0, lo_open=True), default=timeout,
                   help=f"deadline of each call in seconds (default: {timeout if timeout else 'none'})")
    p.add_argument("--wait", type=_ranged(float, 0), default=0.0, metavar="SECONDS",
                   help="first wait up to SECONDS for the server to be SERVING, e.g. while `pagoda serve` "
                        "loads its model (default: 0, don't wait)")
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


def _connect(args: argparse.Namespace):
    """A Client from the subcommand's flags; with --wait, once the server is SERVING."""
    from pagoda.client.client import Client

    if bool(args.tls_client_cert) != bool(args.tls_client_key):
        raise CliError("--tls-client-cert and --tls-client-key go together: give both or neither", usage=True)
    for flag, path in (("--tls-ca", args.tls_ca), ("--tls-client-cert", args.tls_client_cert),
                       ("--tls-client-key", args.tls_client_key)):
        if path:
            _read_file(flag, path)  # so that a bad path names its flag
    # while waiting, retry the connection every second, not after gRPC's backoff (growing to 2 minutes)
    options = [("grpc.max_reconnect_backoff_ms", 1000)] if args.wait else []
    try:
        client = Client(args.target, timeout=args.timeout, api_key=args.api_key, tls=args.tls, tls_ca=args.tls_ca,
                        tls_cert=args.tls_client_cert, tls_key=args.tls_client_key,
                        tls_server_name=args.tls_server_name, options=options)
    except ValueError as e:  # a malformed or unresolvable list of targets; TLS to several without a name
        raise CliError(f"--target {args.target}: {e}", usage=True) from None
    if args.wait:
        try:
            client.wait_ready(args.wait)
        except TimeoutError as e:
            client.close()
            last = f"; {_rpc_message(args, e.__cause__)}" if e.__cause__ is not None else ""
            raise CliError(f"--wait {args.wait:g}: {e}{last}") from None
    return client


def _add_prompt(p: argparse.ArgumentParser, metavar: str = "PROMPT", help: str = "prompt text") -> None:
    p.add_argument("prompt", nargs="?", metavar=metavar, help=f"{help}; - reads it from stdin")
    p.add_argument("--file", metavar="PATH", help="read the prompt from this file (UTF-8, as is)")


def _add_sampling(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (unset: the server's default)")
    g.add_argument("--temperature", type=_TEMPERATURE, help="0 = greedy (server default 1.0)")
    g.add_argument("--top-k", type=_field("top_k", int, most=INT32), help="0 or -1: off")
    g.add_argument("--top-p", type=_field("top_p", float))
    g.add_argument("--min-p", type=_field("min_p", float))
    g.add_argument("--seed", type=_SEED)
    g.add_argument("--repetition-penalty", type=_field("repetition_penalty", float))
    g.add_argument("--presence-penalty", type=_field("presence_penalty", float))
    g.add_argument("--frequency-penalty", type=_field("frequency_penalty", float))
    g.add_argument("--max-tokens", type=_MAX_TOKENS, help="server default: 256, capped by the context")
    g.add_argument("--min-tokens", type=_field("min_tokens", int, most=UINT32))
    g.add_argument("--stop", action="append", type=_text_arg, default=[], help="stop string (repeatable)")
    g.add_argument("--stop-token-id", action="append", type=_ranged(int, 0, most=UINT32), default=[],
                   dest="stop_token_ids", help="stop token id (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--include-stop-str", action="store_true", dest="include_stop_str_in_output", default=None,
                   help="end the text after the stop string that ended it, not before")
    g.add_argument("--keep-special-tokens", action="store_false", dest="skip_special_tokens", default=None,
                   help="special tokens' text stays in the completion (skip_special_tokens false)")
    g.add_argument("--truncate-prompt-tokens", type=_field("truncate_prompt_tokens", int, most=UINT32),
                   metavar="N", help="keep a longer prompt's last N tokens instead of being refused")
    g.add_argument("--logit-bias", action="append", type=_logit_bias, default=[], metavar="TOKEN_ID=BIAS",
                   help="add BIAS (in [-100, 100]; -100 bans) to a token's logit (repeatable)")
    s = p.add_argument_group("structured output (one of)")
    s.add_argument("--json-schema", metavar="FILE", help="the completion is JSON valid against this JSON Schema file "
                                                         "(- reads it from stdin)")
    s.add_argument("--json-object", action="store_true", help="the completion is a JSON object")
    s.add_argument("--regex", type=_text_arg, help="the completion matches this regular expression, whole")
    s.add_argument("--choice", action="append", type=_text_arg, metavar="TEXT",
                   help="the completion is one of these (repeatable)")
    s.add_argument("--grammar", metavar="FILE", help="the completion follows this Lark grammar file")
    g.add_argument("--bad-word", action="append", type=_text_arg, dest="bad_words", default=[], metavar="WORD",
                   help="a word the completion must not contain (repeatable)")
    g.add_argument("--priority", type=_ranged(int, -INT32 - 1, INT32), default=0,
                   help="lower is scheduled first (default 0)")


def _sampling_kwargs(args: argparse.Namespace) -> dict:
    names = ("temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "priority",
             "include_stop_str_in_output", "skip_special_tokens", "truncate_prompt_tokens", "bad_words")
    return {n: getattr(args, n) for n in names} | {"logit_bias": dict(args.logit_bias)} | _structured(args)


def _structured(args: argparse.Namespace) -> dict:
    """The structured-output flags as build_request's keywords; a usage error for two of them."""
    given = [f for f, v in (("--json-schema", args.json_schema), ("--json-object", args.json_object),
                            ("--regex", args.regex), ("--choice", args.choice), ("--grammar", args.grammar)) if v]
    if len(given) > 1:
        raise CliError(f"argument {given[1]}: not allowed with {given[0]} (one structured output per request)",
                     usage=True)
    kw = {}
    if args.json_schema:
        text = _decode("--json-schema: stdin", sys.stdin.buffer.read()) if args.json_schema == "-" else \
            _read_file("--json-schema", args.json_schema)
        try:
            json.loads(text)
        except ValueError as e:
            raise CliError(f"argument --json-schema: {args.json_schema} is not JSON: {e}", usage=True) from None
        kw["json_schema"] = text
    if args.json_object:
        kw["json_object"] = True
    if args.regex:
        kw["regex"] = args.regex
    if args.choice:
        kw["choice"] = args.choice
    if args.grammar:
        kw["grammar"] = _read_file("--grammar", args.grammar)
    return kw


def _logit_bias(text: str) -> tuple[int, float]:
    """TOKEN_ID=BIAS, checked by the engine's own rule."""
    from pagoda.engine.errors import InvalidRequestError
    from pagoda.engine.validation import check_int, check_number

    token, _, bias = text.partition("=")
    try:
        pair = int(token), float(bias)
        check_int("token id", pair[0], lo=0, hi=UINT32)
        check_number("bias", pair[1], lo=-100.0, hi=100.0)
    except ValueError as e:  # InvalidRequestError is one
        why = e.message if isinstance(e, InvalidRequestError) else "must be TOKEN_ID=BIAS, e.g. 42=-100"
        raise argparse.ArgumentTypeError(f"{why}; got {text!r}") from None
    return pair


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
    """Pretty JSON of a message (or a dict), or one line per message (lines=True, for streams)."""
    import json

    value = msg if isinstance(msg, dict) else _as_dict(msg)
    print(json.dumps(value, indent=None if lines else 2, ensure_ascii=False), flush=True)


_ONLY_WHEN_SET = ("logprobs", "prompt_logprobs", "prompt_token_ids", "prompt_text", "results", "tool_calls",
                  "tool_call_deltas", "reasoning_content")


def _generation_json(msg) -> dict:
    """What `generate --json` prints of a GenerateResponse or a GenerateStreamResponse: the fields that
    carry something (logprobs and the prompt's fields only when asked for). A whole response gives each
    completion once, in `choices`: its top-level text, token_ids, finish_reason and logprobs, which
    repeat choice 0's, are left out."""
    d = _as_dict(msg)
    if "choices" in d:
        for name in ("text", "token_ids", "finish_reason", "logprobs", "tool_calls", "reasoning_content"):
            d.pop(name, None)
        d["choices"] = [_set_fields(c) for c in d["choices"]]
    else:
        d.pop("prompt_index", None)  # the CLI sends one prompt
        if d.get("finish_reason") == "FINISH_REASON_UNSPECIFIED":  # not a completion's last message
            del d["finish_reason"]
    return _set_fields(d)


def _set_fields(d: dict) -> dict:
    """d without the empty fields of _ONLY_WHEN_SET, and its logprobs without empty top_logprobs."""
    d = {k: v for k, v in d.items() if k not in _ONLY_WHEN_SET or v}
    for name in ("logprobs", "prompt_logprobs"):
        if name in d:
            d[name] = [{k: v for k, v in lp.items() if k != "top_logprobs" or v} for lp in d[name]]
    return d


def _print_response(r, as_json: bool) -> None:
    if as_json:
        _print_json(_generation_json(r))
    elif len(r.choices) > 1:  # several completions: each printed whole, in order
        for choice in r.choices:
            print(f"--- completion {choice.index} ---\n{r.prompt_text}{choice.text}")
    else:
        print(r.prompt_text + r.text)


def _print_stream(stream, as_json: bool):
    """Prints a stream as it comes; returns each completion's (index, finish_reason) and the usage
    totalled as Generate does (the prompt once, the completions summed)."""
    from pagoda.v1 import generation_pb2 as pb

    ends, usages = [], {}
    for msg in stream:
        if as_json:
            _print_json(_generation_json(msg), lines=True)
        else:
            sys.stdout.write(msg.prompt_text + msg.text)
            sys.stdout.flush()
        if msg.finish_reason:
            ends.append((msg.index, msg.finish_reason))
            usages[msg.index] = msg.usage
    if not as_json:
        sys.stdout.write("\n")
    usage = pb.Usage()
    if usages:
        usage.CopyFrom(usages[min(usages)])
        usage.completion_tokens = sum(u.completion_tokens for u in usages.values())
    return sorted(ends), usage


def _report(ends, usage) -> None:
    """-v: every completion's finish reason, then the usage, on stderr."""
    from pagoda.v1 import generation_pb2 as pb

    known = pb.FinishReason.values()
    for index, reason in ends:
        print(f"[completion {index}: {pb.FinishReason.Name(reason) if reason in known else reason}]",
              file=sys.stderr)
    print(f"[usage: prompt {usage.prompt_tokens} tokens, completion {usage.completion_tokens}, "
          f"cached {usage.cached_prompt_tokens}]", file=sys.stderr)


@_one_line_errors
def _generate(args: argparse.Namespace) -> int:
    prompt = _read_prompt(args)
    if args.token_ids:
        prompt = _token_ids(prompt)
    kw = _sampling_kwargs(args)
    kw.update(logprobs=args.logprobs, top_logprobs=args.top_logprobs, n=args.n, prompt_logprobs=args.prompt_logprobs,
              echo=args.echo)
    with _connect(args) as c:
        if args.stream and (args.json or (args.n or 1) == 1):
            ends, usage = _print_stream(c.generate_stream(prompt, **kw), args.json)
        else:  # -n above 1 without --json: each completion printed whole once all are done
            r = c.generate(prompt, **kw)
            _print_response(r, args.json)
            ends, usage = [(choice.index, choice.finish_reason) for choice in r.choices], r.usage
    if args.verbose:
        _report(ends, usage)
    return 0


@_one_line_errors
def _chat(args: argparse.Namespace) -> int:
    kw = _sampling_kwargs(args)
    messages = [("system", args.system)] if args.system else []
    interactive = sys.stdin.isatty()
    with _connect(args) as c:
        if interactive:
            print("pagoda chat: empty line or Ctrl-D to quit, /reset to start over", file=sys.stderr)
        while True:
            if interactive:
                sys.stderr.write("> ")
                sys.stderr.flush()
            line = sys.stdin.buffer.readline().decode("utf-8", "surrogateescape")  # not UTF-8: refused below
            if not line or not line.strip():
                return 0
            line = line.rstrip("\n")
            why = _not_utf8(line)
            if why:
                _say(args, f"the message {why}; not sent")
                continue
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


@_one_line_errors
def _tokenize(args: argparse.Namespace) -> int:
    text = _read_prompt(args)
    with _connect(args) as c:
        print(" ".join(str(t) for t in c.tokenize(text)))
    return 0


@_one_line_errors
def _info(args: argparse.Namespace) -> int:
    with _connect(args) as c:
        info = _as_dict(c.model_info())
        info["quantization"] = info.get("quantization") or "none"  # the server's empty string
        _print_json(info)
    return 0


@_one_line_errors
def _stats(args: argparse.Namespace) -> int:
    with _connect(args) as c:
        _print_json(c.stats())
    return 0


@_one_line_errors
def _health(args: argparse.Namespace) -> int:
    """grpc.health.v1 Check; prints the status; exit 0 only when SERVING (a container HEALTHCHECK)."""
    with _connect(args) as c:
        status = c.health(args.service)
    print(status)
    return 0 if status == "SERVING" else 1


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import version

    parser = argparse.ArgumentParser(prog="pagoda", description=(
        "LLM text generation. `pagoda serve [MODEL]` serves a model over gRPC (pagoda.v1, port 50051) and HTTP "
        "(OpenAI API, port 8000); the other commands are its gRPC clients, or (offline) run a model in this "
        "process."))
    parser.add_argument("--version", action="version", version=f"pagoda {version('pagoda')}")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, func, operand: str = "", **kw) -> argparse.ArgumentParser:
        # a short usage line: an error's line is not lost under a screenful of options (-h lists them)
        p = sub.add_parser(name, usage=f"%(prog)s [options]{operand}", **kw)
        p.set_defaults(func=func, parser=p)  # the parser: errors found later show its usage
        return p

    p = command("serve", _serve, " [MODEL]",
                help="serve a model: gRPC on --port (50051), HTTP (OpenAI API) on --http-port (8000)",
                description="Serve a model (default: the built-in demo model) through two doors over one engine: "
                            "gRPC (pagoda.v1, with grpc.health.v1 and server reflection) on --port, default 50051, "
                            "and HTTP (OpenAI API: /v1/chat/completions, /v1/completions, ...; Anthropic's "
                            "/v1/messages; Ollama's /api/chat, /api/tags, ...) on --http-port, "
                            "default 8000. Every flag can also be set as the PAGODA_* environment variable shown.")
    _add_serve_args(p)

    p = command("generate", _generate, " (PROMPT | - | --file PATH)", help="generate a completion from a server")
    _add_generate_args(p)

    p = command("chat", _chat, help="chat interactively (streamed, keeps the conversation)")
    p.add_argument("--system", type=_text_arg, default=None, help="system message opening the conversation")
    _add_sampling(p)
    _add_target(p)

    p = command("tokenize", _tokenize, " (TEXT | - | --file PATH)", help="print the token ids of a text")
    _add_prompt(p, metavar="TEXT", help="the text")
    _add_target(p)

    p = command("info", _info, help="print the served model and the server's limits (JSON)")
    _add_target(p)

    p = command("stats", _stats, help="print the server's load and KV cache occupancy (JSON)")
    _add_target(p)

    p = command("health", _health, help="check the server's health (grpc.health.v1); exit 0 only when SERVING")
    p.add_argument("--service", default="", help='service name (default: "", the whole server)')
    _add_target(p, timeout=5.0)

    p = command("offline", _offline, " (PROMPT | - | --file PATH)", help="generate in this process, without a server")
    _add_offline_args(p)
    return parser


def _add_generate_args(p: argparse.ArgumentParser) -> None:
    _add_prompt(p, help="prompt text (or comma-separated token ids with --token-ids)")
    p.add_argument("--stream", action="store_true", help="print the completion as it is generated")
    p.add_argument("-n", "--n", type=_field("n", int), default=None,
                   help="completions to generate (default 1; above 1 they are printed one after another when all "
                        "are done, or streamed with --json)")
    p.add_argument("--token-ids", action="store_true", help="the prompt is comma-separated token ids")
    p.add_argument("--logprobs", action="store_true", help="ask for logprobs (shown with --json)")
    p.add_argument("--top-logprobs", type=_field("top_logprobs", int), default=None)
    p.add_argument("--prompt-logprobs", type=_field("prompt_logprobs", int), default=None, metavar="K",
                   help="ask for each prompt token's logprob with K alternatives (shown with --json)")
    p.add_argument("--echo", action="store_true", help="print the prompt (as the model saw it) before the completion")
    p.add_argument("--json", action="store_true",
                   help="print the response as JSON: {request_id, usage, choices: [{index, text, token_ids, "
                        "finish_reason, logprobs}], prompt_logprobs, prompt_token_ids, prompt_text}; with --stream "
                        "one JSON object per line and message: {request_id, text, token_ids, finish_reason, usage, "
                        "logprobs, index, prompt_logprobs, prompt_token_ids, prompt_text}. logprobs and the prompt's "
                        "fields only when asked for (--logprobs, --prompt-logprobs, --echo); a stream message's "
                        "finish_reason and usage on each completion's last")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="print each completion's finish reason and the token usage to stderr")
    _add_sampling(p)
    _add_target(p)


def _add_offline_args(p: argparse.ArgumentParser) -> None:
    from pagoda.engine.config import DTYPES, QUANTIZATIONS  # torch-free

    _add_prompt(p)
    p.add_argument("--model", default=None, help="HF directory or hub id (default: built-in demo model)")
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--quantization", default="none", choices=["none", *QUANTIZATIONS],
                   help="int8: weight-only int8 linear layers (CPU); default none")
    p.add_argument("--max-tokens", type=_MAX_TOKENS, default=32)
    p.add_argument("--temperature", type=_TEMPERATURE, default=0.0)
    p.add_argument("--seed", type=_SEED, default=None)


def openmp_waits_passively(env=os.environ) -> None:
    """OpenMP threads that sleep while they wait (engine/openmp.py, the library's rule too): here, before any
    import of torch, and inherited by the engine's and tensor-parallel ranks' processes."""
    waits_passively(env)


def main(argv: list[str] | None = None) -> int:
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # reported by the subcommand's parser, with its usage (parse_args would show the top level's)
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    openmp_waits_passively()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

"""ServerOptions: everything about the server that is not the engine's configuration (limits,
keepalive, TLS, auth, metrics), built from `pagoda serve` flags by server/main.py or directly by
tests. Standard library only, so the `pagoda` parser stays cheap to build."""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

from pagoda.server.chat import REASONING_PARSERS, TOOL_CALL_PARSERS

MIB = 1 << 20

DEFAULT_MAX_MESSAGE_BYTES = 4 * MIB
DEFAULT_MAX_CONCURRENT_STREAMS = 2048
DEFAULT_REQUEST_TIMEOUT_S = 600.0
DEFAULT_MAX_GRAMMAR_BYTES = 64 * 1024  # a structured output's schema / regex / grammar text
DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S = 5.0  # llguidance compiles in ~1 ms; this stops a pathological one
# Keepalive: the server pings a connection every KEEPALIVE_TIME seconds and drops
# it when the ping is not answered within KEEPALIVE_TIMEOUT (a vanished client then no longer holds
# KV blocks). Clients may ping as often as every MIN_PING_INTERVAL seconds, with or without data in
# flight: a prefill of tens of seconds sends no data, and grpc's default (5 minutes, 2 strikes) would
# answer a client's keepalive pings during it with GOAWAY "too_many_pings".
DEFAULT_KEEPALIVE_TIME_S = 30.0
DEFAULT_KEEPALIVE_TIMEOUT_S = 20.0
DEFAULT_KEEPALIVE_MIN_PING_INTERVAL_S = 5.0
# An idle HTTP/1.1 connection is kept this long. Longer than the clients' pools (httpx and so the
# openai SDK: 5 s) and proxies' (nginx, AWS ALB: 60 s), so that the client side closes first: a server
# closing at the moment a client reuses the connection resets its request ("connection reset by
# peer"), uvicorn's default of 5 s racing httpx's 5 s.
DEFAULT_HTTP_KEEPALIVE_TIMEOUT_S = 75.0
METRICS_COMPAT = ("vllm", "none")
DEFAULT_HTTP_PORT = 8000  # where OpenAI-compatible clients and tools look first (vLLM's, SGLang's default too)


def _http_port(text: str) -> int | None:
    """--http-port: a port, or off (argparse's ArgumentTypeError: a one-line error naming the flag)."""
    if text.strip().lower() in ("off", "none", ""):
        return None
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535] (0: any free one) or off, got {text!r}")
    return port


def _limit(default, text: str, **meta):
    return field(default=default, metadata={"group": "limits", "help": text, **meta})


@dataclass
class ServerOptions:
    """A field with a "help" in its metadata is also a `pagoda serve` flag and PAGODA_* variable;
    server/main.py's add_options says what the other metadata keys mean."""
    # request limits (engine/validation.py RequestLimits fields; None: the model's context)
    max_prompt_tokens: int | None = _limit(None, "most prompt tokens; more: INVALID_ARGUMENT (default: 0, the "
                                           "context length less one)", none=0)
    max_tokens_limit: int | None = _limit(None, "largest stopping.max_tokens accepted (default: 0, the context "
                                          "length)", none=0)
    max_stop_strings: int = _limit(16, "most stop strings per request (default: 16)")
    max_stop_string_len: int = _limit(256, "most characters per stop string (default: 256)")
    max_stop_token_ids: int = _limit(64, "most stop token ids per request (default: 64)")
    max_grammar_bytes: int = _limit(DEFAULT_MAX_GRAMMAR_BYTES, "largest structured output (JSON schema, regex, "
                                    "choices, grammar) in bytes; larger: INVALID_ARGUMENT (default: "
                                    f"{DEFAULT_MAX_GRAMMAR_BYTES})")
    grammar_compile_timeout: float = _limit(DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S, "seconds a structured output may "
                                            "take to compile; longer: INVALID_ARGUMENT (default: "
                                            f"{DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S:g})")
    # transport and load limits
    max_message_bytes: int = _limit(DEFAULT_MAX_MESSAGE_BYTES, "largest request/response message; larger: "
                                    f"RESOURCE_EXHAUSTED (default: {DEFAULT_MAX_MESSAGE_BYTES}, 4 MiB)")
    max_concurrent_streams: int = _limit(DEFAULT_MAX_CONCURRENT_STREAMS, "most Generate/GenerateStream calls in "
                                         "flight; more: RESOURCE_EXHAUSTED (default: "
                                         f"{DEFAULT_MAX_CONCURRENT_STREAMS})")
    request_timeout: float = _limit(DEFAULT_REQUEST_TIMEOUT_S, "seconds a generation may run before it is "
                                    "aborted with DEADLINE_EXCEEDED and its KV blocks freed; 0: no limit "
                                    f"(default: {DEFAULT_REQUEST_TIMEOUT_S:g})")
    keepalive_time: float = _limit(DEFAULT_KEEPALIVE_TIME_S, "seconds between the server's keepalive pings on a "
                                   f"connection (default: {DEFAULT_KEEPALIVE_TIME_S:g})")
    keepalive_timeout: float = _limit(DEFAULT_KEEPALIVE_TIMEOUT_S, "seconds to wait for a ping's answer before "
                                      "dropping the connection and aborting its requests (default: "
                                      f"{DEFAULT_KEEPALIVE_TIMEOUT_S:g})")
    keepalive_min_ping_interval: float = _limit(
        DEFAULT_KEEPALIVE_MIN_PING_INTERVAL_S, "shortest interval between client keepalive pings the server "
        "accepts, also while no data flows (a long prefill); more frequent ones get GOAWAY (default: "
        f"{DEFAULT_KEEPALIVE_MIN_PING_INTERVAL_S:g})")
    max_connection_age: float = _limit(0.0, "seconds after which a client is asked to reconnect (calls in flight "
                                       "finish first), so that clients balancing over a DNS name pick up new "
                                       "replicas; 0: never (default: 0)")
    http_keepalive_timeout: float = _limit(DEFAULT_HTTP_KEEPALIVE_TIMEOUT_S, "seconds the HTTP API keeps an idle "
                                           "connection open for the client's next request; keep it longer than "
                                           "the clients' and proxies' own idle timeouts (default: "
                                           f"{DEFAULT_HTTP_KEEPALIVE_TIMEOUT_S:g})")
    # security (PEM file paths)
    tls_cert: str | None = field(default=None, metadata={"group": "security", "none": "", "help": (
        "PEM certificate chain of the server; with --tls-key, serve TLS only")})
    tls_key: str | None = field(default=None, metadata={"group": "security", "none": "", "help": (
        "PEM private key of --tls-cert")})
    tls_client_ca: str | None = field(default=None, metadata={"group": "security", "none": "", "help": (
        "PEM CA bundle; clients must present a certificate it signed (mutual TLS)")})
    api_key: str | None = field(default=None, repr=False, metadata={"group": "security", "none": "", "help": (
        "require the metadata 'authorization: Bearer KEY' on every call but health and reflection; prefer the "
        "environment variable (a flag shows in ps)")})
    # the OpenAI-compatible HTTP API (server/openai/), on --host: None off, 0 any free port. Off unless
    # asked for (tests, embedders); `pagoda serve` serves it on the port OpenAI clients try first
    http_port: int | None = field(default=None, metadata={
        "serve_default": DEFAULT_HTTP_PORT, "type": _http_port, "help": (
            "port of the OpenAI-compatible HTTP API (vLLM's --port) on the same host, 0 = any free one, off = none "
            f"(default: {DEFAULT_HTTP_PORT})")})
    # the names clients may call the model by (HTTP "model", GetModelInfo.model_id: the first);
    # empty: the --model argument as given (the demo model: "pagoda-demo")
    served_model_names: tuple[str, ...] = field(default=(), metadata={
        "flag": "--served-model-name", "nargs": "+", "metavar": "NAME", "help": (
            "the name(s) clients call the model by: HTTP's \"model\" (any of them; responses and GET /v1/models "
            "give the first) and GetModelInfo.model_id (default: --model as given; the demo model: pagoda-demo; "
            "env: names separated by spaces)")})
    # observability; metrics_port 0: no metrics endpoint; -1: any free port (PagodaServer.metrics_port)
    metrics_port: int = field(default=0, metadata={"group": "observability", "help": (
        "serve Prometheus metrics on http://HOST:PORT/metrics; 0: off (default: 0)")})
    metrics_host: str = field(default="0.0.0.0", metadata={"group": "observability", "help": (
        "address of the metrics endpoint (default: 0.0.0.0)")})
    # vllm: also the vLLM-named gauges the Gateway API Inference Extension's endpoint picker reads (server/metrics.py)
    metrics_compat: str = field(default="vllm", metadata={"group": "observability", "choices": METRICS_COMPAT, "help": (
        "vllm: beside pagoda_*, the vLLM-named metrics that the Gateway API Inference Extension / llm-d endpoint "
        "picker reads (vllm:num_requests_waiting, vllm:kv_cache_usage_perc, ...); none: pagoda_* only "
        "(default: vllm)")})
    # chat tools: the call format (server/chat/tools.py FORMATS); None: the chat template's
    tool_call_parser: str | None = field(default=None, metadata={"choices": TOOL_CALL_PARSERS, "help": (
        "how the model writes tool calls: hermes (Qwen2.5/Qwen3, <tool_call>), llama3_json (Llama 3.1+) or "
        "mistral ([TOOL_CALLS]) (default: from the chat template)")})
    # reasoning models: read <think>...</think> apart (server/chat/reasoning.py PARSERS); None: when the template has it
    reasoning_parser: str | None = field(default=None, metadata={"choices": REASONING_PARSERS, "help": (
        "return a reasoning model's <think>...</think> apart, as reasoning_content (default: when the chat "
        "template writes <think>)")})

    def __post_init__(self):
        def positive(name, integer=True, zero=False):
            v = getattr(self, name)
            ok = isinstance(v, int) and not isinstance(v, bool) if integer else (
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))
            if not ok or v < 0 or (v == 0 and not zero):
                raise ValueError(f"{name} must be a {'positive' if not zero else 'non-negative'} "
                                 f"{'integer' if integer else 'number'}, got {v!r}")

        for name in ("max_prompt_tokens", "max_tokens_limit"):
            if getattr(self, name) is not None:
                positive(name)
        for name in ("max_stop_strings", "max_stop_string_len", "max_stop_token_ids"):
            positive(name, zero=True)
        positive("max_message_bytes")
        positive("max_grammar_bytes")
        positive("grammar_compile_timeout", integer=False)
        positive("max_concurrent_streams")
        positive("request_timeout", integer=False, zero=True)
        positive("keepalive_time", integer=False)
        positive("keepalive_timeout", integer=False)
        positive("keepalive_min_ping_interval", integer=False, zero=True)
        positive("max_connection_age", integer=False, zero=True)
        positive("http_keepalive_timeout", integer=False)
        if self.http_port is not None and (not isinstance(self.http_port, int) or not 0 <= self.http_port <= 65535):
            raise ValueError(f"http_port must be in [0, 65535] or None (off), got {self.http_port!r}")
        self.served_model_names = tuple(self.served_model_names or ())
        for name in self.served_model_names:
            if not isinstance(name, str) or not name.strip() or not name.isprintable():
                raise ValueError(f"served_model_names must be printable, non-empty names, got {name!r}")
        if self.metrics_port is None:
            self.metrics_port = 0
        # -1 (not a flag value: for tests and embedding) binds any free port
        if not isinstance(self.metrics_port, int) or not -1 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port!r}")
        if self.metrics_compat not in METRICS_COMPAT:
            raise ValueError(f"metrics_compat must be one of {', '.join(METRICS_COMPAT)}, got {self.metrics_compat!r}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
        if self.api_key is not None and not self.api_key:
            self.api_key = None  # an empty key (e.g. PAGODA_API_KEY="") means no auth
        if self.api_key is not None and (not self.api_key.isprintable() or " " in self.api_key):
            raise ValueError("api_key must be printable characters without spaces")

    def request_limits(self):
        from pagoda.engine.validation import RequestLimits

        return RequestLimits(max_prompt_tokens=self.max_prompt_tokens, max_tokens_limit=self.max_tokens_limit,
                             max_stop_strings=self.max_stop_strings, max_stop_string_len=self.max_stop_string_len,
                             max_stop_token_ids=self.max_stop_token_ids, max_grammar_bytes=self.max_grammar_bytes,
                             grammar_compile_timeout=self.grammar_compile_timeout)

    def grpc_receive_limit(self) -> int:
        """gRPC's own receive limit, above max_message_bytes: a request up to twice that (and 16 MiB more) reaches
        the servicer's deserializer, which refuses it before parsing with a message naming --max-message-bytes
        (server/servicer.py Oversized); only a larger one gets grpc's own "larger than max" (also
        RESOURCE_EXHAUSTED), without a buffer past this limit."""
        return min(2**31 - 1, 2 * self.max_message_bytes + 16 * MIB)

    def grpc_options(self) -> list[tuple[str, int]]:
        """Channel arguments of the grpc server."""
        ms = lambda s: int(round(s * 1000))  # noqa: E731
        return [
            ("grpc.so_reuseport", 0),  # a second server on the same port fails instead of sharing it
            ("grpc.max_receive_message_length", self.grpc_receive_limit()),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.keepalive_time_ms", ms(self.keepalive_time)),
            ("grpc.keepalive_timeout_ms", ms(self.keepalive_timeout)),
            # newer grpc cores time pings out with this one (default 1 minute), not keepalive_timeout_ms
            ("grpc.http2.ping_timeout_ms", ms(self.keepalive_timeout)),
            # accept client pings on idle connections too (else the minimum interval there is 2 hours)
            ("grpc.keepalive_permit_without_calls", 1),
            # keep pinging through a long prefill (grpc's default stops after 2 pings without data)
            ("grpc.http2.max_pings_without_data", 0),
            # GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS (this is its real name)
            ("grpc.http2.min_ping_interval_without_data_ms", ms(self.keepalive_min_ping_interval)),
            ("grpc.http2.max_ping_strikes", 2),
        ] + ([("grpc.max_connection_age_ms", ms(self.max_connection_age))] if self.max_connection_age > 0 else [])

"""A small Python client for pagoda.v1.GenerationService, sync (Client) and asyncio (AsyncClient).

    from pagoda.client.client import Client
    with Client("127.0.0.1:50051") as c:
        print(c.generate("Hello", max_tokens=20, temperature=0).text)
        for piece in c.generate_stream("Hello", max_tokens=20):
            print(piece.text, end="", flush=True)

The methods return the generated protobuf messages (pagoda.v1.generation_pb2); failures raise
grpc.RpcError (grpc.aio.AioRpcError for AsyncClient) with the server's status code and message.

Security: `api_key=` sends `authorization: Bearer <key>` with every call; `tls_ca=` (PEM file of
the CA that signed the server's certificate; or `tls=True` for the system roots) makes the channel
TLS, `tls_cert=`/`tls_key=` add a client certificate (mutual TLS), `tls_server_name=` checks the
server's certificate against that name instead of the target's host.

Replicas: the target may name several servers, `Client(["10.0.0.1:50051", "10.0.0.2:50051"])` or
`Client("host1:50051,host2:50051")`, or a DNS name with several addresses,
`Client("dns:///pagoda-headless.NAMESPACE.svc.cluster.local:50051")` (a Kubernetes headless Service;
gRPC re-resolves it when a connection drops; see deploy/kubernetes/README.md). Such a channel (see
replica_service_config) balances calls round_robin over the replicas, picking one per call, instead of
pinning every call to the first address; skips a replica whose grpc.health.v1 status for
pagoda.v1.GenerationService is not SERVING (loading, draining: client-side health checking); and retries
a call that failed UNAVAILABLE (a replica that is draining, or gone) on another one, up to
RETRY_ATTEMPTS attempts in all. gRPC retries only a call that has not been committed: a stream that has
already received a message is never retried. Host names in a list are resolved once, when the channel is
made (gRPC's ipv4:/ipv6: targets take addresses only); a dns:/// target follows changes. With TLS and
several host:port targets give tls_server_name, the name the replicas' certificate was issued for: there
is no single host name to check it against.
"""
from __future__ import annotations

import ipaddress
import json
import socket
import time
from typing import AsyncIterator, Iterable, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagoda.v1 import generation_pb2 as pb
from pagoda.v1 import generation_pb2_grpc as pb_grpc

DEFAULT_TARGET = "localhost:50051"
SERVICE_NAME = "pagoda.v1.GenerationService"
RETRY_ATTEMPTS = 5  # the most gRPC allows: the first attempt and up to 4 retries
# gRPC name-resolver schemes: such a target goes to gRPC as it is
_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:", "xds:")

_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "n")


def build_request(prompt: str | Sequence[int] | None = None, *, messages: Iterable | None = None,
                  stream: bool = False, request_id: str = "",
                  temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                  min_p: float | None = None, seed: int | None = None, repetition_penalty: float | None = None,
                  presence_penalty: float | None = None, frequency_penalty: float | None = None,
                  max_tokens: int | None = None, min_tokens: int | None = None, stop: Iterable[str] = (),
                  stop_token_ids: Iterable[int] = (), ignore_eos: bool = False, logprobs: bool = False,
                  top_logprobs: int | None = None, priority: int = 0, n: int | None = None,
                  include_stop_str_in_output: bool | None = None, skip_special_tokens: bool | None = None,
                  truncate_prompt_tokens: int | None = None, logit_bias: dict[int, float] | None = None,
                  bad_words: Iterable[str] = (), prompt_logprobs: int | None = None, echo: bool = False,
                  prompts: Iterable[str | Sequence[int]] | None = None, json_schema: str | dict | None = None,
                  json_object: bool = False, regex: str | None = None, choice: Iterable[str] | None = None,
                  grammar: str | None = None, time_limit_ms: int | None = None, adapter: str | None = None):
    """A GenerateRequest (or GenerateStreamRequest with stream=True). The prompt is text (str), token
    ids (a sequence of ints) or `messages`: (role, content) pairs or {"role", "content"} dicts; or
    `prompts`, several texts or token id lists completed in one call (one result each, in order).
    A structured output: `json_schema` (a dict or its JSON text), `json_object`, `regex`, `choice` or
    `grammar` (Lark). `adapter`: a LoRA adapter loaded on the server, by name. None leaves a field
    unset, so the server's default applies."""
    req = pb.GenerateStreamRequest() if stream else pb.GenerateRequest()
    req.request_id = request_id
    _set_prompt(req, prompt, messages, prompts)
    values = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                  repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                  frequency_penalty=frequency_penalty, n=n)
    for name in _SAMPLING:
        if values[name] is not None:
            setattr(req.sampling, name, values[name])
    for token_id, bias in (logit_bias or {}).items():
        req.sampling.logit_bias[token_id] = bias
    req.sampling.bad_words.extend(bad_words)
    _set_stopping(req.stopping, max_tokens, min_tokens, stop, stop_token_ids, ignore_eos, include_stop_str_in_output)
    for name, value in (("skip_special_tokens", skip_special_tokens),
                        ("truncate_prompt_tokens", truncate_prompt_tokens), ("prompt_logprobs", prompt_logprobs),
                        ("time_limit_ms", time_limit_ms), ("top_logprobs", top_logprobs), ("adapter", adapter)):
        if value is not None:
            setattr(req, name, value)
    req.logprobs, req.priority, req.echo = logprobs, priority, echo
    _set_structured(req.structured_output, json_schema, json_object, regex, choice, grammar)
    return req


def _set_prompt(req, prompt, messages, prompts) -> None:
    if messages is not None:
        req.messages.SetInParent()  # an empty conversation is still "messages", which the server rejects
        for m in messages:
            role, content = (m["role"], m["content"]) if isinstance(m, dict) else m
            req.messages.messages.add(role=role, content=content)
    elif isinstance(prompt, str):
        req.text = prompt
    elif prompt is not None:
        req.token_ids.SetInParent()
        req.token_ids.ids.extend(prompt)
    if prompts is not None:
        req.prompts.SetInParent()  # an empty list is still "prompts", which the server rejects
        for p in prompts:
            one = req.prompts.prompts.add()
            if isinstance(p, str):
                one.text = p
            else:
                one.token_ids.ids.extend(p)


def _set_stopping(stopping, max_tokens, min_tokens, stop, stop_token_ids, ignore_eos, include_stop_str) -> None:
    if max_tokens is not None:
        stopping.max_tokens = max_tokens
    if min_tokens is not None:
        stopping.min_tokens = min_tokens
    stopping.stop.extend(stop)
    stopping.stop_token_ids.extend(stop_token_ids)
    stopping.ignore_eos = ignore_eos
    if include_stop_str is not None:
        stopping.include_stop_str_in_output = include_stop_str


def _set_structured(so, json_schema, json_object: bool, regex, choice, grammar) -> None:
    if json_schema is not None:
        so.json_schema = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
    if json_object:
        so.json_object = True
    if regex is not None:
        so.regex = regex
    if choice is not None:
        so.choice.SetInParent()  # an empty list is still "choice", which the server rejects
        so.choice.choices.extend(choice)
    if grammar is not None:
        so.grammar = grammar


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def replica_service_config(health_check: bool = True) -> dict:
    """The gRPC service config of a channel to several replicas: round_robin over every address (a
    new pick per call), client-side health checking on pagoda.v1.GenerationService (a replica that
    reports NOT_SERVING, i.e. loads or drains, gets no new calls), and retries of UNAVAILABLE for
    the service's methods (a retry goes to the next replica in the rotation)."""
    config: dict = {
        "loadBalancingConfig": [{"round_robin": {}}],
        "methodConfig": [{
            "name": [{"service": SERVICE_NAME}],
            "retryPolicy": {"maxAttempts": RETRY_ATTEMPTS, "initialBackoff": "0.1s", "maxBackoff": "2s",
                            "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
        }],
    }
    if health_check:
        config["healthCheckConfig"] = {"serviceName": SERVICE_NAME}
    return config


def _split_host_port(entry: str) -> tuple[str, int]:
    host, sep, port = entry.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or (":" in host and
                                                                                  not entry.startswith("[")):
        raise ValueError(f"each of several targets must be host:port (an IPv6 address as [addr]:port), got {entry!r}")
    return host, int(port)


def _addresses(entries: list[str]) -> str:
    """host:port entries as one gRPC target, ipv4:a:p,b:p or ipv6:[a]:p,[b]:p, host names resolved."""
    found: dict[int, list[str]] = {socket.AF_INET: [], socket.AF_INET6: []}
    per_entry = []
    for entry in entries:
        host, port = _split_host_port(entry)
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            raise ValueError(f"cannot resolve {host!r} (of the target {entry!r}): {e.strerror or e}") from None
        families = set()
        for family, _, _, _, addr in infos:
            if family in found:
                families.add(family)
                ip = ipaddress.ip_address(addr[0].split("%")[0])  # (a link-local address loses its scope)
                one = f"{ip}:{port}" if family == socket.AF_INET else f"[{ip}]:{port}"
                if one not in found[family]:
                    found[family].append(one)
        per_entry.append((entry, families))
    for family, scheme in ((socket.AF_INET, "ipv4"), (socket.AF_INET6, "ipv6")):
        if all(family in families for _, families in per_entry):
            return f"{scheme}:" + ",".join(found[family])
    raise ValueError("several targets must all have IPv4 addresses or all IPv6 ones (gRPC cannot mix the "
                     f"two in one channel): {', '.join(entries)}")


def channel_target(target: str | Sequence[str]) -> tuple[str, bool]:
    """(the target gRPC is given, whether it may name several replicas). A list of host:port, or a
    comma-separated string of them, becomes an ipv4:/ipv6: target of their addresses; a dns: target
    (dns:///name:port) may resolve to several addresses; anything else is passed on as it is."""
    if isinstance(target, str):
        if target.startswith(_SCHEMES) or "," not in target:
            return target, target.startswith("dns:") or (target.startswith(("ipv4:", "ipv6:")) and "," in target)
        entries = [t.strip() for t in target.split(",") if t.strip()]
    else:
        entries = [t.strip() for t in target if t and t.strip()]
    if not entries:
        raise ValueError(f"no target given: {target!r}")
    if len(entries) == 1:
        return entries[0], False
    return _addresses(entries), True


def make_channel(target: str | Sequence[str] = DEFAULT_TARGET, *, aio: bool = False, tls: bool = False,
                 tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                 tls_server_name: str | None = None, options: Sequence[tuple[str, object]] = (),
                 balance: bool | None = None, health_check: bool = True):
    """A plaintext channel, or a TLS one when tls / tls_ca / tls_cert is given (PEM file paths).

    `target`: host:port; several, as a list or a comma-separated string (host names are resolved
    now); or a gRPC target such as dns:///name:port. `balance`: round_robin over the replicas with
    retries and, with `health_check`, client-side health checking (replica_service_config); by
    default on for several targets and for dns: targets, off for one host:port (as it was). A
    grpc.service_config in `options` wins over this one."""
    options = list(options)
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("a client certificate needs both tls_cert and tls_key")
    target, replicas = channel_target(target)
    if replicas and target.startswith(("ipv4:", "ipv6:")) and (tls or tls_ca or tls_cert) and not tls_server_name:
        raise ValueError("TLS to several targets needs tls_server_name (--tls-server-name): the name the "
                         "servers' certificate was issued for")
    if balance if balance is not None else replicas:
        if not any(name == "grpc.service_config" for name, _ in options):
            options.append(("grpc.service_config", json.dumps(replica_service_config(health_check))))
        options.append(("grpc.enable_retries", 1))
    if not (tls or tls_ca or tls_cert):
        return grpc.aio.insecure_channel(target, options=options) if aio else grpc.insecure_channel(target, options)
    creds = grpc.ssl_channel_credentials(root_certificates=_read(tls_ca), private_key=_read(tls_key),
                                         certificate_chain=_read(tls_cert))
    if tls_server_name:
        options.append(("grpc.ssl_target_name_override", tls_server_name))
    return (grpc.aio.secure_channel(target, creds, options=options) if aio
            else grpc.secure_channel(target, creds, options))


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


class _Base:
    def __init__(self, target: str | Sequence[str], timeout: float | None, channel, api_key: str | None, aio: bool,
                 **tls):
        self.channel = channel or make_channel(target, aio=aio, **tls)
        self.stub = pb_grpc.GenerationServiceStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.timeout = timeout
        self._auth = auth_metadata(api_key)

    def _t(self, timeout):
        return self.timeout if timeout is None else timeout

    def _md(self, metadata=None):
        """Per-call metadata: the API key, plus the caller's (e.g. ("x-request-id", "abc"))."""
        md = self._auth + tuple(metadata or ())
        return md or None


class Client(_Base):
    """Blocking client. `timeout` (seconds) is the default deadline of each call; None: no deadline.
    `target`: host:port, several (a list, or "host1:port1,host2:port2") or a gRPC target such as
    dns:///name:port; `balance`, `health_check`: see make_channel (and the module's "Replicas")."""

    def __init__(self, target: str | Sequence[str] = DEFAULT_TARGET, timeout: float | None = None,
                 channel: grpc.Channel | None = None, *, api_key: str | None = None, tls: bool = False,
                 tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                 tls_server_name: str | None = None, options: Sequence[tuple[str, object]] = (),
                 balance: bool | None = None, health_check: bool = True):
        super().__init__(target, timeout, channel, api_key, False, tls=tls, tls_ca=tls_ca, tls_cert=tls_cert,
                         tls_key=tls_key, tls_server_name=tls_server_name, options=options, balance=balance,
                         health_check=health_check)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self.channel.close()

    def generate(self, prompt=None, *, timeout: float | None = None, metadata=None, **kw) -> pb.GenerateResponse:
        """The whole completion; keyword arguments as build_request."""
        return self.stub.Generate(build_request(prompt, **kw), timeout=self._t(timeout), metadata=self._md(metadata))

    def generate_stream(self, prompt=None, *, timeout: float | None = None, metadata=None,
                        **kw) -> Iterator[pb.GenerateStreamResponse]:
        """The completion as it is produced. The returned iterator is also a grpc.Call: .cancel() stops it."""
        return self.stub.GenerateStream(build_request(prompt, stream=True, **kw), timeout=self._t(timeout),
                                        metadata=self._md(metadata))

    def tokenize(self, text: str, *, timeout: float | None = None) -> list[int]:
        return list(self.stub.Tokenize(pb.TokenizeRequest(text=text), timeout=self._t(timeout),
                                       metadata=self._md()).token_ids)

    def model_info(self, *, timeout: float | None = None) -> pb.GetModelInfoResponse:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self._t(timeout), metadata=self._md())

    def stats(self, *, timeout: float | None = None) -> pb.GetStatsResponse:
        return self.stub.GetStats(pb.GetStatsRequest(), timeout=self._t(timeout), metadata=self._md())

    def load_lora_adapter(self, name: str, path: str, *, timeout: float | None = None) -> None:
        self.stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(name=name, path=path), timeout=self._t(timeout),
                                  metadata=self._md())

    def unload_lora_adapter(self, name: str, *, timeout: float | None = None) -> None:
        """Returns once the adapter's requests in flight have finished and it is gone."""
        self.stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(name=name), timeout=self._t(timeout),
                                    metadata=self._md())

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """"SERVING", "NOT_SERVING", ... (grpc.health.v1) for the whole server ("") or a service."""
        resp = self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self._t(timeout) or 5,
                                      metadata=self._md())
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Blocks until the server reports SERVING; raises TimeoutError after `timeout` seconds, naming
        the last status (caused by the last check's grpc.RpcError when that check failed)."""
        deadline = time.monotonic() + timeout
        while True:
            error = None
            try:
                status = self.health(timeout=min(5.0, max(0.1, deadline - time.monotonic())))
            except grpc.RpcError as e:
                status, error = e.code().name, e
            if status == "SERVING":
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not SERVING after {timeout:g}s (last health check: {status})") from error
            time.sleep(0.1)


class AsyncClient(_Base):
    """asyncio client; same methods as Client, awaitable (generate_stream is an async iterator)."""

    def __init__(self, target: str | Sequence[str] = DEFAULT_TARGET, timeout: float | None = None,
                 channel: grpc.aio.Channel | None = None, *, api_key: str | None = None, tls: bool = False,
                 tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                 tls_server_name: str | None = None, options: Sequence[tuple[str, object]] = (),
                 balance: bool | None = None, health_check: bool = True):
        super().__init__(target, timeout, channel, api_key, True, tls=tls, tls_ca=tls_ca, tls_cert=tls_cert,
                         tls_key=tls_key, tls_server_name=tls_server_name, options=options, balance=balance,
                         health_check=health_check)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def generate(self, prompt=None, *, timeout: float | None = None, metadata=None,
                       **kw) -> pb.GenerateResponse:
        return await self.stub.Generate(build_request(prompt, **kw), timeout=self._t(timeout),
                                        metadata=self._md(metadata))

    async def generate_stream(self, prompt=None, *, timeout: float | None = None, metadata=None,
                              **kw) -> AsyncIterator[pb.GenerateStreamResponse]:
        call = self.stub.GenerateStream(build_request(prompt, stream=True, **kw), timeout=self._t(timeout),
                                        metadata=self._md(metadata))
        try:
            async for msg in call:
                yield msg
        finally:
            call.cancel()  # no-op once the call has finished; stops the server's work if we left early

    async def tokenize(self, text: str, *, timeout: float | None = None) -> list[int]:
        resp = await self.stub.Tokenize(pb.TokenizeRequest(text=text), timeout=self._t(timeout), metadata=self._md())
        return list(resp.token_ids)

    async def model_info(self, *, timeout: float | None = None) -> pb.GetModelInfoResponse:
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self._t(timeout), metadata=self._md())

    async def stats(self, *, timeout: float | None = None) -> pb.GetStatsResponse:
        return await self.stub.GetStats(pb.GetStatsRequest(), timeout=self._t(timeout), metadata=self._md())

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        resp = await self.health_stub.Check(health_pb2.HealthCheckRequest(service=service),
                                            timeout=self._t(timeout) or 5, metadata=self._md())
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def collect(stream: Iterable[pb.GenerateStreamResponse]) -> pb.GenerateResponse:
    """Joins a stream into what Generate returns for the same request."""
    out = pb.GenerateResponse()
    text = []
    for msg in stream:
        out.request_id = msg.request_id
        text.append(msg.text)
        out.token_ids.extend(msg.token_ids)
        out.logprobs.extend(msg.logprobs)
        if msg.finish_reason:
            out.finish_reason = msg.finish_reason
        if msg.HasField("usage"):
            out.usage.CopyFrom(msg.usage)
    out.text = "".join(text)
    return out

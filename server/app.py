"""PagodaServer: the grpc.aio server around one AsyncEngine, with grpc.health.v1 and reflection,
optional TLS / mutual TLS, bearer-token auth (server/auth.py) and Prometheus metrics (server/metrics.py).

Start-up: listen at once with health NOT_SERVING, build the engine in a thread, then SERVING.
drain(): health NOT_SERVING, new calls UNAVAILABLE, in-flight calls get a grace period, then stop.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagoda.server.options import ServerOptions
from pagoda.server.ports import check_free
from pagoda.server.servicer import SERVICE_NAME, GrpcServicer, add_servicer_to_server
from pagoda.server.state import DRAINING, SERVING, ServerState

log = logging.getLogger("pagoda.server")

DEFAULT_PORT = 50051


def _load_in_thread(factory) -> asyncio.Future:
    """Runs factory() in a daemon thread (so a SIGTERM during a long load need not wait for it)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def work():
        try:
            result = factory()
            done = lambda: fut.done() or fut.set_result(result)  # noqa: E731
        except BaseException as e:  # noqa: BLE001 - handed to the loop
            err = e
            done = lambda: fut.done() or fut.set_exception(err)  # noqa: E731
        _call_soon(loop, done)  # a closed loop: the server stopped while loading

    threading.Thread(target=work, name="pagoda-load", daemon=True).start()
    return fut


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: the server has stopped
        pass


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def _reflection_v1_file():
    """grpc/reflection/v1/reflection.proto in the default descriptor pool, so that reflection can describe
    its own v1 service (grpcurl / buf curl resolve every listed service). grpcio-reflection ships only
    v1alpha (grpc/grpc#38576); v1 is the same file under another package, so it is built from v1alpha's
    descriptor, renamed. Added once; left alone if something already defined it."""
    from google.protobuf import descriptor_pb2, descriptor_pool, text_format
    from grpc_reflection.v1alpha import reflection_pb2

    pool = descriptor_pool.Default()
    try:
        return pool.FindFileContainingSymbol(REFLECTION_V1)
    except KeyError:
        pass
    alpha = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(alpha)
    # package, type references (".grpc.reflection.v1alpha.X"), go_package and java_package all say v1alpha
    v1 = text_format.Parse(text_format.MessageToString(alpha).replace("v1alpha", "v1"),
                           descriptor_pb2.FileDescriptorProto())
    v1.name = "grpc/reflection/v1/reflection.proto"  # the real v1 file's name
    v1.options.ClearField("deprecated")  # only v1alpha is deprecated
    pool.AddSerializedFile(v1.SerializeToString())
    return pool.FindFileByName(v1.name)


def _enable_reflection(server, service_names) -> None:
    """Serves server reflection as both grpc.reflection.v1.ServerReflection (what current grpcurl, buf curl
    and grpc-java ask first) and the older grpc.reflection.v1alpha.ServerReflection, each listing both.
    The two protocols' messages are identical on the wire, so v1 is the v1alpha servicer's one method
    registered a second time under the v1 service name."""
    from grpc_reflection.v1alpha import reflection_pb2

    _reflection_v1_file()
    names = [*service_names, REFLECTION_V1, reflection.SERVICE_NAME]
    servicer = reflection.aio.ReflectionServicer(names)  # server is a grpc.aio server
    handlers = {"ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)}
    for service in (REFLECTION_V1, reflection.SERVICE_NAME):
        # as the generated add_*_to_server functions register a service
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        server.add_registered_method_handlers(service, handlers)


class PagodaServer:
    """The gRPC server around one engine. `engine_factory()` builds an AsyncEngine (not started); it
    runs in a thread while the server already answers health checks."""

    def __init__(self, engine_factory, host: str = "[::]", port: int = DEFAULT_PORT,
                 options: ServerOptions | None = None):
        from pagoda.server.auth import ApiKeyInterceptor
        from pagoda.server.metrics import Metrics

        self.engine_factory = engine_factory
        self.host, self._port = host, port
        self.address = f"{host}:{port}"
        self.http_port: int | None = None
        self._http = None
        self.options = options = options or ServerOptions()
        self.state = ServerState(options)
        self.metrics = self.state.metrics = Metrics(self.state)
        self.health = health.aio.HealthServicer()
        interceptors = [ApiKeyInterceptor(options.api_key, self.metrics)] if options.api_key else []
        self.server = grpc.aio.server(options=options.grpc_options(), interceptors=interceptors)
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.ready = asyncio.Event()
        self.load_error: BaseException | None = None
        self.died = asyncio.Event()  # the engine died while serving (server/main.py then exits 1)
        self._load_task: asyncio.Task | None = None
        self._own_tracing = None

    async def _set_health(self, status) -> None:
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    async def start(self) -> int:
        """Listens (health NOT_SERVING) and starts loading the engine; returns the bound port."""
        credentials = self._credentials()  # reads the PEM files: a missing one fails before listening
        if self.state.tracing is None:  # unless given (tests): as the OTEL_* environment says, read now
            from pagoda.server.tracing import from_env

            self.state.tracing = self._own_tracing = from_env(os.environ)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        add_servicer_to_server(GrpcServicer(self.state), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        _enable_reflection(self.server, [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name])
        check_free(self.host, self._port, "--port")
        try:
            if credentials is None:
                self.port = self.server.add_insecure_port(self.address)
            else:
                self.port = self.server.add_secure_port(self.address, credentials)
        except RuntimeError as e:  # taken since check_free, or a bind gRPC refuses for its own reasons
            raise OSError(f"cannot listen on {self.address} (--port): {e}") from None
        if self.options.metrics_port:
            self.metrics_port = self.metrics.start_http(self.options.metrics_port, self.options.metrics_host)
            log.info("metrics on http://%s:%d/metrics", self.options.metrics_host, self.metrics_port)
        await self.server.start()
        o = self.options
        security = ("mutual TLS" if o.tls_client_ca else "TLS") if credentials is not None else "plaintext"
        if o.http_port is not None:
            from pagoda.server.http import app as http_app

            self._http = http_app.start(self.state, self.host, o.http_port)
            self.http_port = self._http.port
            log.info("HTTP (OpenAI-compatible API) on %s://%s:%d/v1 (port %d)", "https" if credentials else "http",
                     self.host, self.http_port, self.http_port)
        log.info("listening on %s (port %d); %s%s; loading the model", self.address, self.port, security,
                 ", API key required" if o.api_key else "")
        self._load_task = asyncio.create_task(self._load())
        return self.port

    def _credentials(self):
        o = self.options
        if not o.tls_cert:
            return None

        def read(path: str, what: str) -> bytes:
            try:
                with open(path, "rb") as f:
                    return f.read()
            except OSError as e:
                raise ValueError(f"cannot read the {what} {path!r}: {e.strerror}") from e

        key, cert = read(o.tls_key, "TLS key (--tls-key)"), read(o.tls_cert, "TLS certificate (--tls-cert)")
        ca = read(o.tls_client_ca, "client CA (--tls-client-ca)") if o.tls_client_ca else None
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)

    async def _load(self) -> None:
        try:
            engine = await _load_in_thread(self.engine_factory)
            loop = asyncio.get_running_loop()
            engine.on_failure = lambda error: _call_soon(loop, self._engine_died, error)
            engine.start()
        except Exception as e:
            self.load_error = e
            if isinstance(e, ValueError):  # a bad option or model: the message says it all
                log.error("loading the engine failed: %s", e)
            else:
                log.exception("loading the engine failed")
            self.ready.set()
            return
        if self.state.phase == DRAINING:  # SIGTERM came while loading
            await asyncio.to_thread(engine.shutdown)
            return
        self.state.engine = engine
        self.state.phase = SERVING
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        info, config = engine.model_info, engine.config
        device = config.device if config.device != "cpu" or not config.cpu_threads else \
            f"cpu, {config.cpu_threads} engine thread{'s' * (config.cpu_threads > 1)}"
        dtype = info.dtype + (f" + {info.quantization} weights" if info.quantization else "") \
            + (", deterministic" if info.deterministic else "")
        http = f"HTTP (OpenAI API) on {self.host}:{self.http_port}" if self.http_port is not None else "HTTP off"
        log.info("serving %s (%s, %s, %s, context %d): gRPC on %s:%d, %s", info.model_id, info.architecture, dtype,
                 device, info.max_model_len, self.host, self.port, http)
        self.ready.set()

    def _engine_died(self, error: BaseException) -> None:
        """The engine's process exited (or its loop crashed): its calls have failed with UNAVAILABLE;
        health goes NOT_SERVING at once and new calls are refused, so that load balancers move on."""
        log.error("%s: health NOT_SERVING, new calls refused", error)
        self.state.phase = DRAINING
        asyncio.ensure_future(self.health.enter_graceful_shutdown())
        self.died.set()

    async def drain(self, grace: float) -> None:
        """Health NOT_SERVING, refuse new calls, let in-flight ones finish for up to `grace` seconds,
        then stop the server and shut the engine down."""
        if self.state.phase != DRAINING:
            self.state.phase = DRAINING
            await self.health.enter_graceful_shutdown()  # every service NOT_SERVING from now on
            log.info("draining: %d call(s) in flight, grace period %gs", self.state.inflight, grace)
        try:
            await asyncio.wait_for(self.state.idle.wait(), timeout=grace)
        except asyncio.TimeoutError:
            log.warning("grace period over with %d call(s) still in flight; cancelling them", self.state.inflight)
        await self.server.stop(grace=0.5)
        if self._http is not None:
            await self._http.stop()
        self.metrics.stop_http()
        if self._own_tracing is not None:
            await asyncio.to_thread(self._own_tracing.shutdown)  # exports the spans still batched
        engine = self.state.engine
        if engine is not None:
            # Calls cancelled at the end of the grace period abort their requests; let the engine's
            # loop free their blocks (a step or two) before it stops.
            deadline = asyncio.get_running_loop().time() + 2.0
            while asyncio.get_running_loop().time() < deadline:
                s = engine.stats()
                if not s.num_running and not s.num_waiting:
                    break
                await asyncio.sleep(0.01)
            await asyncio.to_thread(engine.shutdown)
        log.info("stopped")

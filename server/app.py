"""PagodaServer: the grpc.aio server around one AsyncEngine, with grpc.health.v1 and reflection.

Start-up: listen at once with health NOT_SERVING, build the engine in a thread, then SERVING.
drain(): health NOT_SERVING, new calls UNAVAILABLE, in-flight calls get a grace period, then stop.
"""
from __future__ import annotations

import asyncio
import logging
import threading

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagoda.v1 import generation_pb2_grpc as pb_grpc
from server.servicer import DRAINING, SERVING, SERVICE_NAME, GenerationServicer, ServerState

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
        try:
            loop.call_soon_threadsafe(done)
        except RuntimeError:  # the loop is closed: the server stopped while loading
            pass

    threading.Thread(target=work, name="pagoda-load", daemon=True).start()
    return fut


class PagodaServer:
    """The gRPC server around one engine. `engine_factory()` builds an AsyncEngine (not started); it
    runs in a thread while the server already answers health checks."""

    def __init__(self, engine_factory, host: str = "[::]", port: int = DEFAULT_PORT):
        self.engine_factory = engine_factory
        self.address = f"{host}:{port}"
        self.state = ServerState()
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server(options=[
            ("grpc.so_reuseport", 0),  # a second server on the same port fails instead of sharing it
        ])
        self.port: int | None = None
        self.ready = asyncio.Event()
        self.load_error: BaseException | None = None
        self._load_task: asyncio.Task | None = None

    async def _set_health(self, status) -> None:
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    async def start(self) -> int:
        """Listens (health NOT_SERVING) and starts loading the engine; returns the bound port."""
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        pb_grpc.add_GenerationServiceServicer_to_server(GenerationServicer(self.state), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self.server)
        self.port = self.server.add_insecure_port(self.address)  # raises RuntimeError if it cannot bind
        await self.server.start()
        log.info("listening on %s (port %d); loading the model", self.address, self.port)
        self._load_task = asyncio.create_task(self._load())
        return self.port

    async def _load(self) -> None:
        try:
            engine = await _load_in_thread(self.engine_factory)
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
        info = engine.model_info
        log.info("serving %s (%s, %s, context %d) on port %d", info.model_id, info.architecture, info.dtype,
                 info.max_model_len, self.port)
        self.ready.set()

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
        engine = self.state.engine
        if engine is not None:
            await asyncio.to_thread(engine.shutdown)
        log.info("stopped")

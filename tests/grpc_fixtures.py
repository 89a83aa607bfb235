"""Shared helpers for the gRPC tests: tiny checkpoints, an in-process server on its own event loop,
`pagoda serve` as a subprocess, and the Node/buf tooling from tests/node/node_modules."""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import glob
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NODE_DIR = REPO / "tests" / "node"
BUF = NODE_DIR / "node_modules" / ".bin" / "buf"
TINY_VOCAB = 262  # the byte-level tokenizer of engine.demo: 256 bytes + 6 special tokens


def _tmpdir(prefix: str) -> str:
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def tiny_checkpoint(arch: str = "llama", initializer_range: float = 0.3) -> str:
    """A tiny random checkpoint (engine.demo.build_tiny_checkpoint), built once per test process.
    Peaky random weights (wide init, as tests/conftest.py uses) keep greedy choices far from ties, so
    float32 differences between pagoda and transformers cannot flip them."""
    return _tiny_checkpoint(arch, initializer_range)


@functools.lru_cache(maxsize=None)
def _tiny_checkpoint(arch: str, initializer_range: float) -> str:
    from pagoda.engine.demo import build_tiny_checkpoint

    path = os.path.join(_tmpdir(f"pagoda-{arch}-"), arch)
    return build_tiny_checkpoint(path, arch=arch, initializer_range=initializer_range)


def engine_config(model: str, **kw):
    from pagoda.engine import EngineConfig

    kw = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 128, **kw}
    return EngineConfig(model=model, **kw)


def require_node_modules() -> None:
    """CI installs tests/node/node_modules (npm ci --prefix tests/node); fail, do not skip, without it."""
    if shutil.which("node") is None:
        pytest.fail("node is not on PATH; these tests need Node.js >= 18")
    missing = [p for p in (BUF, NODE_DIR / "node_modules" / "@grpc" / "grpc-js",
                           NODE_DIR / "node_modules" / "@grpc" / "proto-loader") if not p.exists()]
    if missing:
        pytest.fail(f"{missing[0]} is missing: run `npm ci --prefix tests/node` first")


class InProcessServer:
    """A server.app.PagodaServer on its own asyncio loop in a background thread, listening on
    127.0.0.1 (any free port). `engine_factory` builds the (unstarted) AsyncEngine; `options` are its
    ServerOptions (http_port=0: the HTTP API too, on any free port)."""

    def __init__(self, engine_factory, options=None):
        from pagoda.server.app import PagodaServer

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-grpc-server", daemon=True)
        self.thread.start()

        async def make():
            return PagodaServer(engine_factory, host="127.0.0.1", port=0, options=options)

        self.server = self.call(make())
        self.spec_checks = []  # openai_client's checkers of this server's HTTP answers (openai_spec.py)
        self.port = self.call(self.server.start())
        self.target = f"127.0.0.1:{self.port}"

    @classmethod
    def for_config(cls, config, options=None) -> "InProcessServer":
        from pagoda.engine import AsyncEngine

        return cls(lambda: AsyncEngine(config), options)

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.server.http_port}"

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro):
        """Starts coro on the server's loop; returns a concurrent.futures.Future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def wait_ready(self, timeout: float = 120) -> "InProcessServer":
        self.call(asyncio.wait_for(self.server.ready.wait(), timeout), timeout + 5)
        if self.server.load_error is not None:
            raise RuntimeError("engine failed to load") from self.server.load_error
        return self

    @property
    def engine(self):
        return self.server.state.engine

    def stop(self, grace: float = 5.0) -> None:
        """Drains and stops the server; then every answer an openai_client got from it must have
        followed OpenAI's specification."""
        try:
            self.call(self.server.drain(grace), grace + 30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
        for check in self.spec_checks:
            check.assert_clean()


@contextlib.contextmanager
def patched_run(engine, wrap):
    """The in-process engine's model runs go through wrap(run), run being the real one, until the
    block exits. Returns the runner, for a wrapper that restores run itself after one call."""
    runner = engine.core.runner
    run = runner.run
    runner.run = wrap(run)
    try:
        yield runner
    finally:
        runner.run = run


@contextlib.contextmanager
def slow_steps(engine, seconds: float = 0.01):
    """Makes each engine step take at least `seconds` longer, so a generation outlives a deadline."""
    def wrap(run):
        def slow_run(*a, **kw):
            time.sleep(seconds)
            return run(*a, **kw)
        return slow_run

    with patched_run(engine, wrap):
        yield


@contextlib.contextmanager
def failing_step(engine, times: int = 1):
    """The next `times` model runs raise RuntimeError (the engine's step fails those requests)."""
    left = [times]

    def wrap(run):
        def bad_run(*a, **kw):
            if left[0] > 0:
                left[0] -= 1
                raise RuntimeError("injected failure (test)")
            return run(*a, **kw)
        return bad_run

    with patched_run(engine, wrap):
        yield


def rendezvous_port() -> int:
    """A free port for --master-port, below the kernel's ephemeral range (32768-60999), so no `--port 0` or
    outgoing connection of the processes it is meant for can be handed the same port before they bind it."""
    while True:
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def pagoda_command() -> list[str]:
    """`pagoda` the way a user runs it: the console script next to this Python, else python -m."""
    script = Path(sys.executable).with_name("pagoda")
    return [str(script)] if script.exists() else [sys.executable, "-m", "pagoda.client.cli"]


class ServeProcess:
    """`pagoda serve ... --host 127.0.0.1 --port 0 --http-port 0` in a subprocess; the ports are read from
    its log (the HTTP port before the gRPC one). The engine runs in a thread of the server (a process
    less to start) unless the test is of the process boundary and passes --engine-process on."""

    def __init__(self, *args: str, env: dict | None = None, timeout: float = 120):
        cmd = pagoda_command() + ["serve", "--host", "127.0.0.1", "--port", "0", "--http-port", "0",
                                  "--engine-process", "off", *args]
        self.proc = subprocess.Popen(cmd, cwd=str(REPO), env={**os.environ, **(env or {})},
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.log: list[str] = []
        self._port_seen = threading.Event()
        self.port: int | None = None
        self.http_port: int | None = None
        threading.Thread(target=self._read, daemon=True).start()
        if not self._port_seen.wait(timeout) or self.port is None:
            self.kill()
            raise RuntimeError("pagoda serve did not report its port:\n" + "".join(self.log))
        self.target = f"127.0.0.1:{self.port}"

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)
            h = re.search(r"HTTP \(OpenAI-compatible API\) on \S+ \(port (\d+)\)", line)
            if h:
                self.http_port = int(h.group(1))
            m = re.search(r"listening on \S+ \(port (\d+)\)", line)
            if m and self.port is None:
                self.port = int(m.group(1))
                self._port_seen.set()
        self._port_seen.set()

    def wait_ready(self, timeout: float = 120) -> "ServeProcess":
        from pagoda.client.client import Client

        with Client(self.target) as c:
            try:
                c.wait_ready(timeout)
            except TimeoutError:
                raise RuntimeError("pagoda serve never became SERVING:\n" + "".join(self.log)) from None
        return self

    def output(self) -> str:
        return "".join(self.log)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def wait_all_blocks_free(client, timeout: float = 15.0):
    """GetStats until every KV block is free and nothing runs or waits; fails after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        s = client.stats()
        if s.kv_blocks_free == s.kv_blocks_total and s.num_running == 0 and s.num_waiting == 0:
            return s
        if time.monotonic() > deadline:
            pytest.fail(f"KV blocks not freed: {s}")
        time.sleep(0.02)


def children(pid: int) -> set[int]:
    """The pids of a process's children (from /proc)."""
    found = set()
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(path) as f:
                found |= {int(x) for x in f.read().split()}
        except OSError:
            pass
    return found


def is_gone(pid: int) -> bool:
    """Whether a process has exited (a zombie counts: only its reaping is left)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")  # a zombie waits only for init to reap it


def assert_all_gone(pids, timeout: float = 10) -> None:
    """Every one of these processes exits within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while any(not is_gone(p) for p in pids):
        assert time.monotonic() < deadline, f"left behind: {[p for p in pids if not is_gone(p)]}"
        time.sleep(0.05)


def openai_client(srv):
    """The official `openai` client against an InProcessServer's HTTP API (no retries: errors show as
    they are); every answer it gets is checked against OpenAI's specification (when srv stops)."""
    import httpx
    import openai

    from openai_spec import CheckingTransport

    transport = CheckingTransport()
    srv.spec_checks.append(transport)
    return openai.OpenAI(base_url=srv.http_url + "/v1", api_key="none", max_retries=0, timeout=60,
                         http_client=httpx.Client(transport=transport, timeout=60))

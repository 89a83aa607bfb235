"""`pagoda serve` at its worst moments: SIGTERM while the engine loads, while it serves, and again
while it drains ends the server and its engine process within seconds, leaving no process behind;
an engine process that dies (kill -9) fails its calls with UNAVAILABLE, turns health NOT_SERVING and
makes the server exit 1 so that its supervisor restarts it. And a backend that cannot run a model is
refused when the engine loads, not on every request."""
import os
import signal
import socket
import time

import grpc
import pytest

from grpc_fixtures import ServeProcess, assert_all_gone, children, tiny_checkpoint
from pagoda.client.client import Client
from pagoda.engine import LLM, SamplingParams
from pagoda.engine.demo import build_tiny_checkpoint

pytestmark = pytest.mark.timeout(300)
SERVE_ARGS = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "64"]


def engine_process(proc: ServeProcess, timeout: float = 120) -> int:
    """The pid of the server's engine child (not multiprocessing's resource tracker)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in children(proc.proc.pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if b"spawn_main" in cmdline:
                return pid
        time.sleep(0.05)
    raise AssertionError("no engine process appeared:\n" + proc.output())


@pytest.fixture
def silent_hub():
    """A hub endpoint on the loopback that takes connections and never answers: downloading a
    model from it keeps the engine process loading for as long as a test needs."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def test_sigterm_while_the_engine_loads(silent_hub):
    env = {"HF_ENDPOINT": silent_hub, "HF_HUB_ETAG_TIMEOUT": "600", "HF_HUB_DOWNLOAD_TIMEOUT": "600",
           "HF_HUB_OFFLINE": "0", "HF_HOME": os.path.join(os.environ.get("TMPDIR", "/tmp"), "pagoda-test-hf")}
    proc = ServeProcess("--model", "pagoda-test/never-arrives", *SERVE_ARGS, env=env)
    try:
        engine = engine_process(proc)
        time.sleep(2)  # well into loading: waiting for the hub
        assert proc.proc.poll() is None and "SERVING" not in proc.output()
        family = children(proc.proc.pid) | {engine}
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(30) == 0, proc.output()
        assert_all_gone(family)
    finally:
        proc.kill()


def test_sigterm_while_serving_and_again_while_draining():
    proc = ServeProcess("--model", tiny_checkpoint(), *SERVE_ARGS, "--grace-period", "120")
    try:
        proc.wait_ready()
        family = children(proc.proc.pid) | {engine_process(proc)}
        with Client(proc.target, timeout=60) as c:
            stream = c.generate_stream("Hello", max_tokens=400, ignore_eos=True)
            next(stream)
            proc.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 30
            while "draining" not in proc.output():
                assert time.monotonic() < deadline, proc.output()
                time.sleep(0.02)
            proc.proc.send_signal(signal.SIGTERM)  # a second signal: out at once, code 1
            assert proc.proc.wait(15) == 1
        assert_all_gone(family)
    finally:
        proc.kill()


def test_sigterm_while_serving_exits_0_and_leaves_nothing():
    proc = ServeProcess("--model", tiny_checkpoint(), *SERVE_ARGS)
    try:
        proc.wait_ready()
        family = children(proc.proc.pid) | {engine_process(proc)}
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(60) == 0, proc.output()
        assert_all_gone(family)
    finally:
        proc.kill()


def test_an_engine_process_that_dies_fails_its_calls_and_the_server_exits_1():
    proc = ServeProcess("--model", tiny_checkpoint(), *SERVE_ARGS)
    try:
        proc.wait_ready()
        engine = engine_process(proc)
        family = children(proc.proc.pid) | {engine}
        with Client(proc.target, timeout=60) as c:
            streams = [c.generate_stream("Hello", max_tokens=400, ignore_eos=True) for _ in range(8)]
            for s in streams:
                next(s)
            os.kill(engine, signal.SIGKILL)
            for s in streams:
                with pytest.raises(grpc.RpcError) as e:
                    list(s)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
                assert "engine process exited" in e.value.details()
            try:  # NOT_SERVING until the process is gone (or already gone)
                assert c.health() != "SERVING"
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert proc.proc.wait(30) == 1, proc.output()
        assert "the engine died" in proc.output()
        assert_all_gone(family)
    finally:
        proc.kill()


def test_a_backend_that_cannot_run_the_model_is_refused_at_load(tmp_path):
    path = build_tiny_checkpoint(str(tmp_path / "m"), "llama", hidden_size=32, num_attention_heads=4,
                                 num_key_value_heads=2, initializer_range=0.3)  # head_dim 8
    with pytest.raises(ValueError, match=r"attention_backend 'triton'.*head_dim must be in \[16, 256\], got 8"):
        LLM(path, attention_backend="triton", num_kv_blocks=16)
    out = LLM(path, num_kv_blocks=16).generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(out.token_ids) == 4

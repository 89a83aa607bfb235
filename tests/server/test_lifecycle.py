"""`pagoda serve` at its worst moments: SIGTERM while the engine loads, while it serves, and again
while it drains ends the server and its engine process within seconds, leaving no process behind;
an engine process that dies (kill -9) fails its calls with UNAVAILABLE, turns health NOT_SERVING and
makes the server exit 1 so that its supervisor restarts it. And a backend that cannot run a model is
refused when the engine loads, not on every request."""
import os
import signal
import socket
import subprocess
import time

import grpc
import pytest
import torch

from grpc_fixtures import REPO, ServeProcess, assert_all_gone, children, pagoda_command, tiny_checkpoint
from pagoda.client.client import Client
from pagoda.engine import LLM, SamplingParams
from pagoda.engine.demo import build_tiny_checkpoint

pytestmark = pytest.mark.timeout(300)
SERVE_ARGS = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "64", "--engine-process", "on"]


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
            try:  # NOT_SERVING until the process is gone (or already gone, or stopping: the call cancelled)
                assert c.health() != "SERVING"
            except grpc.RpcError as err:
                assert err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        assert proc.proc.wait(30) == 1, proc.output()
        assert "the engine died" in proc.output()
        assert_all_gone(family)
    finally:
        proc.kill()


def test_a_backend_that_cannot_run_the_model_is_refused_at_load(tmp_path):
    path = build_tiny_checkpoint(str(tmp_path / "m"), "llama", hidden_size=32, num_attention_heads=4,
                                 num_key_value_heads=2, initializer_range=0.3)  # head_dim 8
    with pytest.raises(ValueError, match=r"attention_backend 'triton'.*head_dim must be in \[16, 256\], got 8"):
        LLM(path, dtype="float32", attention_backend="triton", num_kv_blocks=16)
    out = LLM(path, dtype="float32", num_kv_blocks=16).generate([[1, 2, 3]], SamplingParams(temperature=0,
            max_tokens=4))[0]
    assert len(out.token_ids) == 4


@pytest.mark.parametrize("flag,fix", [
    ("--port", "pass another port, or 0 for any free one"),
    ("--http-port", "pass another port, 0 for any free one, or off"),
    ("--metrics-port", "pass another port, or 0 for no metrics endpoint"),
])
def test_a_port_in_use_is_one_line_naming_its_flag(flag, fix):
    """Not gRPC's C-core log lines, nor a port number with no hint of the flag that chose it."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = {"--port": "0", "--http-port": "0", flag: str(port)}
        cmd = pagoda_command() + ["serve", "--host", "127.0.0.1", "--model", tiny_checkpoint(), *SERVE_ARGS,
                                  *(a for pair in ports.items() for a in pair)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 1 and out.stdout == "", out
    assert len(out.stderr.splitlines()) == 1, out.stderr
    assert out.stderr.endswith(f"ERROR pagoda.server: port {port} is in use ({flag}): {fix}\n"), out.stderr


def test_an_install_without_triton_serves_on_cpu(tmp_path, monkeypatch, caplog):
    """triton is a test extra (PyPI's CUDA torch brings its own): a CPU install has none, and must not need it."""
    import sys

    from pagoda.engine.executor.model_runner import attention_backend

    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['triton'] = None  # as if not installed\n")
    env = {"PYTHONPATH": str(tmp_path)}  # the server and its engine process alike
    proc = ServeProcess("--model", tiny_checkpoint(), *SERVE_ARGS, env=env)
    try:
        proc.wait_ready()
        with Client(proc.target, timeout=60) as c:
            assert len(c.generate("Hello", max_tokens=4, ignore_eos=True).token_ids) == 4
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(60) == 0 and "triton" not in proc.output(), proc.output()
    finally:
        proc.kill()
    for argv in (["offline", "hi", "--model", tiny_checkpoint(), "--max-tokens", "2"], ["serve", "--help"]):
        out = subprocess.run(pagoda_command() + argv, capture_output=True, text=True, timeout=120, cwd=REPO,
                             env={**os.environ, **env})
        assert out.returncode == 0 and "triton" not in out.stderr, out
    # asked for by name it names the fix; on CUDA the default falls back to torch's attention with a warning
    monkeypatch.setitem(sys.modules, "triton", None)
    with pytest.raises(ValueError, match=r"attention_backend 'triton' is unavailable: triton is not installed "
                                         r"\(pip install triton\)"):
        attention_backend("triton", torch.device("cpu"), 64)
    assert attention_backend("auto", torch.device("cuda"), 64) is None
    assert "triton attention unavailable (triton is not installed (pip install triton)); using the torch " \
           "implementation" in caplog.text

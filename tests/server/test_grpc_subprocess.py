"""`pagoda serve` started the way a user starts it (the console script, in a subprocess), driven by
the `pagoda` CLI, by buf curl through reflection alone, and by a Node.js @grpc/grpc-js client that
loads the .proto; then SIGTERM draining of the no-argument (demo model) server."""
import json
import signal
import subprocess
import time

import grpc
import pytest

from pagoda.client.client import Client, collect
from grpc_fixtures import BUF, NODE_DIR, REPO, ServeProcess, pagoda_command, require_node_modules, tiny_checkpoint
from pagoda.v1 import generation_pb2 as pb

pytestmark = pytest.mark.timeout(240)

GREEDY = {"text": "Hello", "sampling": {"temperature": 0}, "stopping": {"max_tokens": 12, "ignore_eos": True}}


@pytest.fixture(scope="module")
def served():
    # Some settings as flags, some as PAGODA_* environment variables, as a user might.
    proc = ServeProcess("--model", tiny_checkpoint(), "--dtype", "float32", "--device", "cpu",
                        env={"PAGODA_NUM_KV_BLOCKS": "96", "PAGODA_MAX_MODEL_LEN": "384",
                             "PAGODA_BLOCK_SIZE": "16", "PAGODA_MAX_NUM_SEQS": "8"})
    try:
        yield proc.wait_ready()
    finally:
        proc.proc.send_signal(signal.SIGTERM)
        try:
            proc.proc.wait(30)
        finally:
            proc.kill()


@pytest.fixture(scope="module")
def unary_greedy(served):
    with Client(served.target, timeout=60) as c:
        try:
            return c.generate("Hello", temperature=0, max_tokens=12, ignore_eos=True)
        except grpc.RpcError as e:
            pytest.fail(f"{e.code().name}: {e.details()}\nserver log:\n{served.output()}")


def pagoda(*args, input=None, timeout=120):
    return subprocess.run(pagoda_command() + list(args), input=input, capture_output=True, text=True,
                          timeout=timeout, cwd=str(REPO))


def test_env_and_flags_reach_the_engine(served):
    with Client(served.target, timeout=30) as c:
        info = c.model_info()
    assert info.num_kv_blocks == 96 and info.context_length == 384 and info.limits.max_num_seqs == 8
    assert info.dtype == "float32"


def test_cli_generate_stream_and_unary(served, unary_greedy):
    flags = ["--target", served.target, "--temperature", "0", "--max-tokens", "12", "--ignore-eos"]
    streamed = pagoda("generate", "Hello", "--stream", *flags)
    assert streamed.returncode == 0, streamed.stderr
    unary = pagoda("generate", "Hello", *flags, "-v")
    assert unary.returncode == 0, unary.stderr
    assert streamed.stdout == unary.stdout == unary_greedy.text + "\n"
    assert "FINISH_REASON_LENGTH" in unary.stderr and "completion 12" in unary.stderr
    as_json = pagoda("generate", "Hello", "--json", *flags)
    assert json.loads(as_json.stdout)["choices"][0]["token_ids"] == list(unary_greedy.token_ids)


def test_cli_tokenize_info_stats(served):
    out = pagoda("tokenize", "Hi", "--target", served.target)
    assert out.returncode == 0 and out.stdout.split() == ["72", "105"]
    info = json.loads(pagoda("info", "--target", served.target).stdout)
    assert info["architecture"] == "LlamaForCausalLM" and info["context_length"] == 384
    stats = json.loads(pagoda("stats", "--target", served.target).stdout)
    assert stats["kv_blocks_total"] == 96 and "uptime_seconds" in stats


def test_cli_chat_keeps_the_conversation(served):
    out = pagoda("chat", "--target", served.target, "--temperature", "0", "--max-tokens", "5", "--ignore-eos",
                 input="hi\nand again\n\n")
    assert out.returncode == 0, out.stderr
    with Client(served.target, timeout=30) as c:
        first = c.generate(messages=[("user", "hi")], temperature=0, max_tokens=5, ignore_eos=True).text
        second = c.generate(messages=[("user", "hi"), ("assistant", first), ("user", "and again")],
                            temperature=0, max_tokens=5, ignore_eos=True).text
    assert out.stdout == f"{first}\n{second}\n"


def test_cli_error_exit_status(served):
    # the server judges what depends on it (exit 1); the CLI refuses what it can check itself (exit 2)
    out = pagoda("generate", "Hello", "--max-tokens", "100000", "--target", served.target)
    assert out.returncode == 1
    assert "INVALID_ARGUMENT" in out.stderr and "stopping.max_tokens" in out.stderr
    out = pagoda("generate", "Hello", "--top-p", "1.5", "--target", served.target)
    assert out.returncode == 2 and "--top-p" in out.stderr


# ---- clients nobody here wrote ----

def buf_curl(target, *args, data=None):
    require_node_modules()
    cmd = [str(BUF), "curl", "--protocol", "grpc", "--http2-prior-knowledge", *args]
    if data is not None:
        cmd += ["--data", json.dumps(data)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=str(NODE_DIR))


def json_stream(text):
    """The JSON objects buf curl prints one after another."""
    dec, i, out = json.JSONDecoder(), 0, []
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text):
            return out
        obj, i = dec.raw_decode(text, i)
        out.append(obj)


def test_buf_curl_lists_services_by_reflection(served):
    out = buf_curl(served.target, "--list-services", f"http://{served.target}")
    assert out.returncode == 0, out.stderr
    services = set(out.stdout.split())
    assert {"pagoda.v1.GenerationService", "grpc.health.v1.Health"} <= services
    out = buf_curl(served.target, "--list-methods", f"http://{served.target}")
    assert "pagoda.v1.GenerationService/GenerateStream" in out.stdout


REFLECTION_SERVICES = {"pagoda.v1.GenerationService", "grpc.health.v1.Health",
                       "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"}


@pytest.mark.parametrize("protocol", ["grpc-v1", "grpc-v1alpha"])
def test_buf_curl_reflection_protocols(served, protocol):
    """Both reflection services answer, and each lists (and can describe) both."""
    out = buf_curl(served.target, "--reflect-protocol", protocol, "--list-services", f"http://{served.target}")
    assert out.returncode == 0, out.stderr
    assert REFLECTION_SERVICES <= set(out.stdout.split())
    # --list-methods resolves every listed service's descriptor through the same protocol
    out = buf_curl(served.target, "--reflect-protocol", protocol, "--list-methods", f"http://{served.target}")
    assert out.returncode == 0, out.stderr
    methods = set(out.stdout.split())
    assert {"grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            "grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
            "pagoda.v1.GenerationService/Generate"} <= methods
    # a call whose schema comes from this reflection protocol alone
    out = buf_curl(served.target, "--reflect-protocol", protocol,
                   f"http://{served.target}/pagoda.v1.GenerationService/Tokenize", data={"text": "Hi"})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["tokenIds"][-2:] == [72, 105]


def test_buf_curl_health(served):
    for service in ("", "pagoda.v1.GenerationService"):
        out = buf_curl(served.target, f"http://{served.target}/grpc.health.v1.Health/Check",
                       data={"service": service})
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == {"status": "SERVING"}


def test_buf_curl_generate_stream(served, unary_greedy):
    out = buf_curl(served.target, f"http://{served.target}/pagoda.v1.GenerationService/GenerateStream",
                   data=GREEDY)
    assert out.returncode == 0, out.stderr
    msgs = json_stream(out.stdout)  # protojson: lowerCamelCase names, uint32 as numbers
    assert msgs  # a short stream may come as one message: deltas a slow reader missed are merged
    assert "".join(m.get("text", "") for m in msgs) == unary_greedy.text
    assert [t for m in msgs for t in m.get("tokenIds", [])] == list(unary_greedy.token_ids)
    assert msgs[-1]["finishReason"] == "FINISH_REASON_LENGTH"
    assert msgs[-1]["usage"]["completionTokens"] == 12


def test_buf_curl_error_status(served):
    out = buf_curl(served.target, f"http://{served.target}/pagoda.v1.GenerationService/Generate",
                   data={"text": "Hello", "sampling": {"topP": 1.5}})
    assert out.returncode != 0
    assert "invalid_argument" in out.stderr.lower() and "sampling.top_p" in out.stderr


def test_node_client_streams_a_generation(served, unary_greedy):
    require_node_modules()
    out = subprocess.run(["node", str(NODE_DIR / "stream.js"), served.target, json.dumps(GREEDY)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    msgs = [json.loads(line) for line in out.stdout.splitlines()]
    assert msgs  # a short stream may come as one message: deltas a slow reader missed are merged
    assert "".join(m.get("text", "") for m in msgs) == unary_greedy.text
    assert [t for m in msgs for t in m.get("token_ids", [])] == list(unary_greedy.token_ids)
    assert msgs[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
    assert msgs[-1]["usage"]["completion_tokens"] == 12


def test_node_client_sees_status_codes(served):
    require_node_modules()
    bad = {"text": "", "stopping": {"max_tokens": 4}}
    out = subprocess.run(["node", str(NODE_DIR / "stream.js"), served.target, json.dumps(bad)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "INVALID_ARGUMENT" in out.stderr and "text" in out.stderr


# ---- the README path: `pagoda serve` with no model (the demo), then SIGTERM ----

def test_demo_server_drains_on_sigterm(tmp_path):
    env = {"PAGODA_CACHE": str(tmp_path / "cache"), "PAGODA_NUM_KV_BLOCKS": "256", "PAGODA_DEVICE": "cpu",
           "PAGODA_GRACE_PERIOD": "60"}
    proc = ServeProcess("--engine-process", "on", env=env).wait_ready(timeout=180)
    try:
        with Client(proc.target, timeout=60) as c:
            out = pagoda("generate", "Hello", "--stream", "--max-tokens", "8", "--target", proc.target)
            assert out.returncode == 0 and out.stdout.endswith("\n"), out.stderr

            inflight = c.generate_stream("Hello", max_tokens=60, ignore_eos=True)
            first = next(inflight)
            proc.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while c.health() != "NOT_SERVING":
                assert time.monotonic() < deadline, "health never went NOT_SERVING"
                time.sleep(0.01)
            with pytest.raises(grpc.RpcError) as e:
                c.generate("Hello", max_tokens=2)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            rest = collect([first, *inflight])
            assert rest.finish_reason == pb.FINISH_REASON_LENGTH and len(rest.token_ids) == 60
        assert proc.proc.wait(60) == 0, proc.output()
        assert "draining" in proc.output()
    finally:
        proc.kill()

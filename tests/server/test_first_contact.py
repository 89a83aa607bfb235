"""A first `pagoda serve`, as a vLLM user starts it: the model as the positional MODEL, --port clashing
with --http-port said before anything binds, --chat-template for every door, --kv-cache-memory as a
size or a fraction (and --gpu-memory-utilization accepted), help naming both doors, the start-up told
line by line up to one naming both ports, a request over --max-message-bytes refused by name, and a
second Ctrl-C that quits at once."""
import logging
import signal
import time

import grpc
import httpx
import pytest

from grpc_fixtures import InProcessServer, ServeProcess, engine_config, tiny_checkpoint
from pagoda.client.cli import build_parser, main
from pagoda.client.client import Client
from pagoda.engine import LLM, EngineConfig
from pagoda.server.main import engine_config as serve_engine_config
from pagoda.server.options import ServerOptions

pytestmark = pytest.mark.timeout(300)
TEMPLATE = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}"


@pytest.fixture(autouse=True)
def no_pagoda_env(monkeypatch):
    import os

    for name in [n for n in os.environ if n.startswith("PAGODA_")]:
        monkeypatch.delenv(name)


def usage_error(capsys, *argv) -> str:
    """`pagoda serve ARGV`'s usage error line (exit 2, after the usage), before anything binds or loads."""
    with pytest.raises(SystemExit) as e:
        main(["serve", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[0].startswith("usage: pagoda serve"), err
    return err[-1]


def serve_args(*argv):
    return build_parser().parse_args(["serve", *argv])


# ---- the model as MODEL ----

def test_the_model_as_a_positional_argument(capsys, monkeypatch):
    assert serve_engine_config(serve_args("some/model")).model == "some/model"
    assert serve_engine_config(serve_args("some/model", "--model", "some/model")).model == "some/model"
    assert serve_engine_config(serve_args("--model", "other")).model == "other"
    assert serve_engine_config(serve_args()).model is None
    monkeypatch.setenv("PAGODA_MODEL", "from/env")  # a default: MODEL overrides it
    assert serve_engine_config(serve_args("some/model")).model == "some/model"
    monkeypatch.delenv("PAGODA_MODEL")
    line = usage_error(capsys, "some/model", "--model", "other")
    assert line == ("pagoda serve: error: MODEL 'some/model' and --model 'other' name different models: give one "
                    "of them")


# ---- ports ----

def test_the_grpc_port_on_the_http_default_is_said_before_binding(capsys):
    assert usage_error(capsys, "--port", "8000") == (
        "pagoda serve: error: --port 8000 (gRPC) and --http-port 8000 (HTTP, OpenAI API) are the same port: pagoda "
        "serves gRPC on --port and HTTP on --http-port; give them different ports (vLLM's --port is pagoda's "
        "--http-port, default 8000)")
    line = usage_error(capsys, "--http-port", "9100", "--metrics-port", "9100")
    assert "--http-port 9100 (HTTP, OpenAI API) and --metrics-port 9100 (Prometheus metrics) are the same" in line


def test_ports_that_do_not_clash():
    from pagoda.server.ports import same_port

    assert same_port([("--port", "[::]", 8000), ("--http-port", "[::]", None)]) is None  # HTTP off
    assert same_port([("--port", "[::]", 0), ("--http-port", "[::]", 0)]) is None  # any free ones
    assert same_port([("--http-port", "127.0.0.1", 9000), ("--metrics-port", "10.0.0.1", 9000)]) is None
    assert same_port([("--http-port", "127.0.0.1", 9000), ("--metrics-port", "0.0.0.0", 9000)])


# ---- help ----

def test_help_names_both_doors_and_their_ports(capsys):
    for argv in (["--help"], ["serve", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        text = " ".join(capsys.readouterr().out.split())
        assert "gRPC" in text and "HTTP (OpenAI API" in text and "50051" in text and "8000" in text, text
        assert "[MODEL]" in text


# ---- the KV cache's memory ----

@pytest.mark.parametrize("text,want", [("4GiB", 4 << 30), ("512MB", 512_000_000), ("2e9", 2_000_000_000),
                                       ("1073741824", 1 << 30), ("0.3", 0.3), ("1.5 GiB", 3 << 29)])
def test_kv_cache_memory_as_a_size_or_a_fraction(text, want):
    got = serve_engine_config(serve_args("--kv-cache-memory", text)).kv_cache_memory
    assert got == want and type(got) is type(want)
    assert EngineConfig(kv_cache_memory=text).kv_cache_memory == want


@pytest.mark.parametrize("flag,value", [("--kv-cache-memory", "lots"), ("--kv-cache-memory", "0"),
                                        ("--kv-cache-memory", "-1GiB"), ("--kv-cache-memory", "1"),
                                        ("--kv-cache-memory", "1.5"), ("--kv-cache-memory", "4XB"),
                                        ("--gpu-memory-utilization", "1.5"), ("--gpu-memory-utilization", "x"),
                                        ("--chat-template", "no/such/file.jinja"),
                                        ("--chat-template", "{% for m in messages %}")])
def test_a_bad_memory_or_template_flag_is_one_line_naming_it(capsys, flag, value):
    line = usage_error(capsys, flag, value)
    assert line.startswith(f"pagoda serve: error: argument {flag}: ") and len(line.splitlines()) == 1, line


def test_kv_cache_memory_sizes_the_cache(monkeypatch, caplog):
    from pagoda.engine.core import engine_core

    monkeypatch.setattr(engine_core, "free_memory", lambda device: 64 << 20)  # what is free: 64 MiB
    by_size = LLM(tiny_checkpoint(), dtype="float32", kv_cache_memory="8MiB").engine.config.num_kv_blocks
    with caplog.at_level(logging.INFO, logger="pagoda.engine"):
        by_fraction = LLM(tiny_checkpoint(), dtype="float32", kv_cache_memory=0.5,
                          gpu_memory_utilization=0.5).engine.config.num_kv_blocks
    assert by_fraction == 4 * by_size > 0  # half of 64 MiB: 32 MiB
    assert "gpu_memory_utilization ignored: kv_cache_memory sizes the KV cache" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagoda.engine"):
        LLM(tiny_checkpoint(), dtype="float32", num_kv_blocks=8, gpu_memory_utilization=0.5)
    assert "gpu_memory_utilization ignored" not in caplog.text  # num_kv_blocks: no budget at all
    with caplog.at_level(logging.INFO, logger="pagoda.engine"):
        LLM(tiny_checkpoint(), dtype="float32", kv_cache_memory="8MiB", gpu_memory_utilization=0.5)
    assert "gpu_memory_utilization ignored" in caplog.text


def test_free_memory_on_cpu_is_what_is_available_within_the_cgroup(tmp_path):
    import torch

    from pagoda.engine.loader import free_memory

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:  1000 kB\nMemAvailable:    8000000 kB\n")
    cpu = torch.device("cpu")
    assert free_memory(cpu, str(meminfo), str(tmp_path / "none")) == 8_000_000 * 1024
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text(f"{1 << 30}\n")
    assert free_memory(cpu, str(meminfo), str(tmp_path)) == 8_000_000 * 1024
    (tmp_path / "memory.max").write_text(f"{3 << 30}\n")  # a container's limit, 1 GiB of it used
    assert free_memory(cpu, str(meminfo), str(tmp_path)) == 2 << 30


# ---- the chat template, and a request over --max-message-bytes ----

@pytest.fixture(scope="module")
def templated():
    config = engine_config(tiny_checkpoint(), num_kv_blocks=64, chat_template=TEMPLATE)
    server = InProcessServer.for_config(config, ServerOptions(http_port=0, max_message_bytes=1 << 20)).wait_ready()
    yield server
    server.stop()


def test_the_chat_template_flag_reads_a_file_or_takes_the_text(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert serve_engine_config(serve_args("--chat-template", str(path))).chat_template == TEMPLATE
    assert serve_engine_config(serve_args("--chat-template", TEMPLATE)).chat_template == TEMPLATE
    assert serve_engine_config(serve_args()).chat_template is None
    with pytest.raises(ValueError, match="chat_template does not compile"):
        EngineConfig(chat_template="{% if %}")


def test_every_door_renders_the_chat_template(templated):
    tokenizer = templated.engine.tokenizer
    want = tokenizer.encode("<<be brief>><<hi>>", add_special_tokens=False)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = httpx.post(templated.http_url + "/tokenize", json={"messages": messages}, timeout=60)
    assert r.status_code == 200 and r.json()["tokens"] == want, r.text
    chat = httpx.post(templated.http_url + "/v1/chat/completions", timeout=60, json={
        "messages": messages, "max_tokens": 1, "ignore_eos": True})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(want), chat.text
    with Client(templated.target, timeout=60) as c:
        out = c.generate(messages=messages, max_tokens=1, ignore_eos=True, echo=True)
    assert list(out.prompt_token_ids) == want


def test_a_request_over_max_message_bytes_names_the_flag(templated):
    with Client(templated.target, timeout=60) as c:
        for fn in (c.generate, c.generate_stream):
            with pytest.raises(grpc.RpcError) as e:
                r = fn("x" * 5_000_000, max_tokens=2)
                list(r) if fn == c.generate_stream else r
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert e.value.details().startswith("the request is 50000") and "--max-message-bytes (1048576)" in \
                e.value.details(), e.value.details()
        assert c.generate("x" * 100, max_tokens=2, ignore_eos=True).usage.completion_tokens == 2  # under it: served
        assert c.health() == "SERVING"


# ---- start-up and Ctrl-C ----

def test_startup_is_told_and_a_second_ctrl_c_quits_now(tmp_path):
    # one sequence at a time: the call below holds 64 x 500 decode steps, far more than the test takes
    proc = ServeProcess(tiny_checkpoint(), "--dtype", "float32", "--device", "cpu", "--grace-period", "600",
                        "--max-num-seqs", "1")
    try:
        proc.wait_ready()
        log = proc.output()
        for what in ("loading " + tiny_checkpoint(), "reading the weights: 1 safetensors file",
                     "loaded config and tokenizer", "LlamaForCausalLM", "loaded KV cache", "blocks of 16 tokens"):
            assert what in log, (what, log)
        serving = [line for line in proc.log if "serving " in line]
        assert serving[-1].rstrip().endswith(f": gRPC on 127.0.0.1:{proc.port}, HTTP (OpenAI API) on "
                                             f"127.0.0.1:{proc.http_port}"), serving
        with Client(proc.target, timeout=120) as c:
            stream = c.generate_stream("Hello", max_tokens=500, ignore_eos=True, n=64)
            next(stream)
            proc.proc.send_signal(signal.SIGINT)
            deadline = time.monotonic() + 60
            while "press Ctrl-C again to quit now" not in proc.output():
                assert time.monotonic() < deadline and proc.proc.poll() is None, proc.output()
                time.sleep(0.02)
            proc.proc.send_signal(signal.SIGINT)
            assert proc.proc.wait(60) == 1, proc.output()
        assert "Ctrl-C again: quitting now" in proc.output()
    finally:
        proc.kill()


def test_weight_files_are_read_with_progress_lines(tmp_path, caplog, monkeypatch):
    from pagoda.engine import loader

    files = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    for f in files:
        f.write_bytes(b"0" * 1000)
    with caplog.at_level(logging.INFO, logger="pagoda.engine"):
        progress = loader._Progress([str(f) for f in files])
        progress.file(0, str(files[0]))
        progress.file(1, str(files[1]))
    assert [r.getMessage() for r in caplog.records] == [
        "reading the weights: 2 safetensors files, 0.00 GiB", "weights: file 1 of 2 read (a.safetensors)",
        "weights: file 2 of 2 read (b.safetensors)"]
    import torch

    caplog.clear()
    monkeypatch.setattr(loader, "PROGRESS_BYTES", 4000)
    with caplog.at_level(logging.INFO, logger="pagoda.engine"):
        progress = loader._Progress([str(files[0])])
        for _ in range(4):
            progress.tensor(torch.zeros(500))  # 2000 bytes each: a line every second one
        progress.file(0, str(files[0]))
    assert len([r for r in caplog.records if "GiB read" in r.getMessage()]) == 2

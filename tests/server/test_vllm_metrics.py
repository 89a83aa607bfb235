"""The Gateway API Inference Extension's model-server protocol: the vLLM-named gauges its endpoint picker
reads, scraped by name and labels while requests run, their values checked against GET /stats; and
--metrics-compat none turning them off."""
from __future__ import annotations

import json
import time
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from grpc_fixtures import slow_steps, tiny_checkpoint
from hardening_fixtures import running, wait_all_blocks_free
from oracle import make_adapter
from pagoda.client.client import Client
from pagoda.server.metrics import Metrics
from pagoda.server.options import ServerOptions
from pagoda.server.state import ServerState

pytestmark = pytest.mark.timeout(120)


def scrape(port: int) -> dict:
    """{name: [(labels, value), ...]} of the vllm: samples at http://127.0.0.1:port/metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("vllm:"):
                out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def get_stats(srv) -> dict:
    with urllib.request.urlopen(f"{srv.http_url}/stats", timeout=10) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    base = tiny_checkpoint()
    adapter = make_adapter(base, str(tmp_path_factory.mktemp("lora") / "one"), seed=3)
    # one seat: a second request waits while the first runs
    with running(ServerOptions(metrics_port=-1, metrics_host="127.0.0.1", http_port=0), model=base,
                 num_kv_blocks=32, max_num_seqs=1, lora_modules={"one": adapter}, max_loras=2) as s:
        yield s


def test_picker_gauges_while_requests_run(srv):
    port = srv.server.metrics_port
    with Client(srv.target, timeout=60) as c, slow_steps(srv.engine, 0.03):
        first = c.generate_stream("Hello there", max_tokens=200, ignore_eos=True, adapter="one")
        next(first)
        second = c.generate_stream("Waiting", max_tokens=5, ignore_eos=True)
        for _ in range(200):  # the snapshot after a step that saw both; /stats equal on both sides of the scrape
            before, m, after = get_stats(srv), scrape(port), get_stats(srv)
            if before["num_waiting"] == 1 and before["kv_blocks_used"] == after["kv_blocks_used"] and \
                    before["num_running"] == after["num_running"] and before["num_waiting"] == after["num_waiting"]:
                break
            time.sleep(0.01)
        first.cancel()
        list(second)
        wait_all_blocks_free(c)
    labels = {"model_name": srv.server.state.served_model_names()[0], "engine": "0"}
    assert m["vllm:num_requests_running"] == [(labels, before["num_running"])] and before["num_running"] == 1
    assert m["vllm:num_requests_waiting"] == [(labels, before["num_waiting"])]
    usage = before["kv_blocks_used"] / before["kv_blocks_total"]
    assert m["vllm:kv_cache_usage_perc"] == [(labels, pytest.approx(usage))] and 0 < usage < 1

    [(lora, stamp)] = m["vllm:lora_requests_info"]
    assert lora == {"max_lora": "2", "running_lora_adapters": "one", "waiting_lora_adapters": ""}
    assert abs(stamp - time.time()) < 60  # a timestamp, as vLLM's

    [(cache, one)] = m["vllm:cache_config_info"]
    assert one == 1.0 and cache["block_size"] == "16" and cache["num_gpu_blocks"] == str(before["kv_blocks_total"])
    assert cache["enable_prefix_caching"] == "True" and cache["prefix_caching_hash_algo"] == "sha256_cbor"
    assert {"cache_dtype", "num_cpu_blocks", "gpu_memory_utilization", "sliding_window", "engine"} <= set(cache)


def test_idle_gauges_and_off_switch(srv):
    m = scrape(srv.server.metrics_port)
    assert m["vllm:num_requests_running"][0][1] == 0 and m["vllm:kv_cache_usage_perc"][0][1] == 0
    assert m["vllm:lora_requests_info"][0][0]["running_lora_adapters"] == ""
    off = ServerState(ServerOptions(metrics_compat="none"))
    off.engine = srv.engine
    text = generate_latest(Metrics(off).registry).decode()
    assert "vllm:" not in text and "pagoda_kv_blocks_total" in text
    with pytest.raises(ValueError, match="metrics_compat"):
        ServerOptions(metrics_compat="sglang")

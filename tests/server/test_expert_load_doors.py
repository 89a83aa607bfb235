"""A mixture of experts' load on every door: GetStats, GET /stats and the Prometheus scrape carry the same tokens
per (layer, expert), top_k for each token run through each MoE layer."""
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import FAMILIES
from grpc_fixtures import InProcessServer
from pagoda.client.client import Client
from pagoda.engine import EngineConfig
from pagoda.server.options import ServerOptions

pytestmark = pytest.mark.timeout(120)


def scraped_load(port: int) -> dict[int, list[int]]:
    """layer -> tokens per expert, from pagoda_moe_expert_tokens_total{layer, expert}."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    found: dict[int, dict[int, int]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "pagoda_moe_expert_tokens_total":
                found.setdefault(int(s.labels["layer"]), {})[int(s.labels["expert"])] = int(s.value)
    return {layer: [e[i] for i in range(len(e))] for layer, e in found.items()}


def test_grpc_http_and_prometheus_carry_the_expert_load(checkpoint):
    path = checkpoint("qwen3_moe")
    srv = InProcessServer.for_config(EngineConfig(dtype="float32", model=path, num_kv_blocks=64),
                                     ServerOptions(http_port=0, metrics_port=-1, metrics_host="127.0.0.1")).wait_ready()
    try:
        with Client(srv.target, timeout=60) as c:
            before = c.stats().expert_load
            out = c.generate("Hello there, experts", temperature=0, max_tokens=5, ignore_eos=True)
            grpc = {g.layer: list(g.tokens) for g in c.stats().expert_load}
        http = {g["layer"]: g["tokens"] for g in httpx.get(srv.http_url + "/stats", timeout=10).json()["expert_load"]}
        assert [(g.layer, sum(g.tokens)) for g in before] == [(1, 0)]  # layer 0 is dense (mlp_only_layers)
        ran = out.usage.prompt_tokens + out.usage.completion_tokens - 1
        assert list(grpc) == [1] and sum(grpc[1]) == FAMILIES["qwen3_moe"]["num_experts_per_tok"] * ran
        assert len(grpc[1]) == 8 and http == grpc == scraped_load(srv.server.metrics_port)
    finally:
        srv.stop()

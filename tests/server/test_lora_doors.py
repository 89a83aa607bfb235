"""LoRA adapters through the doors: HTTP ("model": the adapter's name; GET /v1/models lists each with
its base as parent) and gRPC (GenerateRequest.adapter, GetModelInfo.adapters), token-identical to
transformers + PEFT; unknown names are 404 model_not_found / NOT_FOUND naming them; adapters loaded
and unloaded at run time (unloading under load loses no request); per-adapter stats and metrics."""
import concurrent.futures
import random
import time

import grpc
import httpx
import openai
import pytest

from grpc_fixtures import InProcessServer, openai_client, wait_all_blocks_free
from pagoda.client.client import Client
from pagoda.engine import EngineConfig
from pagoda.server.options import ServerOptions
from oracle import greedy, make_adapter

pytestmark = pytest.mark.timeout(300)
MAX_NEW = 10


@pytest.fixture(scope="module")
def setup(checkpoint, tmp_path_factory):
    base = checkpoint("llama")
    root = tmp_path_factory.mktemp("lora-doors")
    paths = {"one": make_adapter(base, str(root / "one"), 11), "two": make_adapter(base, str(root / "two"), 12, r=4),
             "late": make_adapter(base, str(root / "late"), 13)}
    config = EngineConfig(model=base, dtype="float32", num_kv_blocks=64, lora_modules={"one": paths["one"], "two": paths["two"]},
                          max_loras=2, allow_lora_loading=True)
    srv = InProcessServer.for_config(config, ServerOptions(http_port=0)).wait_ready()
    yield base, paths, srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(setup):
    return openai_client(setup[2])


@pytest.fixture(scope="module")
def client(setup):
    with Client(setup[2].target, timeout=60) as c:
        yield c


def _prompts(n=3, seed=5):
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(k)] for k in (4, 19, 37)][:n]


def test_both_doors_match_peft_per_adapter_and_mixed(setup, oai, client):
    base, paths, srv = setup
    model = srv.engine.model_info.model_id
    prompts = _prompts()
    cases = [(None, p) for p in prompts] + [(a, p) for a in ("one", "two") for p in prompts]
    # all at once over gRPC: one batch mixing both adapters and the base
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        grpc_outs = list(pool.map(lambda c: client.generate(c[1], max_tokens=MAX_NEW, temperature=0, adapter=c[0]),
                                  cases))
        http_outs = list(pool.map(lambda c: oai.completions.create(
            model=c[0] or model, prompt=c[1], max_tokens=MAX_NEW, temperature=0,
            extra_body={"return_token_ids": True}), cases))
    for (adapter, p), g, h in zip(cases, grpc_outs, http_outs):
        want = greedy(base, [p], MAX_NEW, paths.get(adapter))[0]
        assert list(g.token_ids) == want, adapter
        assert h.choices[0].model_extra["token_ids"] == want and h.choices[0].text == g.text
        assert h.model == (adapter or model)
    chat = oai.chat.completions.create(model="one", messages=[{"role": "user", "content": "héllo"}],
                                       max_tokens=MAX_NEW, temperature=0)
    over_grpc = client.generate(messages=[("user", "héllo")], max_tokens=MAX_NEW, temperature=0, adapter="one")
    assert chat.choices[0].message.content == over_grpc.text and chat.model == "one"
    resp = oai.responses.create(model="one", input="héllo", max_output_tokens=MAX_NEW, temperature=0)
    assert resp.output_text == over_grpc.text and resp.model == "one"
    plain = client.generate(messages=[("user", "héllo")], max_tokens=MAX_NEW, temperature=0)
    assert plain.text != over_grpc.text
    wait_all_blocks_free(client)


def test_models_lists_adapters_with_parent_and_info(setup, oai, client):
    base, paths, srv = setup
    model = srv.engine.model_info.model_id
    cards = {m.id: m for m in oai.models.list().data}
    assert cards[model].model_extra.get("parent") is None
    for name in ("one", "two"):
        assert cards[name].model_extra["parent"] == model and cards[name].model_extra["root"] == paths[name]
    assert oai.models.retrieve("one").model_extra["parent"] == model
    info = client.model_info()
    assert [(a.name, a.path, a.rank, a.parent) for a in info.adapters] == [
        ("one", paths["one"], 8, model), ("two", paths["two"], 4, model)]
    assert (info.limits.max_loras, info.limits.max_lora_rank) == (2, 16)


def test_unknown_model_is_not_found_naming_it(setup, oai, client):
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert e.value.code == "model_not_found" and "'nope'" in e.value.message and "'one'" in e.value.message
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(grpc.RpcError) as e:
        client.generate("hi", max_tokens=2, adapter="nope")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        client.load_lora_adapter("bad", "/nonexistent")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no adapter_config.json" in e.value.details()
    r = httpx.post(setup[2].http_url + "/v1/load_lora_adapter", json={"lora_name": "one", "lora_path": "/x"})
    assert r.status_code == 400 and "already loaded" in r.json()["error"]["message"]


def test_stats_and_metrics_per_adapter(setup, client):
    client.generate([5, 6, 7], max_tokens=3, temperature=0, ignore_eos=True, adapter="two")
    stats = client.stats()
    assert stats.adapter_requests["two"] >= 1 and stats.adapter_generated_tokens["two"] >= 3
    text = httpx.get(setup[2].http_url + "/metrics").text
    assert 'pagoda_lora_requests_total{adapter="two"}' in text
    assert 'pagoda_lora_generation_tokens_total{adapter="two"}' in text


def test_load_and_unload_under_load_lose_no_request(setup, oai, client):
    base, paths, srv = setup
    r = httpx.post(srv.http_url + "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": paths["late"]},
                   timeout=60)
    assert r.status_code == 200, r.text
    prompt = _prompts(1)[0]
    want = greedy(base, [prompt], MAX_NEW, paths["late"])[0]
    assert list(client.generate(prompt, max_tokens=MAX_NEW, temperature=0, adapter="late").token_ids) == want
    # requests for three adapters in flight (two slots: some wait for one), then unload one of them
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        jobs = [pool.submit(client.generate, prompt, max_tokens=24, temperature=0, ignore_eos=True, adapter=a)
                for a in ["late", "one", "two"] * 3]
        deadline = time.monotonic() + 30
        while srv.engine.stats().adapter_requests.get("late", 0) < 4:  # the three are in the engine
            assert time.monotonic() < deadline
            time.sleep(0.005)
        client.unload_lora_adapter("late")  # returns once they have finished
        core = srv.engine._transport.core
        assert not any(s.adapter == "late" for group in list(core.requests.values()) for s in group)
        outs = [j.result() for j in jobs]
    assert all(len(o.token_ids) == 24 for o in outs)
    assert list(outs[0].token_ids[:len(want)]) == want  # the adapter applied to the end
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="late", prompt="hi", max_tokens=2)
    assert "late" not in {m.id for m in oai.models.list().data}
    r = httpx.post(srv.http_url + "/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    wait_all_blocks_free(client)
    assert all(u == 0 for u in core.adapters.slots.users)


def test_runtime_loading_is_off_by_default(checkpoint):
    srv = InProcessServer.for_config(EngineConfig(model=checkpoint("llama"), dtype="float32", num_kv_blocks=16),
                                     ServerOptions(http_port=0)).wait_ready()
    try:
        r = httpx.post(srv.http_url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"})
        assert r.status_code == 403 and "--allow-lora-loading" in r.json()["error"]["message"]
        with Client(srv.target, timeout=30) as c:
            with pytest.raises(grpc.RpcError) as e:
                c.unload_lora_adapter("x")
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(grpc.RpcError) as e:
                c.generate("hi", max_tokens=2, adapter="x")
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        srv.stop()

"""The dtype `auto` resolves to: bfloat16 on a CPU with native bf16, float32 elsewhere and in
deterministic mode; the engine reports what it chose."""
import pytest
import torch

from grpc_fixtures import InProcessServer, openai_client, tiny_checkpoint
from pagoda.client.client import Client
from pagoda.engine import LLM, EngineConfig, SamplingParams
from pagoda.engine.loader import dtype_of, native_bf16

CPU = torch.device("cpu")


def _cpu_with(monkeypatch, avx512_bf16: bool, amx: bool) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)


@pytest.mark.parametrize("avx512_bf16,amx,want", [(True, False, torch.bfloat16), (False, True, torch.bfloat16),
                                                  (True, True, torch.bfloat16), (False, False, torch.float32)])
def test_auto_on_cpu_is_bfloat16_where_the_cpu_has_native_bf16(monkeypatch, avx512_bf16, amx, want):
    _cpu_with(monkeypatch, avx512_bf16, amx)
    assert native_bf16() == (want == torch.bfloat16)
    assert dtype_of("auto", None, CPU) == want
    assert dtype_of("auto", None, CPU, deterministic=True) == torch.float32  # the same output on every machine
    for name, dtype in [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)]:
        assert dtype_of(name, None, CPU) == dtype  # asked for: taken as asked


@pytest.mark.parametrize("native,want", [(True, "bfloat16"), (False, "float32")])
def test_engine_reports_the_dtype_auto_chose(monkeypatch, checkpoint, native, want):
    _cpu_with(monkeypatch, native, False)
    llm = LLM(checkpoint("llama"), num_kv_blocks=16, device="cpu")
    assert llm.engine.config.dtype == llm.engine.model_info().dtype == want
    assert {p.dtype for p in llm.engine.model.parameters()} == {getattr(torch, want)}
    assert llm.engine.runner.kv_cache.dtype == getattr(torch, want)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_doors_report_the_dtype_auto_chose(monkeypatch):
    from pagoda.server.options import ServerOptions
    _cpu_with(monkeypatch, True, False)
    config = EngineConfig(model=tiny_checkpoint(), device="cpu", num_kv_blocks=32)
    srv = InProcessServer.for_config(config, ServerOptions(http_port=0)).wait_ready()
    try:
        with Client(srv.target, timeout=60) as c:
            assert c.model_info().dtype == "bfloat16"
        assert openai_client(srv).models.list().data[0].model_extra["dtype"] == "bfloat16"
    finally:
        srv.stop()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_model_is_built_on_meta_and_loads_as_one_initialised_would(tmp_path, dtype):
    """The model is built on the meta device and given memory uninitialised (model_runner._load_model): what it
    holds once loaded is what a model initialised on the CPU holds after the same load, buffers (rotary tables)
    included, and a tied LM head is still the embedding's weight."""
    from pagoda.engine.demo import build_tiny_checkpoint
    from pagoda.engine.executor.model_runner import _load_model
    from pagoda.engine.loader import load_hf_config, load_weights
    from pagoda.engine.models import build_model

    path = build_tiny_checkpoint(str(tmp_path / "m"), "qwen2", tie_word_embeddings=True)
    cfg = load_hf_config(path)
    got = _load_model(cfg, path, 0, dtype, CPU, None)
    with torch.device("cpu"):
        want = build_model(cfg).to(dtype)
    load_weights(want, path)
    assert got.lm_head.weight is got.embed_tokens.weight
    tensors = dict(got.named_parameters()) | dict(got.named_buffers())
    for name, t in [*want.named_parameters(), *want.named_buffers()]:
        assert tensors[name].device == CPU and tensors[name].dtype == t.dtype and torch.equal(tensors[name], t), name

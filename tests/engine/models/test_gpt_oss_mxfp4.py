"""gpt-oss with MXFP4 experts as it ships them (`*_blocks` / `*_scales`, quantization_config mxfp4): the loader
keeps them in that format (widening them only without pagoda's ops), its dequantization is transformers', and
greedy float32 output is transformers' on the same dequantized weights, on one and two ranks."""
import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from conftest import FAMILIES
from oracle import greedy, random_prompts, with_biases
from pagoda.engine import LLM, SamplingParams
from pagoda.engine.demo import build_tiny_checkpoint
from pagoda.engine.layers import cpu_ops, moe
from pagoda.engine.layers.moe import GptOssExperts, quantize_mxfp4
from pagoda.engine.loader import checkpoint_weights, load_hf_config, load_weights
from pagoda.engine.models import build_model

pytestmark = pytest.mark.skipif(not cpu_ops.is_available(torch.device("cpu"))[0], reason="no CPU ops")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(MXFP4 checkpoint, float checkpoint of its dequantized weights): a tiny gpt-oss (intermediate 64, so
    that two ranks hold a block of 32 each) with every bias set, its experts quantized to MXFP4."""
    base = build_tiny_checkpoint(str(tmp_path_factory.mktemp("gpt-oss")), **{**FAMILIES["gpt_oss"],
                                                                              "intermediate_size": 64})
    model = with_biases(base)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    packed = {}
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ == "GptOssExperts":
                for proj in ("gate_up_proj", "down_proj"):
                    p = getattr(m, proj)  # [E, in, out] -> MXFP4 rows: the outputs
                    blocks, scales = quantize_mxfp4(p.transpose(1, 2))
                    p.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                    packed[p] = blocks, scales
    mxfp4 = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    shutil.copytree(base, mxfp4, dirs_exist_ok=True)
    names = {id(p): n for n, p in model.named_parameters()}
    out = {k: v for k, v in tensors.items() if not k.endswith(("gate_up_proj", "down_proj"))}
    for p, (blocks, scales) in packed.items():
        out[names[id(p)] + "_blocks"], out[names[id(p)] + "_scales"] = blocks, scales
    save_file(out, str(mxfp4 / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((mxfp4 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (mxfp4 / "config.json").write_text(json.dumps(config))
    dense = str(tmp_path_factory.mktemp("gpt-oss-dequantized"))
    model.save_pretrained(dense)  # transformers' own model on the dequantized weights
    transformers.AutoTokenizer.from_pretrained(base).save_pretrained(dense)
    return str(mxfp4), dense


def _experts(path: str) -> list[GptOssExperts]:
    model = build_model(load_hf_config(path))
    load_weights(model, path)
    return [m for m in model.modules() if isinstance(m, GptOssExperts)]


def _transformers_dequantized(path: str, layer: int, proj: str) -> torch.Tensor:
    # -> [E, in, out] as transformers' GptOssExperts holds it (gate | up columns interleaved)
    t = load_file(f"{path}/model.safetensors")
    prefix = f"model.layers.{layer}.mlp.experts.{proj}"
    return convert_moe_packed_tensors(t[prefix + "_blocks"], t[prefix + "_scales"], dtype=torch.float32)


def test_the_loader_keeps_mxfp4_and_dequantizes_as_transformers(checkpoints, monkeypatch):
    path, _ = checkpoints
    assert checkpoint_weights(path)["quantization"] == "mxfp4"
    kept = _experts(path)
    assert all(m.gate_up_proj is None and m.gate_up_proj_blocks.dtype == torch.uint8 for m in kept)
    monkeypatch.setattr(moe.cpu_ops, "is_available", lambda device: (False, "no ops"))  # GPU, or no C++ ops
    widened = _experts(path)
    assert all(m.gate_up_proj_blocks is None and m.gate_up_proj.dtype == torch.float32 for m in widened)
    for layer, (k, w) in enumerate(zip(kept, widened)):
        gate_up, down = _transformers_dequantized(path, layer, "gate_up_proj"), \
            _transformers_dequantized(path, layer, "down_proj")
        gate_up = torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], dim=-1).transpose(1, 2)  # gate | up rows
        assert torch.equal(w.gate_up_proj, gate_up) and torch.equal(w.down_proj, down.transpose(1, 2))
        for e in range(k.num_experts):
            got = k.expert(e, torch.float32)
            assert torch.equal(got[0], gate_up[e]) and torch.equal(got[1], down[e].t())


def test_greedy_matches_transformers_on_the_dequantized_weights_on_one_and_two_ranks(checkpoints):
    path, dense = checkpoints
    prompts = random_prompts(256, [1, 17, 40, 70])
    want = greedy(dense, prompts, 12)
    assert any(len(set(w)) > 2 for w in want)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    for tp in (1, 2):
        llm = LLM(path, dtype="float32", num_kv_blocks=64, tensor_parallel_size=tp)
        try:
            if tp == 1:
                experts = [m for m in llm.engine.model.modules() if isinstance(m, GptOssExperts)]
                assert experts and all(m.fused_ops is not None and m.gate_up_proj is None for m in experts)
            assert [o.token_ids for o in llm.generate(prompts, params)] == want
        finally:
            llm.engine.close()

"""Expert-load statistics: each MoE layer's tokens per expert equal what transformers' own routers chose on the
same prompts, and grow by top_k for every token run through the layer; dense models have none."""
import pytest
import torch
import transformers

from conftest import FAMILIES
from oracle import random_prompts
from pagoda.engine import LLM, SamplingParams
from pagoda.server.state import stats_dict


def transformers_load(path: str, prompts: list[list[int]]) -> dict[int, list[int]]:
    """layer -> tokens per expert, from the indices transformers' routers (*TopKRouter) return."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    chosen: dict[int, list[torch.Tensor]] = {}
    for name, m in model.named_modules():
        if type(m).__name__.endswith("TopKRouter"):  # model.layers.{i}.mlp.gate (gpt-oss: .router)
            layer = int(name.split(".")[2])
            m.register_forward_hook(lambda _m, _x, out, layer=layer: chosen.setdefault(layer, []).append(out[2]))
    with torch.no_grad():
        for p in prompts:
            model(input_ids=torch.tensor([p]))
    e = getattr(model.config, "num_local_experts", None) or model.config.num_experts
    return {layer: torch.bincount(torch.cat(ids).flatten(), minlength=e).tolist() for layer, ids in chosen.items()}


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_counts_are_transformers_routing_and_grow_by_top_k_per_token(checkpoint, family):
    path = checkpoint(family)
    prompts = random_prompts(256, [5, 17, 30], seed=3)
    llm = LLM(path, dtype="float32", num_kv_blocks=64)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1))  # only the prompts run through
    load = llm.engine.stats().expert_load
    want = transformers_load(path, prompts)
    assert load.layers == tuple(sorted(want)) == ((1,) if family == "qwen3_moe" else (0, 1))  # mlp_only_layers=[0]
    assert dict(load.per_layer()) == want
    top_k = FAMILIES[family]["num_experts_per_tok"]
    assert (load.tokens.sum(axis=1) == top_k * sum(map(len, prompts))).all()

    # decoding: every generated token but the last runs through each MoE layer once more
    more, max_new = random_prompts(256, [3, 20], seed=4), 6
    llm.generate(more, SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True))
    stats = llm.engine.stats()
    assert stats.num_cached_prompt_tokens == 0
    added = stats.expert_load.tokens - load.tokens
    assert (added >= 0).all() and (added.sum(axis=1) == top_k * (sum(map(len, more)) + 2 * (max_new - 1))).all()


def test_dense_models_have_none(checkpoint):
    llm = LLM(checkpoint("llama"), dtype="float32", num_kv_blocks=16)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    stats = llm.engine.stats()
    assert stats.expert_load is None and stats_dict(stats)["expert_load"] == []

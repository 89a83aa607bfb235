"""Mixture-of-experts families with the engine's other features: chunked prefill, preemption, the prefix cache
and n-gram speculation give transformers' greedy tokens; LoRA on the attention projections (and Qwen2-MoE's
shared expert) matches PEFT, adapters on experts are refused naming them. (Deterministic mode's bitwise probes
run over every family in tests/engine/layers/test_deterministic.py, these included.)"""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from oracle import greedy, make_adapter, random_prompts, with_biases
from pagoda.engine import LLM, SamplingParams

MOE = ["mixtral", "qwen2_moe", "qwen3_moe"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "min_acceptance_rate": 0.0,
         "disable_by_batch_size": 64}


@pytest.mark.parametrize("family", MOE)
def test_chunked_prefill_preemption_prefix_cache_and_ngram_speculation(checkpoint, family):
    path = checkpoint(family)
    shared = list(range(40, 72))  # two blocks every prompt shares
    prompts = [shared + p + p for p in random_prompts(256, [3, 9, 20], seed=1)] * 2  # repeats for the n-grams
    want = greedy(path, prompts[:3], 16) * 2
    llm = LLM(path, dtype="float32", num_kv_blocks=12, block_size=16, max_num_batched_tokens=24, max_model_len=128,
              speculative_config=NGRAM)
    got = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
    assert [o.token_ids for o in got] == want
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0 and scheduler.num_prompt_tokens_cached > 0
    assert llm.engine.speculator.num_proposed > 0
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_lora_on_attention_and_the_shared_expert_matches_peft(checkpoint, tmp_path):
    base = checkpoint("qwen2_moe")
    adapter = make_adapter(base, str(tmp_path / "a"), 1)  # q/k/v/o and the shared expert's gate/up/down
    prompts = random_prompts(256, [1, 17, 40])
    llm = LLM(base, dtype="float32", num_kv_blocks=64, lora_modules={"a": adapter})
    params = SamplingParams(temperature=0.0, max_tokens=10)
    assert [o.token_ids for o in llm.generate(prompts, params, adapter="a")] == greedy(base, prompts, 10, adapter)
    assert [o.token_ids for o in llm.generate(prompts, params)] == greedy(base, prompts, 10)


def test_adapters_on_experts_are_refused_naming_them(checkpoint, tmp_path):
    # PEFT's own form (target_parameters, with the fused experts of transformers 5)
    qwen3 = make_adapter(checkpoint("qwen3_moe"), str(tmp_path / "q3"), 1)
    with pytest.raises(ValueError, match=r"'bad'.*target_parameters \['down_proj', 'gate_up_proj'\] \(the experts"):
        LLM(checkpoint("qwen3_moe"), num_kv_blocks=16, lora_modules={"bad": qwen3})
    # an adapter with a tensor per expert, as made on per-expert modules
    base = checkpoint("qwen2_moe")
    per_expert = shutil.copytree(make_adapter(base, str(tmp_path / "q2"), 1), tmp_path / "per-expert")
    weights = load_file(per_expert / "adapter_model.safetensors")
    prefix = "base_model.model.model.layers.1.mlp.experts.3.gate_proj"
    weights[f"{prefix}.lora_A.weight"], weights[f"{prefix}.lora_B.weight"] = torch.zeros(8, 64), torch.zeros(32, 8)
    save_file(weights, per_expert / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=r"targets the expert module 'model\.layers\.1\.mlp\.experts\.3\.gate_proj'"):
        LLM(base, num_kv_blocks=16, lora_modules={"bad": str(per_expert)})
    # Mixtral's expert names are no linear layer of the model
    mixtral = shutil.copytree(per_expert, tmp_path / "mixtral")
    config = json.loads((mixtral / "adapter_config.json").read_text())
    (mixtral / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "w1"]}))
    with pytest.raises(ValueError, match=r"target_modules 'w1' is not supported for this model"):
        LLM(checkpoint("mixtral"), num_kv_blocks=16, lora_modules={"bad": str(mixtral)})


def test_gpt_oss_with_every_bias_set_matches_transformers_on_one_and_two_ranks(checkpoint, tmp_path):
    """The random init leaves gpt-oss's attention and expert biases zero: set them, so that their loading
    (the experts' interleaved gate | up columns, the down bias once across ranks) is what is checked."""
    import transformers

    model = with_biases(checkpoint("gpt_oss"))
    path = str(tmp_path / "gpt-oss-biased")
    model.save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(checkpoint("gpt_oss")).save_pretrained(path)
    prompts = random_prompts(256, [1, 17, 40, 70])
    want = greedy(path, prompts, 12)
    assert any(len(set(w)) > 2 for w in want)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    for tp in (1, 2):
        llm = LLM(path, dtype="float32", num_kv_blocks=64, tensor_parallel_size=tp)
        try:
            assert [o.token_ids for o in llm.generate(prompts, params)] == want
        finally:
            llm.engine.close()


@pytest.mark.parametrize("family", MOE + ["gpt_oss"])
def test_bfloat16_with_the_expert_op_agrees_with_torch(checkpoint, family):
    """bfloat16: the CPU expert op (and gpt-oss's float32 sinks) and plain torch pick the same greedy tokens,
    but for the rare near-tie that bf16 rounding flips."""
    prompts = random_prompts(256, [1, 17, 40, 70], seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = {}
    for backend in ("auto", "torch"):
        llm = LLM(checkpoint(family), dtype="bfloat16", num_kv_blocks=64, attention_backend=backend)
        experts = [m for m in llm.engine.model.modules() if type(m).__name__.endswith("Experts")]
        assert experts and all((m.fused_ops is None) == (backend == "torch") for m in experts)
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert sum(a[:4] == b[:4] for a, b in zip(outs["auto"], outs["torch"])) >= len(prompts) - 1


def test_gpt_oss_with_another_quantization_is_refused_naming_it(checkpoint, tmp_path):
    path = shutil.copytree(checkpoint("gpt_oss"), tmp_path / "fp8")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"gpt-oss with quantization_config 'fp8' is not supported"):
        LLM(str(path), num_kv_blocks=16)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_int8_quantizes_the_experts_for_the_op(checkpoint, family):
    """--quantization int8: the experts int8 with a scale per output row, computed by the CPU op; greedy tokens
    those of float32 but for the rare near-tie int8 rounding flips."""
    prompts = random_prompts(256, [1, 17, 40], seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = {}
    for quantization in (None, "int8"):
        llm = LLM(checkpoint(family), dtype="float32", num_kv_blocks=64, quantization=quantization)
        experts = [m for m in llm.engine.model.modules() if type(m).__name__.endswith("Experts")]
        assert experts and all((m.int8 is not None) == (quantization == "int8") and m.fused_ops for m in experts)
        outs[quantization] = [o.token_ids for o in llm.generate(prompts, params)]
    assert sum(a[:3] == b[:3] for a, b in zip(outs[None], outs["int8"])) >= len(prompts) - 1

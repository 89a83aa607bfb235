"""LoRA adapters (engine/lora/adapters.py), offline: PEFT itself is the oracle. Adapters are made locally with
PEFT on the tiny checkpoints (B set to random non-zero values: PEFT initialises it to zero), and
transformers + PEFT greedy float32 output must be token-identical to pagoda's, per adapter alone and
in one batch mixing adapters and the base model."""
import json
import os
import random

import pytest
import torch
import transformers

from pagoda.engine import LLM, SamplingParams
from oracle import greedy, make_adapter, random_prompts
from pagoda.engine.errors import AdapterNotFoundError

peft = pytest.importorskip("peft")

MAX_NEW = 10
PROMPT_LENS = [1, 17, 40, 5, 33, 70]
THIRD_TARGETS = {"gpt2": ["c_attn"], "phi3": ["qkv_proj"]}


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    """adapters(family) -> (base path, {name: adapter path}), built once per family."""
    built = {}

    def get(family: str):
        if family not in built:
            base, root = checkpoint(family), tmp_path_factory.mktemp(f"lora-{family}")
            built[family] = base, {
                "one": make_adapter(base, str(root / "one"), 1),
                "two": make_adapter(base, str(root / "two"), 2, r=4, alpha=8, use_rslora=True),
                "three": make_adapter(base, str(root / "three"), 3, r=16, alpha=16,
                                      targets=THIRD_TARGETS.get(family, ["q_proj", "v_proj"])),
            }
        return built[family]
    return get


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    return random_prompts(vocab, PROMPT_LENS, seed)


def reference(base: str, adapter: str | None, prompts) -> list[list[int]]:
    """transformers (+ PEFT with the adapter) greedy, float32."""
    return greedy(base, prompts, MAX_NEW, adapter)


def _greedy():
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


def _assert_clean(llm):
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert all(u == 0 for u in llm.engine.adapters.slots.users)


# llama3 and gemma3: RoPE scaling computed by transformers (the adapters' targets are checked on a model
# built on the meta device first); gemma3, granite and phi3 (fused qkv_proj / gate_up_proj targeted whole, as
# PEFT makes them for Phi-3): the newer families' parts under adapters
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gpt2", "llama3", "gemma3", "granite", "phi3"])
def test_each_adapter_alone_and_mixed_match_peft(adapters, family):
    base, paths = adapters(family)
    llm = LLM(base, dtype="float32", num_kv_blocks=64, lora_modules=paths, max_loras=4)
    prompts = _prompts(llm.engine.hf_config.vocab_size)
    expected = {name: reference(base, path, prompts) for name, path in paths.items()}
    expected[None] = reference(base, None, prompts)
    for name in paths:  # alone
        got = [o.token_ids for o in llm.generate(prompts, _greedy(), adapter=name)]
        assert got == expected[name], name
    assert expected["one"] != expected[None] and expected["two"] != expected["one"], "the adapters change nothing"
    # one batch: every prompt under every adapter and the base, interleaved
    names = [None, "one", "two", "three"]
    batch = [(p, names[(i + j) % 4]) for i, p in enumerate(prompts) for j in range(4)]
    outs = llm.generate([p for p, _ in batch], _greedy(), adapter=[a for _, a in batch])
    for (p, a), o in zip(batch, outs):
        e = expected[a][prompts.index(p)]
        assert o.token_ids == e, (a, len(p))
    from pagoda.engine.layers import cpu_ops
    uses_op = {layer.use_ops for layer in llm.engine.runner.lora.layers.values()}
    assert uses_op == {cpu_ops.is_available("cpu")[0]}  # the C++ op wherever it is built
    _assert_clean(llm)


def test_mixed_batch_with_chunked_prefill_preemption_and_prefix_caching(adapters):
    base, paths = adapters("llama")
    # few blocks force preemption, a small budget chunks the long prompts, two slots make
    # requests wait for a free one
    llm = LLM(base, dtype="float32", lora_modules=paths, max_loras=2, num_kv_blocks=16, block_size=16, max_num_batched_tokens=24,
              max_model_len=128, enable_prefix_caching=True)
    prompts = _prompts(llm.engine.hf_config.vocab_size, seed=1)
    names = [None, "one", "two", "three"]
    batch = [(p, names[(i + j) % 4]) for i, p in enumerate(prompts) for j in range(2)]
    outs = llm.generate([p for p, _ in batch], _greedy(), adapter=[a for _, a in batch])
    for (p, a), o in zip(batch, outs):
        e = reference(base, None if a is None else paths[a], [p])[0]
        assert o.token_ids == e, (a, len(p))
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_clean(llm)


def test_same_prompt_under_two_adapters_shares_no_blocks(adapters):
    base, paths = adapters("llama")
    llm = LLM(base, dtype="float32", num_kv_blocks=64, lora_modules=paths, enable_prefix_caching=True)
    prompt = _prompts(llm.engine.hf_config.vocab_size, seed=2)[5]  # 70 tokens: 4 full blocks
    llm.generate([prompt], _greedy(), adapter="one")
    cached = llm.engine.stats().num_cached_prompt_tokens
    out = llm.generate([prompt], _greedy(), adapter="two")[0]
    assert llm.engine.stats().num_cached_prompt_tokens == cached  # no hit across adapters
    assert out.token_ids == reference(base, paths["two"], [prompt])[0]
    llm.generate([prompt], _greedy(), adapter="two")
    assert llm.engine.stats().num_cached_prompt_tokens > cached  # but a hit under the same one
    llm.generate([prompt], _greedy())
    _assert_clean(llm)


def test_no_adapter_step_runs_no_lora(adapters):
    base, paths = adapters("llama")
    llm = LLM(base, dtype="float32", num_kv_blocks=64, lora_modules=paths)
    prompts = _prompts(llm.engine.hf_config.vocab_size)
    got = [o.token_ids for o in llm.generate(prompts, _greedy())]
    exp = reference(base, None, prompts)
    assert got == exp
    assert llm.engine.runner.lora.state.gather is None


def test_int8_base_with_adapter_equals_adapter_on_dequantized_weights(adapters, tmp_path):
    """int8 base + adapter: the adapter's update is added to the int8 layer's output; the oracle is
    PEFT on a checkpoint holding pagoda's own dequantized int8 weights (run in float32 here, so the
    comparison is of logits, which must agree closely, and of greedy tokens)."""
    base, paths = adapters("llama")
    llm = LLM(base, dtype="float32", num_kv_blocks=64, lora_modules=paths, quantization="int8")
    prompts = _prompts(llm.engine.hf_config.vocab_size)[:3]
    got = llm.generate(prompts, _greedy(), adapter="one")
    # the dequantized weights of every int8 layer, written back as a float checkpoint
    deq = str(tmp_path / "deq")
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    state = hf.state_dict()
    model = llm.engine.model
    for name, m in model.named_modules():
        if getattr(m, "qweight", None) is None:
            continue
        w = m.qweight.float() * m.scales.float()[:, None]
        offsets = getattr(m, "shard_offsets", None)
        if name == "lm_head":
            state["lm_head.weight"] = w
            continue
        prefix = "model." + name.rsplit(".", 1)[0]
        leaf = name.rsplit(".", 1)[1]
        if offsets is None:
            state[f"{prefix}.{leaf}.weight"] = w
        else:
            pieces = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}[leaf]
            bounds = [*offsets, w.shape[0]]
            for p, a, b in zip(pieces, bounds, bounds[1:]):
                state[f"{prefix}.{p}.weight"] = w[a:b]
    hf.load_state_dict(state)
    hf.save_pretrained(deq)
    hf = peft.PeftModel.from_pretrained(hf, paths["one"]).eval()
    agree = 0
    with torch.no_grad():
        for p, o in zip(prompts, got):
            ids = torch.tensor([p + o.token_ids[:-1]])
            ref = hf(input_ids=ids).logits[0, len(p) - 1:].argmax(-1).tolist()
            agree += sum(a == b for a, b in zip(ref, o.token_ids))
    # int8 activations run in bfloat16 through torch's kernel: close, not bitwise
    assert agree >= 0.9 * sum(len(o.token_ids) for o in got)
    # and the adapter changes the int8 model's output as it does the float one's
    plain = llm.generate(prompts, _greedy())
    assert [o.token_ids for o in plain] != [o.token_ids for o in got]
    _assert_clean(llm)


def test_load_and_unload_offline(adapters):
    base, paths = adapters("qwen3")
    llm = LLM(base, dtype="float32", num_kv_blocks=64, allow_lora_loading=True, max_loras=1)
    prompts = _prompts(llm.engine.hf_config.vocab_size)[:2]
    with pytest.raises(AdapterNotFoundError, match="'one'"):
        llm.generate(prompts, _greedy(), adapter="one")
    llm.load_lora_adapter("one", paths["one"])
    llm.load_lora_adapter("two", paths["two"])  # one slot: they take turns
    outs = llm.generate(prompts * 2, _greedy(), adapter=["one", "two", "two", "one"])
    for o, (p, a) in zip(outs, zip(prompts * 2, ["one", "two", "two", "one"])):
        e = reference(base, paths[a], [p])[0]
        assert o.token_ids == e
    llm.unload_lora_adapter("one")
    with pytest.raises(AdapterNotFoundError, match="'one'"):
        llm.generate(prompts, _greedy(), adapter="one")
    with pytest.raises(AdapterNotFoundError):
        llm.unload_lora_adapter("one")
    with pytest.raises(ValueError, match="already loaded"):
        llm.load_lora_adapter("two", paths["two"])
    _assert_clean(llm)


def _edit_config(src: str, dst, **changes) -> str:
    import shutil
    shutil.copytree(src, dst)
    cfg = json.load(open(os.path.join(dst, "adapter_config.json")))
    cfg.update(changes)
    json.dump(cfg, open(os.path.join(dst, "adapter_config.json"), "w"))
    return str(dst)


def _without(src: str, dst, name: str) -> str:
    import shutil
    shutil.copytree(src, dst)
    os.remove(os.path.join(dst, name))
    return str(dst)


def test_refusals_name_the_field(adapters, tmp_path):
    base, paths = adapters("llama")
    cases = [
        (dict(max_lora_rank=4), paths["one"], "r 8 exceeds max_lora_rank 4"),
        ({}, adapters("qwen3")[1]["one"], "does not fit the model's layer"),  # another model's adapter
        ({}, _without(paths["one"], tmp_path / "noweights", "adapter_model.safetensors"),
         "no adapter_model.safetensors"),
        ({}, _edit_config(paths["one"], tmp_path / "dora", use_dora=True), "use_dora"),
        ({}, _edit_config(paths["one"], tmp_path / "save", modules_to_save=["lm_head"]), "modules_to_save"),
        ({}, _edit_config(paths["one"], tmp_path / "bias", bias="all"), "bias 'all'"),
        ({}, _edit_config(paths["one"], tmp_path / "emb", target_modules=["embed_tokens"]),
         "target_modules 'embed_tokens' is not supported"),
        ({}, str(tmp_path / "missing"), "no adapter_config.json"),
    ]
    for options, path, message in cases:
        with pytest.raises(ValueError, match=message) as e:
            LLM(base, dtype="float32", num_kv_blocks=64, lora_modules={"bad": path}, **options)
        assert "'bad'" in str(e.value) and "\n" not in str(e.value)
    for bad, message in [(["x"], "NAME=PATH"), (["a=p", "a=q"], "given twice"), ({"a b": "p"}, "without spaces"),
                         (5, "lora_modules must be")]:
        with pytest.raises(ValueError, match=message):
            LLM(base, dtype="float32", num_kv_blocks=64, lora_modules=bad)
    with pytest.raises(ValueError, match="max_loras"):
        LLM(base, dtype="float32", num_kv_blocks=64, lora_modules=paths, max_loras=0)


def test_adapter_refusals_come_before_any_weights_load(adapters, monkeypatch, tmp_path):
    from pagoda.engine.core.engine_core import EngineCore

    def load_model(*args):
        pytest.fail("the weights loaded before the adapter was refused")
    monkeypatch.setattr(EngineCore, "_load_model", load_model)
    base, paths = adapters("llama")
    for options, path, message in [({}, str(tmp_path / "missing"), "no adapter_config.json"),
                                   (dict(max_lora_rank=4), paths["one"], "r 8 exceeds max_lora_rank 4"),
                                   ({}, _edit_config(paths["one"], tmp_path / "emb", target_modules=["embed_tokens"]),
                                    "target_modules 'embed_tokens' is not supported")]:
        with pytest.raises(ValueError, match=message):
            LLM(base, dtype="float32", lora_modules={"bad": path}, **options)


def test_lora_modules_forms(adapters):
    from pagoda.engine.lora.adapters import parse_lora_modules
    assert parse_lora_modules(["a=/p", '{"name": "b", "path": "/q"}']) == (("a", "/p"), ("b", "/q"))
    assert parse_lora_modules({"a": "/p"}) == (("a", "/p"),)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["llama", "gpt2", "phi3"])
def test_two_ranks_match_peft(adapters, family):
    """Tensor parallelism (gloo, 2 ranks): A/B sharded like their layers (column-parallel: B's rows;
    row-parallel: A's columns, each rank's partial update summed by the layer's all-reduce)."""
    base, paths = adapters(family)
    llm = LLM(base, dtype="float32", lora_modules=paths, max_loras=2, tensor_parallel_size=2, num_kv_blocks=64)
    try:
        prompts = _prompts(llm.engine.hf_config.vocab_size)[:4]
        names = [None, "one", "two", "three"]
        outs = llm.generate(prompts, _greedy(), adapter=names)
        for p, a, o in zip(prompts, names, outs):
            assert o.token_ids == reference(base, None if a is None else paths[a], [p])[0], a
        _assert_clean(llm)
    finally:
        llm.engine.close()


def test_speculative_decoding_and_structured_outputs_with_adapters(adapters):
    """n-gram speculation verifies its proposals with the request's adapter applied to every query row:
    the output stays PEFT's. A structured output under an adapter keeps to its grammar."""
    base, paths = adapters("llama")
    llm = LLM(base, dtype="float32", num_kv_blocks=64, lora_modules=paths,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    rng = random.Random(7)
    motif = [rng.randrange(3, 200) for _ in range(6)]
    prompts = [motif * 4, motif * 3 + [9]]  # repetitive: the n-gram lookup proposes
    names = ["one", "two"]
    outs = llm.generate(prompts, _greedy(), adapter=names)
    for p, a, o in zip(prompts, names, outs):
        assert o.token_ids == reference(base, paths[a], [p])[0], a
    assert llm.engine.speculator.num_proposed > 0
    choices = ["yes", "no", "maybe"]
    params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs={"choice": choices})
    out = llm.generate(["Answer:"], params, adapter="one")[0]
    assert out.text in choices
    _assert_clean(llm)


def test_step_rows_grouped_by_slot_without_sorting():
    from pagoda.engine.lora.adapters import step_slots
    # sequences' slots and query rows: rows 0 | 1 (base) | 2 3 4 | 5 | 6 7 | 8
    step = step_slots([0, -1, 2, 0, 2, 1], [1, 1, 3, 1, 2, 1])
    assert step.slots == (0, 1, 2) and step.width == 5 and step.num_rows == 8
    assert step.padded
    gather, rows, flat = step.packed[:15], step.packed[15:23], step.packed[23:31]
    assert gather.tolist() == [0, 5, 0, 0, 0, 8, 0, 0, 0, 0, 2, 3, 4, 6, 7]  # padded with row 0
    assert rows.tolist() == [0, 2, 3, 4, 5, 6, 7, 8]
    assert gather[flat].tolist() == rows.tolist()
    # the C++ op's: the adapter rows grouped by slot (stable), and their slots
    assert step.packed[31:39].tolist() == [0, 5, 8, 2, 3, 4, 6, 7]
    assert step.packed[39:].tolist() == [0, 0, 1, 2, 2, 2, 2, 2]
    assert step_slots([-1, -1], [3, 1]) is None
    even = step_slots([1, 0, 1, 0], [1, 1, 1, 1])  # no padding: the layout alone
    assert even.width == 2 and not even.padded and len(even.packed) == 4 + 4 + 8
    assert even.packed[8:].tolist() == [1, 3, 0, 2, 0, 0, 1, 1]
    # a 40-row prefill chunk beside single decode rows: split into groups of 8 of its slot
    mixed = step_slots([1, 2, 3, 0], [1, 1, 1, 40])
    assert mixed.width == 8 and mixed.slots == (0,) * 5 + (1, 2, 3) and mixed.num_rows == 43
    gather, rows, flat = mixed.packed[:64], mixed.packed[64:107], mixed.packed[107:150]
    assert gather[flat].tolist() == rows.tolist() == list(range(43))
    assert gather[:40].tolist() == list(range(3, 43)) and gather[40:].tolist()[::8] == [0, 1, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_op_equals_batched_matmuls(dtype):
    """The C++ op (CPU) and the gather / batched-matmul pass (other devices) add the same updates, for a
    fused layer (3 slices, uneven), rows of several slots interleaved with base rows, a prefill-sized
    run of one slot and a slot whose layer has no update."""
    from pagoda.engine.layers import cpu_ops
    from pagoda.engine.lora.adapters import LoRAModel, LoRASlots, StepState, step_slots
    if not cpu_ops.is_available("cpu")[0]:
        pytest.skip("pagoda's CPU ops are not built here")
    torch.manual_seed(0)

    class Layer:
        in_features, out_features, shard_offsets = 40, 72, (0, 32, 52)

    state = StepState()
    layers = {ops: LoRASlots(Layer(), 4, 8, state, dtype, "cpu", use_ops=ops) for ops in (True, False)}
    for slot, rank in ((0, 8), (1, 3), (3, 5)):
        pieces = [(torch.randn(rank, 40), torch.randn(n, rank)) for n in (32, 20, 20)]
        pieces[1] = None if slot == 3 else pieces[1]  # a slice without an update
        for layer in layers.values():
            layer.set(slot, [None if p is None else (p[0].to(dtype), p[1].to(dtype)) for p in pieces])
    seq_slots, counts = [2, 0, -1, 1, 3, 0, 1], [1, 1, 1, 1, 1, 19, 1]  # slot 2 is empty
    step = step_slots(seq_slots, counts)
    x = torch.randn(sum(counts), 40).to(dtype)
    y = torch.randn(sum(counts), 72).to(dtype)
    out = {}
    model = LoRAModel.__new__(LoRAModel)
    model.state = state
    model.set_step(step, torch.from_numpy(step.packed))
    for ops, layer in layers.items():
        out[ops] = layer.forward(x, y.clone())
    tol = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(out[True].float(), out[False].float(), atol=tol, rtol=tol)
    base_row = 2
    assert torch.equal(out[True][base_row], y[base_row])

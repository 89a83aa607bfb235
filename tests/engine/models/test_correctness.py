"""Greedy output token-identical to transformers' own generate, in float32, for every family."""
import random

import pytest
import torch
import transformers

from conftest import FAMILIES
from oracle import greedy, random_prompts
from pagoda.engine import LLM, SamplingParams
from pagoda.engine.demo import build_tiny_checkpoint

MAX_NEW = 12
# 1 token, around the block size (16), several blocks
PROMPT_LENS = [1, 15, 16, 17, 40, 3, 33, 70]


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    return random_prompts(vocab, PROMPT_LENS, seed)


def _reference(path: str, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    return greedy(path, prompts, max_new)


def _check(path, llm_options, expect_preemption=False):
    llm = LLM(path, dtype="float32", **llm_options)
    prompts = _prompts(llm.engine.hf_config.vocab_size)
    expected = _reference(path, prompts)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    got = [o.token_ids for o in outs]
    assert got == expected
    assert any(len(set(e)) > 2 for e in expected), "degenerate reference output proves little"
    for o, e, p in zip(outs, expected, prompts):
        assert o.num_prompt_tokens == len(p) and o.num_generated_tokens == len(e)
        ends_with_eos = e[-1] in llm.engine.eos_token_ids
        assert (o.finish_reason, o.stop_reason) == (("stop", "eos") if ends_with_eos else ("length", "length"))
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    if expect_preemption:
        assert stats.num_preemptions > 0
    return llm


# "auto" on CPU: pagoda's C++ ops (paged attention, fused norm/activation/rotary); "torch": SDPA
BACKENDS = ["auto", "torch"]


def _uses_cpu_ops(llm) -> bool:
    modules = list(llm.engine.model.modules())
    backends = {m.backend for m in modules if type(m).__name__ == "Attention"}
    fused = [m.fused_ops is not None for m in modules if hasattr(type(m), "fused_ops")]
    attention = [getattr(b, "__name__", "") for b in backends] == ["pagoda.engine.layers.cpu_attention"]
    # the fused layers come with it (float32; gpt2 has none)
    assert not fused or (all(fused) == attention and any(fused) == attention)
    # and a Llama-family layer of a few rows runs as one op (float32, weights in panels) where the op has its
    # parts (not Granite's multipliers, SmolLM3's layers without RoPE, Phi's partial rotation or a window)
    layers = [m for m in modules if type(m).__name__ == "LlamaDecoderLayer"]
    plain = [m.fused is not None for m in layers if _fusable(m)]
    assert not plain or (all(plain) == attention and any(plain) == attention)
    assert all(m.fused is None for m in layers if not _fusable(m))
    return attention


def _fusable(layer) -> bool:
    a = layer.self_attn
    return (layer.residual_multiplier == 1 and a.use_rope and a.rotary_dim == a.head_dim and a.attn.variant.is_plain)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_transformers(checkpoint, family, backend):
    llm = _check(checkpoint(family), dict(num_kv_blocks=128, attention_backend=backend))
    assert _uses_cpu_ops(llm) == (backend == "auto")


@pytest.mark.parametrize("cpu_linear", ["onednn", "onednn-only", "mkl"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_greedy_matches_transformers_with_either_cpu_linear_kernel(checkpoint, family, cpu_linear):
    from pagoda.engine.layers.deterministic import PackedLinear
    from pagoda.engine.executor.parallel import Linear

    llm = _check(checkpoint(family), dict(num_kv_blocks=128, cpu_linear=cpu_linear, device="cpu"))
    linears = [m for m in llm.engine.model.modules() if isinstance(m, Linear)]
    packed = [isinstance(m.packed, PackedLinear) for m in linears]
    assert all(packed) if cpu_linear != "mkl" else not any(packed)
    # float32 with pagoda's CPU ops: calls of a few rows run on a second copy (onednn: panels; a tied
    # head: its row-major weight; mkl: the column-major weight); onednn-only keeps none
    from pagoda.engine.layers.cpu_ops import PanelLinear
    assert all(m.fused_ops is not None for m in linears)
    panels = [isinstance(m.panels, PanelLinear) for m in linears]
    if cpu_linear == "onednn":
        assert any(panels) and all(p or m.weight is not None for p, m in zip(panels, linears))
    elif cpu_linear == "onednn-only":
        assert not any(panels) and sum(m.weight is not None for m in linears) <= 1  # a tied head's
    else:
        assert not any(panels) and all(m.weight is not None for m in linears)
    embedding = next(m for m in llm.engine.model.modules() if isinstance(m, torch.nn.Embedding))
    assert embedding.weight is not None  # a tied head's packed copy leaves the lookups their rows


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_greedy_matches_with_preemption_and_chunked_prefill(checkpoint, family, backend):
    # 8 prompts need ~20 blocks of 16; 8 blocks force preemption; a 24-token budget chunks
    # every prompt longer than that (and the 70-token one must fit the whole cache alone).
    llm = _check(checkpoint(family), dict(num_kv_blocks=8, block_size=16, max_num_batched_tokens=24,
                                          max_model_len=128, attention_backend=backend), expect_preemption=True)
    assert llm.engine.scheduler.num_preemptions > 0


def test_sharded_checkpoint_loads(tmp_path):
    path = build_tiny_checkpoint(str(tmp_path), "llama", initializer_range=0.3)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="40KB")
    transformers.AutoTokenizer.from_pretrained(path).save_pretrained(sharded)
    assert len(list(sharded.glob("*.safetensors"))) > 1
    a = LLM(path, dtype="float32", num_kv_blocks=32).generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8))
    b = LLM(str(sharded), dtype="float32", num_kv_blocks=32).generate([[1, 2, 3]], SamplingParams(temperature=0,
            max_tokens=8))
    assert a[0].token_ids == b[0].token_ids


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_transformers_with_triton_attention(checkpoint, family):
    """The Triton kernels (interpreted on CPU) behind the same model: same tokens as transformers,
    through prefill, chunked prefill with a cached context, and decode."""
    path = checkpoint(family)
    llm = LLM(path, dtype="float32", num_kv_blocks=32, attention_backend="triton", max_num_batched_tokens=24,
            max_model_len=128)
    assert llm.engine.runner.model is not None and all(
        m.backend.__name__.endswith("triton_attention") for m in llm.engine.model.modules()
        if type(m).__name__ == "Attention")
    prompts = _prompts(llm.engine.hf_config.vocab_size)[:4]  # 1, 15, 16, 17 tokens
    prompts.append(_prompts(llm.engine.hf_config.vocab_size)[6])  # 33: chunked by the 24-token budget
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))
    assert [o.token_ids for o in outs] == _reference(path, prompts, max_new=6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_matches_with_many_sequences_of_mixed_lengths(checkpoint, backend):
    """Enough concurrent decodes that the torch path splits them into length groups."""
    path = checkpoint("llama")
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 90))] for _ in range(24)]
    llm = LLM(path, dtype="float32", num_kv_blocks=256, attention_backend=backend)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    assert [o.token_ids for o in outs] == _reference(path, prompts)


def test_padded_decode_path_of_cuda_graphs(checkpoint):
    """The decode-graph path (persistent buffers, batches padded to a bucket) run eagerly on CPU:
    same tokens as transformers. On CUDA the same path is captured and replayed."""
    from pagoda.engine.executor.cuda_graphs import DecodeGraphs

    path = checkpoint("qwen3")
    llm = LLM(path, dtype="float32", num_kv_blocks=64, max_model_len=256)
    runner = llm.engine.runner
    runner.decode_graphs = DecodeGraphs(runner.model, 16, 256 // 16, 16, runner.device)  # buckets 1,2,4,8,16
    calls = []
    run = runner.decode_graphs.run
    runner.decode_graphs.run = lambda *a: calls.append(a[0].shape[0]) or run(*a)
    prompts = _prompts(llm.engine.hf_config.vocab_size)[:5]  # 5 decodes: padded to the 8 bucket
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    assert [o.token_ids for o in outs] == _reference(path, prompts)
    assert calls and max(calls) == 5


@pytest.mark.parametrize("block_size", [8, 128])
def test_greedy_matches_with_other_block_sizes(checkpoint, block_size):
    """Block sizes the CPU op has no compiled-in specialisation for, and a block larger than most prompts."""
    _check(checkpoint("llama"), dict(num_kv_blocks=4096 // block_size, block_size=block_size))


def test_longrope_matches_transformers_across_its_switch(tmp_path):
    """Phi-3.5 / Phi-4-mini's LongRoPE: a sequence longer than original_max_position_embeddings rotates every
    token by the long factors; one that grows past it is recomputed (transformers' Phi-3 recomputes its cache
    there). Prompts below, across (during decoding) and above the switch, whole and in chunks, and the prefix
    cache (a long prompt again: its blocks are the long factors' own)."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1 + 0.1 * i for i in range(8)],
            "long_factor": [2 + 0.5 * i for i in range(8)], "original_max_position_embeddings": 64}
    path = build_tiny_checkpoint(str(tmp_path / "phi-longrope"), "phi3", initializer_range=0.3, head_dim=16,
                                 max_position_embeddings=256, original_max_position_embeddings=64, rope_parameters=rope)
    prompts = random_prompts(200, [10, 50, 70, 100])
    want = _reference(path, prompts, max_new=30)
    for options in ({}, {"max_num_batched_tokens": 24}):
        llm = LLM(path, dtype="float32", num_kv_blocks=64, **options)
        assert llm.engine.runner.long_rope == (64, 256)
        got = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=30))
        assert [o.token_ids for o in got] == want
        again = llm.generate(prompts[2:3], SamplingParams(temperature=0.0, max_tokens=30))
        assert again[0].token_ids == want[2] and again[0].num_cached_tokens == 64
        assert llm.engine.stats().num_preemptions == 0  # the recompute at the switch is not one


def test_the_language_model_of_a_gemma3_multimodal_checkpoint(tmp_path):
    """A Gemma3ForConditionalGeneration checkpoint (vision tower and projector beside the language model) is
    served as its text model: the same greedy tokens as transformers' multimodal class on text."""
    from pagoda.engine.demo import build_byte_tokenizer

    tok = build_byte_tokenizer()
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=16, query_pre_attn_scalar=24,
                layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512, initializer_range=0.3,
                tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=5, boi_token_index=6, eoi_token_index=7,
                                       tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    path = str(tmp_path / "gemma3-mm")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    llm = LLM(path, dtype="float32", num_kv_blocks=64)
    prompts = random_prompts(len(tok), [1, 17, 40, 70])
    got = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20))
    assert [o.token_ids for o in got] == _reference(path, prompts, max_new=20)


@pytest.mark.parametrize("edit, message", [
    ({"layer_types": ["sliding_attention", "chunked_attention"]},
     r"layer_types\[1\] 'chunked_attention' is not a layer type this server runs \(one of full_attention, "
     r"sliding_attention, linear_attention\)"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "bogus", "rope_theta": 1e4},
                          "full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
     r"rope_parameters.sliding_attention.rope_type 'bogus' is not a RoPE type this server runs"),
])
def test_an_unknown_layer_or_rope_type_is_refused_naming_the_field(checkpoint, tmp_path, edit, message):
    import json
    import shutil

    path = shutil.copytree(checkpoint("gemma3"), tmp_path / "edited")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ValueError, match=message):
        LLM(str(path), num_kv_blocks=16)

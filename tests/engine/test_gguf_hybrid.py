"""GGUF files of the hybrid linear-attention families (llama.cpp's qwen35, qwen35moe, qwen3next), written as
llama.cpp's convert script writes them (tests/gguf_fixtures.py: Qwen3.5's value heads tiled, A as -exp(A_log),
norms as 1 + w, Qwen3-Next's q|k|v|z split): the config from the metadata, field by field; a float file
token-identical to transformers over the checkpoint, its weights bitwise the checkpoint's; a Q8_0 file kept in
blocks (ssm_out's value heads reordered in whole blocks) token-identical to transformers over its dequantized
weights; a value head that is part of a block kept in blocks, its inputs gathered (widened on two ranks); two ranks against one; a missing field
refused in one line. Prompts of 70 tokens: past a chunk (64) of the linear layers' chunked form."""
import logging

import pytest
import torch
from conftest import FAMILIES
from gguf import GGMLQuantizationType as Q
from gguf_fixtures import (
    assert_config_matches,
    dequantized_state,
    engine_greedy,
    transformers_greedy,
    write_gguf,
)
from pagoda.engine.gguf import GGUFWeight, load_config
from pagoda.engine.layers import cpu_ops

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not cpu_ops.is_available(torch.device("cpu"))[0], reason="no CPU ops")]

HYBRID = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
PROMPT = [(7 * i) % 250 + 3 for i in range(70)]
# every matrix the CPU kernels compute on in Q8_0 (llama.cpp's --outtype q8_0 keeps the router and conv1d float)
Q8 = dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output", "attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha",
                    "ssm_ba", "ssm_out", "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_exps", "ffn_up_exps",
                    "ffn_down_exps", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "output", "token_embd"),
                   Q.Q8_0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The hybrid FAMILIES with value heads of 32 (ssm_out's columns of a head: one Q8_0 block)."""
    from pagoda.engine.demo import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("gguf_hybrid")
    return {f: build_tiny_checkpoint(str(root / f), **{**FAMILIES[f], "linear_value_head_dim": 32}) for f in HYBRID}


@pytest.fixture(scope="module")
def files(checkpoints, tmp_path_factory):
    """(family, "float" or "q8") -> a GGUF file of it."""
    root = tmp_path_factory.mktemp("gguf_hybrid_files")
    out = {}
    for f in HYBRID:
        out[f, "float"] = write_gguf(checkpoints[f], str(root / f"{f}-f32.gguf"))
        out[f, "q8"] = write_gguf(checkpoints[f], str(root / f"{f}-q8.gguf"), types=Q8, file_type=7)
    return out


@pytest.mark.parametrize("family", HYBRID)
def test_config_from_the_metadata_is_the_checkpoints(checkpoints, files, family):
    keys = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
            "layer_types", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
            "linear_num_key_heads", "linear_num_value_heads", "num_experts", "num_experts_per_tok",
            "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob", "mlp_only_layers",
            "bos_token_id", "eos_token_id", "pad_token_id"]
    want, got = assert_config_matches(checkpoints[family], files[family, "float"], keys)
    assert {k: got.rope_parameters[k] for k in want.rope_parameters} == want.rope_parameters


@pytest.mark.parametrize("family", HYBRID)
def test_float_file_is_the_checkpoint_bitwise_and_token_identical(checkpoints, files, family):
    from pagoda.engine import loader
    from pagoda.engine.models import build_model

    models = []
    for path, config in ((checkpoints[family], loader.load_hf_config(checkpoints[family])),
                         (files[family, "float"], load_config(files[family, "float"]))):
        models.append(build_model(config))
        loader.load_weights(models[-1], path)
    mine = dict(models[1].named_parameters())
    for name, p in models[0].named_parameters():  # A_log: the one whose -exp is the file's A, as the checkpoint's
        same = torch.equal(mine[name].exp(), p.exp()) if name.endswith("A_log") else torch.equal(mine[name], p)
        assert same, name
    got, _ = engine_greedy(files[family, "float"], PROMPT, 8)
    assert got == transformers_greedy(checkpoints[family], PROMPT, 8)


@pytest.mark.parametrize("family", HYBRID)
def test_q8_0_file_stays_in_blocks_and_matches_transformers_on_its_weights(checkpoints, files, caplog, family):
    path = files[family, "q8"]
    with caplog.at_level(logging.INFO, logger="pagoda.engine"):
        got, model = engine_greedy(path, PROMPT, 8)
    assert not [r.getMessage() for r in caplog.records if "widened" in r.getMessage()]
    linear = model.layers[0].linear_attn
    for layer in (linear.in_proj_qkvz, linear.in_proj_ba, linear.out_proj):
        assert isinstance(layer.qweight, GGUFWeight) and [k for k, _ in layer.qweight.parts] == ["Q8_0"]
    assert got == transformers_greedy(checkpoints[family], PROMPT, 8, dequantized_state(path, load_config(path)))


def test_value_heads_smaller_than_a_block_keep_ssm_out_in_blocks_and_gather_its_inputs(checkpoint, tmp_path, caplog):
    """Value heads of 8 (FAMILIES' qwen3_5; Qwen3.5's 128 in K-quants' super-blocks of 256 alike): ssm_out's tiled
    columns cannot be moved back in Q8_0's blocks of 32, so the blocks stay in the file's order and each call gathers
    the activations to it (GGUFWeight.perm); on two ranks, whose value heads would cut blocks, ssm_out is widened."""
    path = write_gguf(checkpoint("qwen3_5"), str(tmp_path / "m.gguf"), types=Q8)
    with caplog.at_level(logging.INFO, logger="pagoda.engine"):
        got, model = engine_greedy(path, PROMPT[:20], 6)
    assert not [r for r in caplog.records if "widened" in r.getMessage()]
    weight = model.layers[0].linear_attn.out_proj.qweight
    assert isinstance(weight, GGUFWeight) and weight.perm is not None
    assert not torch.equal(weight.perm, torch.arange(len(weight.perm)))
    assert got == transformers_greedy(checkpoint("qwen3_5"), PROMPT[:20], 6, dequantized_state(path, load_config(path)))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagoda.engine"):
        two, model = engine_greedy(path, PROMPT[:20], 6, tensor_parallel_size=2)
    lines = [r.getMessage() for r in caplog.records if "widened" in r.getMessage()]
    assert len(lines) == 1 and lines[0].endswith("Q8_0: token_embd.weight, blk.0.ssm_out.weight, "  # the vocabulary
                                                 "blk.1.ssm_out.weight, blk.2.ssm_out.weight"), lines  # split too
    assert not isinstance(getattr(model.layers[0].linear_attn.out_proj, "qweight", None), GGUFWeight)
    assert isinstance(model.layers[0].linear_attn.in_proj_qkvz.qweight, GGUFWeight)
    assert got[0] == two[0] and sum(a == b for a, b in zip(got, two)) >= 0.8 * len(got), (got, two)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_two_ranks_agree_with_one(files, family):
    """Each rank its key heads' rows of q|k|v, z, b, a and its value heads' columns of ssm_out, in blocks."""
    one, _ = engine_greedy(files[family, "q8"], PROMPT[:20], 6)
    two, model = engine_greedy(files[family, "q8"], PROMPT[:20], 6, tensor_parallel_size=2)
    assert isinstance(model.layers[0].linear_attn.out_proj.qweight, GGUFWeight)
    assert one[0] == two[0] and sum(a == b for a, b in zip(one, two)) >= 0.8 * len(one), (one, two)


def test_a_file_missing_a_required_field_is_refused_in_one_line(checkpoints, tmp_path):
    import gguf

    src = gguf.GGUFReader(write_gguf(checkpoints["qwen3_5"], str(tmp_path / "full.gguf")))
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "qwen35")
    for name, field in src.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "qwen35.ssm.group_count"):
            continue
        kind = field.types[0]
        value = field.contents()
        if kind == gguf.GGUFValueType.ARRAY:
            w.add_array(name, value)
        else:
            w.add_key_value(name, value, kind)
    for t in src.tensors:
        w.add_tensor(t.name, t.data, raw_shape=list(reversed([int(n) for n in t.shape])), raw_dtype=t.tensor_type)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match=r"m\.gguf: lacks qwen35\.ssm\.group_count, which a qwen35 file has$"):
        load_config(str(tmp_path / "m.gguf"))

"""GGUF files of mixtures of experts (Mixtral, written as llama with experts; Qwen2-MoE; Qwen3-MoE; gpt-oss): the
config from the metadata, the experts' 3-d tensors placed per expert, kept in their blocks for the CPU expert op
(csrc/moe_cpu.cpp: GGUF block types and MXFP4), other types widened in one log line. Greedy float32 output
against transformers over the same weights as gguf.quants dequantizes them; the op over GGUF blocks against the
per-expert loop over their dequantized weights; two ranks against one; a bad expert tensor refused in one line."""
import logging

import numpy as np
import pytest
import torch
from conftest import FAMILIES
from gguf import GGMLQuantizationType as Q
from gguf_fixtures import (assert_config_matches, blocks, dequantized_state, engine_greedy, transformers_greedy,
                           write_gguf)
from pagoda.engine.gguf import load_config
from pagoda.engine.layers import cpu_ops
from pagoda.engine.layers.moe import Experts

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not cpu_ops.is_available(torch.device("cpu"))[0], reason="no CPU ops")]

MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss")
PROMPT = list(range(7, 7 + 20))
# Q4_K_M's experts (gate / up in Q4_K, down in Q6_K), a Q8_0 / Q5_K mix with the shared expert in Q8_0, gpt-oss's
# MXFP4 experts as its GGUFs ship them
TYPES = {"mixtral": {"ffn_gate_exps": Q.Q4_K, "ffn_up_exps": Q.Q4_K, "ffn_down_exps": Q.Q6_K, "attn_q": Q.Q4_K},
         "qwen2_moe": {"ffn_gate_exps": Q.Q8_0, "ffn_up_exps": Q.Q8_0, "ffn_down_exps": Q.Q5_K,
                       "ffn_gate_shexp": Q.Q8_0, "ffn_up_shexp": Q.Q8_0},
         "qwen3_moe": {"ffn_gate_exps": Q.Q4_K, "ffn_up_exps": Q.Q4_K, "ffn_down_exps": Q.Q6_K},
         "gpt_oss": {"ffn_gate_exps": Q.MXFP4, "ffn_up_exps": Q.MXFP4, "ffn_down_exps": Q.MXFP4}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The MoE FAMILIES with 256 hidden units and 256 a expert (whole K-quant super-blocks)."""
    from pagoda.engine.demo import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("gguf_moe")
    size = {"mixtral": "intermediate_size", "gpt_oss": "intermediate_size"}
    return {f: build_tiny_checkpoint(str(root / f), **{**FAMILIES[f], "hidden_size": 256,
                                                        size.get(f, "moe_intermediate_size"): 256})
            for f in MOE}


@pytest.fixture(scope="module")
def files(checkpoints, tmp_path_factory):
    """(family, "float" or "blocks") -> a GGUF file of it."""
    root = tmp_path_factory.mktemp("gguf_moe_files")
    out = {}
    for f in MOE:
        out[f, "float"] = write_gguf(checkpoints[f], str(root / f"{f}-f32.gguf"))
        out[f, "blocks"] = write_gguf(checkpoints[f], str(root / f"{f}-q.gguf"), types=TYPES[f])
    return out


def _greedy(model: str, n: int = 10, **options) -> tuple[list[int], torch.nn.Module]:
    return engine_greedy(model, PROMPT, n, **options)


def _reference(ckpt: str, state=None, n: int = 10) -> list[int]:
    return transformers_greedy(ckpt, PROMPT, n, state)


@pytest.mark.parametrize("family", MOE)
def test_config_from_the_metadata_is_the_checkpoints(checkpoints, files, family):
    keys = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "num_experts_per_tok",
            "num_local_experts", "num_experts", "intermediate_size", "moe_intermediate_size", "norm_topk_prob",
            "shared_expert_intermediate_size", "mlp_only_layers", "swiglu_limit", "sliding_window", "layer_types",
            "head_dim", "rms_norm_eps"]
    want, got = assert_config_matches(checkpoints[family], files[family, "float"], keys)
    if family == "gpt_oss":
        assert {k: got.rope_parameters[k] for k in want.rope_parameters} == want.rope_parameters


@pytest.mark.parametrize("family", MOE)
def test_float_file_is_token_identical_to_transformers(checkpoints, files, family):
    got, model = _greedy(files[family, "float"])
    assert got == _reference(checkpoints[family])
    assert not any(m.gguf for m in model.modules() if isinstance(m, Experts))


@pytest.mark.parametrize("family", MOE)
def test_block_experts_match_transformers_on_the_dequantized_weights(checkpoints, files, caplog, family):
    path = files[family, "blocks"]
    with caplog.at_level(logging.INFO, logger="pagoda.engine"):
        got, model = _greedy(path)
    assert not [r.getMessage() for r in caplog.records if "widened" in r.getMessage()]
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    want = {"gate_up_proj": TYPES[family]["ffn_gate_exps"].name, "down_proj": TYPES[family]["ffn_down_exps"].name}
    assert experts and all({p: g[0] for p, g in m.gguf.items()} == want for m in experts)
    assert all(m.gate_up_proj is None and m.down_proj is None for m in experts)  # no float copy
    assert got == _reference(checkpoints[family], dequantized_state(path, load_config(path)))


def test_other_types_and_mixed_gate_up_are_widened_in_one_log_line(checkpoints, tmp_path, caplog):
    types = {"ffn_gate_exps": Q.IQ2_XXS, "ffn_up_exps": Q.IQ2_XXS, "ffn_down_exps": Q.Q8_0}
    path = write_gguf(checkpoints["qwen3_moe"], str(tmp_path / "m.gguf"), types=types)
    with caplog.at_level(logging.INFO, logger="pagoda.engine"):
        got, model = _greedy(path)
    lines = [r.getMessage() for r in caplog.records if "widened" in r.getMessage()]
    assert len(lines) == 1 and lines[0].endswith("IQ2_XXS: blk.1.ffn_gate_exps.weight, blk.1.ffn_up_exps.weight"), lines
    experts = model.layers[1].mlp.experts
    assert experts.gate_up_proj is not None and list(experts.gguf) == ["down_proj"]  # down stays in blocks
    assert got == _reference(checkpoints["qwen3_moe"], dequantized_state(path, load_config(path)))

    types = {"ffn_gate_exps": Q.Q4_K, "ffn_up_exps": Q.Q5_K}
    path = write_gguf(checkpoints["qwen3_moe"], str(tmp_path / "mixed.gguf"), types=types)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagoda.engine"):
        got, model = _greedy(path)
    lines = [r.getMessage() for r in caplog.records if "widened" in r.getMessage()]
    assert len(lines) == 1 and "gate and up in different types: blk.1.ffn_gate_exps.weight, " \
                               "blk.1.ffn_up_exps.weight" in lines[0], lines
    assert not model.layers[1].mlp.experts.gguf
    assert got == _reference(checkpoints["qwen3_moe"], dequantized_state(path, load_config(path)))


def test_without_the_cpu_ops_the_experts_are_widened_in_one_log_line(files, caplog, monkeypatch):
    """Where pagoda's CPU ops cannot run (a GPU, no compiler): gpt-oss's MXFP4 experts widened at load."""
    kept, _ = _greedy(files["gpt_oss", "blocks"])
    monkeypatch.setattr(cpu_ops, "is_available", lambda device: (False, "no C++ compiler"))
    with caplog.at_level(logging.INFO, logger="pagoda.engine"):
        widened, model = _greedy(files["gpt_oss", "blocks"])
    assert widened == kept
    assert not any(m.gguf for m in model.modules() if isinstance(m, Experts))
    lines = [r.getMessage() for r in caplog.records if "widened" in r.getMessage()]
    assert len(lines) == 1 and "(not on pagoda's CPU ops: no C++ compiler): MXFP4: " in lines[0], lines
    assert set(lines[0].split("MXFP4: ")[1].split(", ")) == {f"blk.{n}.ffn_{p}_exps.weight" for n in (0, 1)
                                                             for p in ("gate", "up", "down")}


@pytest.mark.parametrize("family,types", [("qwen3_moe", {"ffn_gate_exps": Q.Q4_K, "ffn_up_exps": Q.Q4_K,
                                                           "ffn_down_exps": Q.Q8_0}),
                                          ("qwen2_moe", TYPES["qwen2_moe"])], ids=["Q8_0-down", "Q5_K-down"])
def test_two_ranks_agree_with_one(checkpoints, tmp_path, caplog, family, types):
    """Each rank keeps its rows of gate / up and its columns of down in whole blocks: Q8_0's 32 (128 of down's
    256 inputs a rank); Q5_K's super-blocks of 256 would split, so that down is widened, in the log line. Two
    ranks' sums come in another order than one's: tokens within float32 rounding of each other."""
    path = write_gguf(checkpoints[family], str(tmp_path / "m.gguf"), types=types)
    one, _ = _greedy(path)
    with caplog.at_level(logging.INFO, logger="pagoda.engine"):
        two, model = _greedy(path, tensor_parallel_size=2)
    experts = model.layers[1].mlp.experts
    assert experts.gguf["gate_up_proj"][1].shape[1] == 2 * 128  # this rank's half of each expert's gate and up
    widened = [r.getMessage() for r in caplog.records if "widened" in r.getMessage()]
    if family == "qwen2_moe":
        assert "down_proj" not in experts.gguf and experts.down_proj.shape == (8, 256, 128)
        assert len(widened) == 1 and "Q5_K: blk.0.ffn_down_exps.weight, blk.1.ffn_down_exps.weight" in widened[0]
    else:
        assert experts.gguf["down_proj"][1].shape == (8, 256, 128 // 32 * 34) and not widened
    assert one[0] == two[0] and sum(a == b for a, b in zip(one, two)) >= 0.9 * len(one), (one, two)


def test_two_ranks_split_super_blocks_unevenly_rather_than_widen(tmp_path, caplog):
    """Qwen3-30B-A3B's shape in small: 768 a expert (3 super-blocks) over 2 ranks would cut one in half, so rank 0
    takes two super-blocks of gate, up and down, rank 1 one; nothing widened, and tokens as on one rank."""
    from pagoda.engine.demo import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(str(tmp_path / "ckpt"), **{**FAMILIES["qwen3_moe"], "hidden_size": 256,
                                                            "moe_intermediate_size": 768})
    path = write_gguf(ckpt, str(tmp_path / "m.gguf"), types=TYPES["qwen3_moe"])
    one, _ = _greedy(path)
    with caplog.at_level(logging.INFO, logger="pagoda.engine"):
        two, model = _greedy(path, tensor_parallel_size=2)
    experts = model.layers[1].mlp.experts
    assert experts.gguf_split == (0, 512) and experts.intermediate_size == 512
    assert experts.gguf["gate_up_proj"][1].shape[1] == 2 * 512
    assert experts.gguf["down_proj"][1].shape == (8, 256, 2 * 210)  # two Q6_K super-blocks a row
    assert not [r for r in caplog.records if "widened" in r.getMessage()]
    assert one[0] == two[0] and sum(a == b for a, b in zip(one, two)) >= 0.9 * len(one), (one, two)


def test_a_bad_expert_tensor_is_refused_in_one_line(checkpoints, tmp_path, monkeypatch):
    import gguf_fixtures

    moe_state = gguf_fixtures._moe_state

    def drop_an_expert(state, cfg):
        out = moe_state(state, cfg)
        out["blk.1.ffn_down_exps.weight"] = out["blk.1.ffn_down_exps.weight"][:-1]
        return out

    monkeypatch.setattr(gguf_fixtures, "_moe_state", drop_an_expert)
    path = write_gguf(checkpoints["mixtral"], str(tmp_path / "bad.gguf"))
    with pytest.raises(ValueError, match=r"bad.gguf: tensor 'blk.1.ffn_down_exps.weight' holds \[7, 256, 256\]") as e:
        _greedy(path)
    assert "\n" not in str(e.value)


# the op over GGUF-block experts against the per-expert loop over their dequantized weights
CASES = {
    "uneven groups": [[0, 3], [3, 5], [3, 0], [7, 3], [1, 2], [5, 3], [3, 6], [0, 1], [2, 3], [4, 3], [3, 7]],
    "one token": [[6, 2]],
    "one expert takes every token": [[0, e % 7 + 1] if e % 2 else [e % 7 + 1, 0] for e in range(13)],
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("types", [(Q.Q4_K, Q.Q6_K), (Q.Q8_0, Q.Q5_K), (Q.Q5_0, Q.IQ4_NL), (Q.Q2_K, Q.Q3_K),
                                   (Q.IQ4_XS, Q.Q3_K), (Q.MXFP4, Q.MXFP4)],
                         ids=lambda t: f"{t[0].name}-{t[1].name}")
def test_the_op_over_gguf_blocks_is_the_loop_over_their_dequantized_weights(case, types):
    from gguf.quants import dequantize
    from pagoda.engine.gguf import _repack_mxfp4

    E, H, I = 8, 256, 256
    rng = np.random.default_rng(0)
    m = Experts(E, H, I, "silu")
    for piece, t, (rows, k) in (("gate", types[0], (I, H)), ("up", types[0], (I, H)), ("down", types[1], (H, I))):
        b = blocks(rng.standard_normal((E * rows, k)).astype(np.float32), t, rng).reshape(E, rows, -1)
        w = torch.from_numpy(b)
        m.load_gguf_(piece, t.name, *(_repack_mxfp4(w) if t == Q.MXFP4 else (w.clone(), None)), k)
        dense = torch.from_numpy(dequantize(b, t).reshape(E, rows, k).copy())
        target = m.down_proj if piece == "down" else m.gate_up_proj[:, (piece == "up") * I:(piece == "up") * I + I]
        with torch.no_grad():
            target.copy_(dense)
    loop = Experts(E, H, I, "silu")
    loop.gate_up_proj, loop.down_proj = m.gate_up_proj, m.down_proj  # the dequantized weights as floats
    assert m.finish_gguf_() == [] and m.gate_up_proj is None and m.operands()[0].dtype == torch.uint8
    ids = torch.tensor(CASES[case])
    weights = torch.rand(ids.shape).softmax(-1)
    x = torch.randn(ids.shape[0], H)
    got = torch.zeros_like(x)
    w13, w2, s13, s2 = m.operands()
    cpu_ops.ops().moe_experts_(got, x, w13, w2, weights, ids, s13, s2)
    want = loop.loop_(torch.zeros_like(x), x, weights, ids)
    tol = 1e-5 * want.abs().max().item()  # float32 sums in another order
    torch.testing.assert_close(got, want, atol=tol, rtol=1e-5)
    # the torch loop over this module's own experts (dequantized one at a time) too
    torch.testing.assert_close(m.loop_(torch.zeros_like(x), x, weights, ids), want, atol=tol, rtol=1e-5)

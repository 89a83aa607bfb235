"""GPTQ, AWQ and compressed-tensors checkpoints (engine/int4.py): tiny ones packed here per each format's
published layout (AutoGPTQ's v1 packing: 8 inputs a word, zero points stored minus one, act-order g_idx;
AutoAWQ's GEMM packing: 8 outputs a word in its interleaved order; compressed-tensors' pack_to_int32: values
offset to unsigned, 32 / bits inputs a word, zero points packed along the outputs), repacked at load into
Q4_1 (Q8_0 for 8 bits) blocks, and greedy output against transformers on the float model over the same
dequantized weights."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from grpc_fixtures import engine_config
from pagoda.engine import LLM, SamplingParams
from pagoda.engine.executor.parallel import Linear
from pagoda.engine.layers import cpu_ops

pytestmark = pytest.mark.timeout(300)

GROUP = 128
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT = list(range(7, 67))
_AWQ_PACK = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of a word holds output 8j + _AWQ_PACK[i]


def _pack(values: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """[..., n, 32 / bits] of unsigned values -> [..., n] int32, value i in bits i * bits ..."""
    words = sum(values[..., i].long() << (bits * i) for i in range(32 // bits))
    return words.to(torch.int32).contiguous()


def write_int4(ckpt: str, out: str, method: str, sym: bool = True, desc_act: bool = False, bits: int = 4,
               seed: int = 0) -> dict:
    """`ckpt` with each decoder linear layer replaced by random int4 weights packed as `method` stores them, in
    a copy at `out`; returns the dequantized weights by checkpoint name (the reference's)."""
    g = torch.Generator().manual_seed(seed)
    shutil.copytree(ckpt, out)
    state, dense = load_file(os.path.join(ckpt, "model.safetensors")), {}
    for name in [n for n in state if n.endswith(".weight") and n.split(".")[-2] in PROJ]:
        w = state.pop(name)
        rows, k = w.shape
        groups = k // GROUP
        q = torch.randint(0, 1 << bits, (rows, k), generator=g)
        scales = (w.std() / 4 * 16 / (1 << bits) * torch.rand(groups, rows, generator=g).add(0.5)).half()
        if method == "compressed-tensors":
            scales = scales.bfloat16()  # in the model's dtype there
        zeros = (torch.full((groups, rows), 1 << (bits - 1)) if sym
                 else torch.randint(1, 16, (groups, rows), generator=g))
        g_idx = torch.arange(k) // GROUP
        if desc_act:  # act-order: groups of columns by a permutation (here one for every layer)
            order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
            g_idx = torch.empty(k, dtype=torch.long)
            g_idx[order] = torch.arange(k) // GROUP
        dense[name] = scales.float()[g_idx].t() * (q - zeros[g_idx].t())
        prefix = name.removesuffix(".weight")
        if method == "gptq":
            state[f"{prefix}.qweight"] = _pack(q.t().reshape(k // 8, 8, rows).transpose(1, 2))
            state[f"{prefix}.qzeros"] = _pack((zeros - 1).view(groups, rows // 8, 8))
            state[f"{prefix}.g_idx"] = g_idx.to(torch.int32)
        elif method == "awq":
            state[f"{prefix}.qweight"] = _pack(q.t().reshape(k, rows // 8, 8)[..., _AWQ_PACK])
            state[f"{prefix}.qzeros"] = _pack(zeros.view(groups, rows // 8, 8)[..., _AWQ_PACK])
        else:
            state[f"{prefix}.weight_packed"] = _pack(q.view(rows, k * bits // 32, 32 // bits), bits)
            state[f"{prefix}.weight_scale"] = scales.t().contiguous()
            state[f"{prefix}.weight_shape"] = torch.tensor([rows, k])
            if not sym:
                state[f"{prefix}.weight_zero_point"] = _pack(zeros.t().reshape(rows // 8, 8, groups).transpose(1, 2))
            continue
        state[f"{prefix}.scales"] = scales
    save_file(state, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": "group", "group_size": GROUP}
    config["quantization_config"] = {
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": desc_act, "sym": sym,
                 "checkpoint_format": "gptq"},
        "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"},
        "compressed-tensors": {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                               "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}}[method]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return dense


@pytest.mark.parametrize("arch,method,sym,desc_act,bits", [
    ("llama", "gptq", True, False, 4), ("qwen2", "gptq", False, True, 4), ("llama", "awq", False, False, 4),
    ("llama", "compressed-tensors", False, False, 4), ("qwen2", "compressed-tensors", True, False, 8)])
def test_int4_checkpoint_matches_transformers_on_the_dequantized_weights(tmp_path, arch, method, sym, desc_act, bits):
    from transformers import AutoModelForCausalLM

    from pagoda.engine.demo import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(str(tmp_path / "float"), arch=arch, hidden_size=256, intermediate_size=512,
                                 initializer_range=0.3)
    dense = write_int4(ckpt, str(tmp_path / method), method, sym, desc_act, bits)
    llm = LLM(**vars(engine_config(str(tmp_path / method), num_kv_blocks=32, max_num_batched_tokens=128)))
    try:
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
        layers = [m for m in llm.engine.model.modules() if isinstance(m, Linear) and m.qweight is not None]
        assert len(layers) == 4 * 2 and all(m.weight is None for m in layers)  # qkv, o, gate_up, down per layer
        kind = "Q8_0" if bits == 8 else "Q4_1"
        assert {k for m in layers for k, _ in m.qweight.parts} == {kind}
        assert all((m.qweight.perm is not None) == desc_act for m in layers)
        assert llm.engine.model_info().quantization == f"{method}-int{bits}"
        down = llm.engine.model.layers[0].mlp.down_proj.qweight  # its blocks, read back in the input's order
        got_w = torch.empty(256, 512)
        got_w[:, down.perm if desc_act else slice(None)] = cpu_ops.ops().gguf_dequantize(
            down.parts[0][1], 8 if bits == 8 else 3, 512)
        want_w = dense["model.layers.0.mlp.down_proj.weight"]
        assert (got_w - want_w).abs().max() <= 2 ** -10 * want_w.abs().max()  # float16 offsets
    finally:
        llm.engine.close()
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ref.load_state_dict(dense, strict=False)
    want = ref.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, eos_token_id=None)
    want = want[0, len(PROMPT):].tolist()
    got = list(out.outputs[0].token_ids)
    # Q4_1 keeps -scale * zero in float16: within its rounding of the reference, not bitwise
    assert got[0] == want[0] and sum(a == b for a, b in zip(got, want)) >= 0.9 * len(want), (got, want)


def test_other_bit_widths_are_refused(tmp_path):
    from pagoda.engine.demo import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(str(tmp_path / "float"), hidden_size=256, intermediate_size=512)
    write_int4(ckpt, str(tmp_path / "q"), "gptq")
    with open(tmp_path / "q" / "config.json") as f:
        config = json.load(f)
    config["quantization_config"]["bits"] = 3
    with open(tmp_path / "q" / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=r"quantization_config 'gptq' in 3 bits is not a checkpoint pagoda loads"):
        LLM(**vars(engine_config(str(tmp_path / "q"))))

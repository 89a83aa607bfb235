"""Safetensors checkpoints quantized to 4 bits, with a `quantization_config` (GPTQ, AWQ, compressed-tensors
pack-quantized W4A16; also its symmetric W8A16): their weights repacked at load into GGUF blocks
(engine/gguf.py GGUFWeight), which pagoda's CPU kernels compute on. A Q4_1 block holds 32 weights as
w = d * q + m: d is the group's scale and m = -scale * zero (rounded to float16, as every Q4_1 block's), so
groups must be multiples of 32 weights; 8-bit weights become Q8_0 blocks (w = d * (q - 128)). Act-order
groups (GPTQ's desc_act, compressed-tensors' g_idx) are made contiguous by permuting the layer's input
columns (GGUFWeight.perm: the activations are gathered the same way per call). Everything else in the
checkpoint loads as floats."""
import glob
import json
import logging
import os

import torch
from safetensors import safe_open

from pagoda.engine.gguf import GGUFWeight, copy_into, param_of, to_blocks
from pagoda.engine.layers import cpu_ops

log = logging.getLogger("pagoda.engine")

METHODS = ("gptq", "awq", "compressed-tensors")
_PACKED = ("qweight", "qzeros", "scales", "g_idx",  # GPTQ, AWQ
           "weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape")  # compressed-tensors
_AWQ_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # AutoAWQ's reverse order: the nibble of each of 8 packed outputs


def quantization_config(path: str) -> dict | None:
    """config.json's quantization_config where it is one of METHODS (ValueError for a variant not loaded here),
    else None."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            qc = json.load(f).get("quantization_config")
    except (OSError, ValueError):
        return None
    if not qc or qc.get("quant_method") not in METHODS:
        return None
    method = qc["quant_method"]
    if method == "compressed-tensors":  # one group of Linear targets, its weights' arguments
        groups = list((qc.get("config_groups") or {}).values())
        args = groups[0].get("weights") or {} if len(groups) == 1 else {}
        if qc.get("format") != "pack-quantized" or args.get("type") != "int" or args.get("num_bits") not in (4, 8) \
                or args.get("strategy") not in ("group", "channel") \
                or (args["num_bits"] == 8 and not args["symmetric"]):
            raise ValueError(f"{path}: quantization_config compressed-tensors {qc.get('format')!r} is not one pagoda "
                             f"loads (pack-quantized int weights in one config group: W4A16, or symmetric W8A16)")
        return {**qc, "bits": args["num_bits"], "sym": args["symmetric"], "group_size": args.get("group_size")}
    if qc.get("bits", qc.get("w_bit", 4)) != 4:
        raise ValueError(f"{path}: quantization_config {method!r} in {qc.get('bits', qc.get('w_bit'))} bits is not a "
                         f"checkpoint pagoda loads (4-bit {', '.join(METHODS)})")
    return qc


def _nibbles(packed: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """int32 [..., n] -> its 32 / bits fields each, low first: [..., n, 32 / bits] uint8."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return ((packed[..., None] >> shifts) & ((1 << bits) - 1)).to(torch.uint8)


def unpack(method: str, t: dict, qc: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [out, in] uint8 (0..15 in 4 bits), scales [groups, out] float32, zeros [groups, out] float32, g_idx [in]
    int64): the weight is scales[g_idx[k], o] * (q[o, k] - zeros[g_idx[k], o])."""
    scales = t["scales" if "scales" in t else "weight_scale"].float()
    if method == "gptq":  # qweight [in / 8, out] (8 inputs a word), qzeros [groups, out / 8], v1: zero - 1 stored
        q = _nibbles(t["qweight"].transpose(0, 1)).reshape(t["qweight"].shape[1], -1)
        zeros = _nibbles(t["qzeros"]).reshape(t["qzeros"].shape[0], -1).float()
        zeros += qc.get("checkpoint_format", "gptq") == "gptq"
        g_idx = t["g_idx"].long() if "g_idx" in t else torch.arange(q.shape[1]) // qc["group_size"]
    elif method == "awq":  # GEMM packing: qweight [in, out / 8], qzeros [groups, out / 8]: 8 outputs a word
        q = _nibbles(t["qweight"])[..., _AWQ_ORDER].reshape(t["qweight"].shape[0], -1).transpose(0, 1)
        zeros = _nibbles(t["qzeros"])[..., _AWQ_ORDER].reshape(t["qzeros"].shape[0], -1).float()
        g_idx = torch.arange(q.shape[1]) // qc.get("group_size", qc.get("q_group_size"))
    else:  # compressed-tensors: weight_packed [out, in * bits / 32], values offset to unsigned; weight_scale
        # [out, groups]; an asymmetric zero point packed along the outputs: [out * bits / 32, groups]
        bits, (out, k) = qc["bits"], t["weight_shape"].tolist()
        q = _nibbles(t["weight_packed"], bits).reshape(out, -1)[:, :k]
        scales = scales.transpose(0, 1).contiguous()
        if qc["sym"]:
            zeros = torch.full_like(scales, 1 << (bits - 1))
        else:
            zp = _nibbles(t["weight_zero_point"], bits)  # [out / 8, groups, 8]
            zeros = zp.permute(0, 2, 1).reshape(-1, zp.shape[1])[:out].transpose(0, 1).float()
        g_idx = t["weight_g_idx"].long() if "weight_g_idx" in t else torch.arange(k) // (qc["group_size"] or k)
    return q.contiguous(), scales, zeros, g_idx


def repack(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor, bits: int = 4
           ) -> tuple[str, torch.Tensor, torch.Tensor | None]:
    """(block type, its blocks [out, in / 32 * block bytes] uint8, the input permutation that makes groups
    contiguous or None): Q4_1 for 4 bits, Q8_0 for symmetric 8 bits (zero 128)."""
    out, k = q.shape
    perm = torch.argsort(g_idx, stable=True)
    if torch.equal(perm, torch.arange(k)):
        perm = None
    else:
        q = q[:, perm]
    group = g_idx[perm] if perm is not None else g_idx
    block_group = group[::32]  # [in / 32]
    if k % 32 or not torch.equal(group.view(-1, 32), block_group[:, None].expand(-1, 32)):
        raise ValueError("groups are not whole 32-weight blocks")
    d = scales[block_group].t().half()  # [out, blocks]
    if bits == 8:
        qs = (q.view(out, k // 32, 32).to(torch.int16) - 128).to(torch.int8).view(torch.uint8)
        return "Q8_0", torch.cat([d[..., None].view(torch.uint8), qs], dim=-1).reshape(out, -1).contiguous(), perm
    m = (-scales * zeros)[block_group].t().half()
    nib = q.view(out, k // 32, 2, 16)
    qs = nib[:, :, 0] | (nib[:, :, 1] << 4)  # weights j and j + 16 in one byte
    blocks = torch.cat([d[..., None].view(torch.uint8), m[..., None].view(torch.uint8), qs], dim=-1)
    return "Q4_1", blocks.reshape(out, -1).contiguous(), perm


def load_weights(model: torch.nn.Module, path: str, qc: dict, optional: tuple[str, ...] = ()) -> None:
    """The checkpoint's tensors into the model: each quantized layer's packed weights, scales and zero points
    (/ g_idx) as blocks, the rest as floats."""
    if any(getattr(m, "tp", None) is not None and m.tp.size > 1 for m in model.modules()):
        raise ValueError(f"{path}: {qc['quant_method']} checkpoints run on one rank for now (tensor_parallel_size 1)")
    params = dict(model.named_parameters())
    dtype, device = next(iter(params.values())).dtype, next(iter(params.values())).device
    native, why = cpu_ops.is_available(device)
    missing, packed = set(params), {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                prefix, _, kind = name.rpartition(".")
                if kind in _PACKED:
                    packed.setdefault(prefix, {})[kind] = f.get_tensor(name)
                    continue
                target = param_of(model, params, name, os.path.basename(file))
                if target is None:
                    continue
                owner, pname, shard = target
                copy_into(owner, pname, params[pname], shard, f.get_tensor(name).to(dtype), file, name)
                missing.discard(pname)
    layers: dict = {}  # layer -> ({shard: ("Q4_1", blocks)}, {shard: perm})
    for prefix, t in packed.items():
        pname, shard = model.checkpoint_name(f"{prefix}.weight")
        owner = model.get_submodule(pname.rsplit(".", 1)[0])
        try:
            q, scales, zeros, g_idx = unpack(qc["quant_method"], t, qc)
            if not native:  # widened: w = scale * (q - zero)
                dense = scales[g_idx].t() * (q.float() - zeros[g_idx].t())
                copy_into(owner, pname, params[pname], shard, dense.to(dtype), path, prefix)
                missing.discard(pname)
                continue
            kind, blocks, perm = repack(q, scales, zeros, g_idx, qc.get("bits", 4))
        except (KeyError, RuntimeError, ValueError) as e:
            raise ValueError(f"{path}: {prefix} is not a {qc['quant_method']} layer pagoda can repack "
                             f"({' '.join(str(e).split())})") from None
        shards, perms = layers.setdefault(owner, ({}, {}))
        shards[shard], perms[shard] = (kind, blocks), perm
        missing.discard(pname)
    missing = {n for n in missing if not n.startswith(optional)} if optional else missing
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights for: {', '.join(sorted(missing)[:8])}")
    for layer, (shards, perms) in layers.items():
        ordered = list(perms.values())
        if any((p is None) != (ordered[0] is None) or (p is not None and not torch.equal(p, ordered[0]))
               for p in ordered):
            raise ValueError(f"{path}: the pieces of a fused layer ({type(layer).__name__}) order their inputs "
                             f"differently (act-order); pagoda needs one order per layer")
        weight: GGUFWeight = to_blocks(layer, shards, dtype)
        weight.perm = perm = ordered[0]
        if perm is not None:  # a piece left in float (none, usually) takes the same input order
            weight.parts = [(k, t[:, perm] if k is None else t) for k, t in weight.parts]
    if native:
        log.info("%s: %d linear layers in %d bits (repacked as %s blocks)", qc["quant_method"], len(layers),
                 qc.get("bits", 4), "Q8_0" if qc.get("bits", 4) == 8 else "Q4_1")
    else:
        log.info("%s: linear layers widened to %s (not on pagoda's CPU ops: %s)", qc["quant_method"],
                 str(dtype).removeprefix("torch."), why)

"""Weight-only int8 quantization for CPU (`quantization="int8"`): each linear layer's weight is kept
as int8 with one scale per output feature (symmetric, round to nearest), and its matmul is torch's
own int8 weight-only kernel (`torch._weight_int8pack_mm`), which reads a quarter of float32's bytes,
for up to DEQUANT_MIN_ROWS - 1 rows (decode steps); more rows (prefill chunks) multiply dequantized
chunks of the weight instead. Activations go through the kernel in bfloat16 (its float32 path is
~10x slower); the layer's output comes back in the model's dtype. Embeddings, norms and the KV
cache stay in the model's dtype; a tied LM head gets its own int8 copy (the embedding keeps its rows
for the lookups). Unquantized stays the default: float32 is the path tested token for token against
transformers; benchmarks/quantization.py measures what int8 costs in accuracy.

GGUF checkpoints' linear weights (engine/gguf.py GGUFWeight; GPTQ / AWQ / compressed-tensors ones repacked
into GGUF blocks by engine/int4.py) go through the same dispatch (quantized_linear): pagoda's CPU kernels on
the blocks as stored (csrc/gguf_cpu.cpp) for up to DEQUANT_MIN_ROWS - 1 rows, float32
accumulators; more rows multiply chunks of the weight dequantized to the activations' dtype. The kernel picks
one of two few-row paths per block type (gguf_cpu.cpp's integer_path and table): float (dequantize(W) @ x) or
integer (csrc/gguf_dot.h: activations quantized to 16 bits in blocks of 32, integer dot products; dequantize(W)
@ dequantize(q16(x)), each activation off by at most 1 / 65534 of its block's largest, at 1.3-2.4x the float
path's weight bandwidth at one row)."""
import logging

import torch
import torch.nn.functional as F

from pagoda.engine.gguf import GGUF_KERNEL_TYPES, GGUFWeight
from pagoda.engine.layers import cpu_ops
from pagoda.engine.loader import native_bf16

log = logging.getLogger("pagoda.engine")

# torch's kernel reads the input features 16 at a time and does not check it (it crashes otherwise)
_K_MULTIPLE = 16
# The int8 kernel converts the weights again for every few rows: its time grows with the rows, while a
# GEMM over dequantized weights costs a fixed conversion plus little per row. Measured on Zen 4 (2
# cores, [M, 896] x [896, 9728] and the [896, 151936] LM head): equal near 48 rows for both shapes.
DEQUANT_MIN_ROWS = 48
CHUNK_ROWS = 2048  # output rows dequantized at once: a few MB, so the GEMM reads them from cache


def check(quantization: str | None, device: torch.device) -> None:
    if quantization is not None and device.type != "cpu":
        raise ValueError(f"quantization {quantization!r} (weight-only) runs on CPU only; on {device.type} "
                         f"use dtype bfloat16 or float16 without it")


@torch.no_grad()
def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight: [out, in] float -> (int8 [out, in], bfloat16 scales [out]); weight ~ q * scale. Done
    CHUNK_ROWS rows at a time, so that a large LM head needs no float32 copies of itself."""
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(weight.shape[0], dtype=torch.bfloat16, device=weight.device)
    for a in range(0, weight.shape[0], CHUNK_ROWS):
        w = weight[a:a + CHUNK_ROWS].float()
        s = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).bfloat16()
        q[a:a + CHUNK_ROWS] = torch.round(w / s.float()[:, None]).clamp_(-127, 127)
        scales[a:a + CHUNK_ROWS] = s
    return q, scales


def can_quantize(layer: torch.nn.Linear) -> bool:
    return layer.in_features % _K_MULTIPLE == 0


def int8_linear(x: torch.Tensor, layer) -> torch.Tensor:
    # x: [num_tokens, in] -> [num_tokens, out], in x's dtype
    q, scales = layer.qweight, layer.scales
    if x.dim() != 2:
        return int8_linear(x.reshape(-1, x.shape[-1]), layer).view(*x.shape[:-1], q.shape[0])
    if x.shape[0] < DEQUANT_MIN_ROWS:
        y = torch._weight_int8pack_mm(x.to(torch.bfloat16, memory_format=torch.contiguous_format), q, scales)
    else:  # dequantized a few thousand rows at a time (they stay in cache), then a plain GEMM
        dt = layer.gemm_dtype
        xd = x.to(dt)
        y = torch.cat([F.linear(xd, q[a:a + CHUNK_ROWS].to(dt).mul_(scales[a:a + CHUNK_ROWS, None]))
                       for a in range(0, q.shape[0], CHUNK_ROWS)], dim=1)
    y = y.to(x.dtype)
    return y if layer.bias is None else y.add_(layer.bias)


def quantized_linear(x: torch.Tensor, layer) -> torch.Tensor:
    """The one dispatch of a quantized linear layer (parallel.Linear with `qweight` set), by its format."""
    return gguf_linear(x, layer) if isinstance(layer.qweight, GGUFWeight) else int8_linear(x, layer)


def gguf_linear(x: torch.Tensor, layer) -> torch.Tensor:
    # x: [num_tokens, in] -> [num_tokens, out], in x's dtype
    w: GGUFWeight = layer.qweight
    if x.dim() != 2:
        return gguf_linear(x.reshape(-1, x.shape[-1]), layer).view(*x.shape[:-1], w.out_features)
    if w.perm is not None:  # blocks of act-ordered columns (GPTQ desc_act)
        x = x[:, w.perm]
    ops = cpu_ops.ops()
    ys = []
    for kind, t in w.parts:
        if kind is None:
            ys.append(F.linear(x, t.to(x.dtype)))
        elif x.shape[0] < DEQUANT_MIN_ROWS:
            ys.append(ops.gguf_linear(x, t, GGUF_KERNEL_TYPES[kind][0]))  # the type's few-row path
        else:  # dequantized a few thousand rows at a time (they stay in cache), then a plain GEMM
            type_id = GGUF_KERNEL_TYPES[kind][0]
            ys += [F.linear(x, ops.gguf_dequantize(t[a:a + CHUNK_ROWS], type_id, w.in_features).to(x.dtype))
                   for a in range(0, t.shape[0], CHUNK_ROWS)]
    y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)
    return y if layer.bias is None else y.add_(layer.bias)


def gguf_embedding(ids: torch.Tensor, w: GGUFWeight) -> torch.Tensor:
    # ids: [num_tokens] -> [num_tokens, hidden] in w.dtype: only the rows looked up are dequantized
    kind, blocks = w.parts[0]
    rows = cpu_ops.ops().gguf_dequantize(blocks[ids], GGUF_KERNEL_TYPES[kind][0], w.in_features)
    return rows.to(w.dtype)


@torch.no_grad()
def quantize_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """weight: [out, in] float (in a multiple of 32) -> GGUF Q4_1 blocks [out, in / 32 * 20] uint8: per 32
    weights their minimum m and step d = (max - min) / 15 in float16, q = round((w - m) / d). Done CHUNK_ROWS
    rows at a time (no float32 copy of a large LM head)."""
    out, k = weight.shape
    blocks = torch.empty(out, k // 32, 20, dtype=torch.uint8, device=weight.device)
    for a in range(0, out, CHUNK_ROWS):
        w = weight[a:a + CHUNK_ROWS].float().view(-1, k // 32, 32)
        lo = w.amin(-1).half()
        d = ((w.amax(-1) - lo.float()) / 15).half()
        q = torch.round((w - lo.float()[..., None]) / d.float().clamp(min=1e-30)[..., None]).clamp_(0, 15)
        q = q.to(torch.uint8)
        blocks[a:a + CHUNK_ROWS] = torch.cat([d[..., None].view(torch.uint8), lo[..., None].view(torch.uint8),
                                              q[..., :16] | (q[..., 16:] << 4)], dim=-1)
    return blocks.view(out, -1)


def quantize_model_(model: torch.nn.Module, quantization: str | None, linear: type) -> int:
    """Quantize every `linear` layer (engine/executor/parallel.py Linear) that can be, in place; returns
    how many were. int4: GGUF Q4_1 blocks (32 weights a block), computed on by the GGUF kernels."""
    if quantization is None:
        return 0
    # many rows: dequantize to bfloat16 where the CPU computes in it natively (AVX512-BF16, AMX), else
    # to float32 (bf16 GEMMs are emulated there, 2x slower than float32)
    gemm_dtype = torch.bfloat16 if native_bf16() else torch.float32
    count = skipped = 0
    for m in model.modules():
        if isinstance(m, linear) and m.qweight is not None:  # stored quantized (a GGUF checkpoint's blocks)
            continue
        if isinstance(m, linear) and quantization == "int4" and m.in_features % 32 == 0:
            m.qweight = GGUFWeight([("Q4_1", quantize_q4_1(m.weight))], m.in_features, m.weight.dtype)
            m.weight = None  # a tied head's rows stay with the embedding
            count += 1
        elif isinstance(m, linear) and quantization == "int8" and can_quantize(m):
            m.qweight, m.scales = quantize_int8(m.weight)
            m.gemm_dtype = gemm_dtype
            m.weight = None  # a tied head's rows stay with the embedding
            count += 1
        elif isinstance(m, linear):
            skipped += 1
    multiple = 32 if quantization == "int4" else _K_MULTIPLE
    log.info("%s weight-only: %d linear layers quantized%s", quantization, count,
             f", {skipped} kept in float (input size not a multiple of {multiple})" if skipped else "")
    if quantization == "int8":  # mixtures of experts' experts (engine/layers/moe.py Experts): the CPU op's int8
        experts = sum(m.quantize_int8_() for m in model.modules() if hasattr(m, "quantize_int8_"))
        if experts:
            log.info("int8 weight-only: the experts of %d MoE layers quantized", experts)
    return count


__all__ = ["check", "quantize_int8", "quantize_q4_1", "int8_linear", "gguf_linear", "gguf_embedding",
           "quantized_linear", "quantize_model_"]

"""Weight-only int8 quantization for CPU (`quantization="int8"`): each linear layer's weight is kept
as int8 with one scale per output feature (symmetric, round to nearest), and its matmul is torch's
own int8 weight-only kernel (`torch._weight_int8pack_mm`), which reads a quarter of float32's bytes,
for up to DEQUANT_MIN_ROWS - 1 rows (decode steps); more rows (prefill chunks) multiply dequantized
chunks of the weight instead. Activations go through the kernel in bfloat16 (its float32 path is
~10x slower); the layer's output comes back in the model's dtype. Embeddings, norms and the KV
cache stay in the model's dtype; a tied LM head gets its own int8 copy (the embedding keeps its rows
for the lookups). Unquantized stays the default: float32 is the path tested token for token against
transformers; benchmarks/quantization.py measures what int8 costs in accuracy."""
import logging

import torch
import torch.nn.functional as F

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
        raise ValueError(f"quantization {quantization!r} (weight-only int8) runs on CPU only; on {device.type} "
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


def quantize_model_(model: torch.nn.Module, quantization: str | None, linear: type) -> int:
    """Quantize every `linear` layer (engine/executor/parallel.py Linear) that can be, in place; returns
    how many were."""
    if quantization is None:
        return 0
    # many rows: dequantize to bfloat16 where the CPU computes in it natively (AVX512-BF16, AMX), else
    # to float32 (bf16 GEMMs are emulated there, 2x slower than float32)
    gemm_dtype = torch.bfloat16 if native_bf16() else torch.float32
    count = skipped = 0
    for m in model.modules():
        if isinstance(m, linear) and can_quantize(m):
            m.qweight, m.scales = quantize_int8(m.weight)
            m.gemm_dtype = gemm_dtype
            m.weight = None  # a tied head's rows stay with the embedding
            count += 1
        elif isinstance(m, linear):
            skipped += 1
    log.info("int8 weight-only: %d linear layers quantized%s", count,
             f", {skipped} kept in float (input size not a multiple of {_K_MULTIPLE})" if skipped else "")
    return count


__all__ = ["check", "quantize_int8", "int8_linear", "quantize_model_"]

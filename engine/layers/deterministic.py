"""Deterministic mode (`EngineConfig.deterministic`): a request's tokens and logprobs bitwise the same
whatever batch it shares steps with, whether its prompt ran in one prefill or in chunks, came from the
prefix cache or was recomputed after a preemption. Everything that reduces over a row must then compute
a row the same way however many rows the call holds (benchmarks/deterministic.py --ops measures which
do not by default):

- Linear layers: MKL's float32 GEMM (torch's default on CPU) sums a row in another order for 1-3 rows,
  and for 5-11 rows split over two threads. oneDNN's inner product over a weight packed once does not
  (measured, float32 and bfloat16, 1 to 1000 rows), and is faster than MKL on AMD CPUs from 2 rows up.
  Rows go in calls of a few fixed sizes (BUCKETS, so that oneDNN builds a handful of kernels per shape),
  and at load every size is checked on random rows against the largest: a machine where one differs
  gets fixed calls of FIXED_TILE rows for that shape instead (slower, invariant by construction).
- Attention: pagoda's C++ op with every token in a tile of its own (batch_invariant) and never torch's
  flash attention for long prompts, so a token's attention is the decode path's wherever it runs.
- Norms and SiLU: pagoda's fused C++ ops in every dtype (one row at a time, the same loop for each row);
  torch's SiLU computes a tensor's last few elements in scalar code, which rounds otherwise.
- Top logprobs: always the 20 most likely (the model runner): torch's topk orders tied values by
  another algorithm for another k, and k was the largest any row of the step asked for.
- Tensor parallelism: row-parallel outputs gathered and summed in rank order.
Softmax, log-softmax, argmax, layer norm, rotary, the sampler's element-wise ops and the seeded
exponential race already compute each row on its own. CPU only: the Triton kernels split work by size.
"""
import bisect
import logging

import torch
import torch.nn.functional as F

from pagoda.engine import loader
from pagoda.engine.layers.attention import PLAIN

log = logging.getLogger("pagoda.engine")

BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)  # rows per oneDNN call
FIXED_TILE = 16
# calls of at most this many rows run on one thread: oneDNN splits even one row over the threads, which
# costs more than it saves, and on a busy machine a descheduled thread holds the call at the barrier
# (measured: 2-100x slower for a decode step's one row with other processes on the cores; MKL keeps it on one)
ONE_THREAD_ROWS = 8
ALIGN = 64  # bytes; rows handed to oneDNN start on a cache line
# activations whose every element is computed by the same code (the fused C++ SiLU; GPT-2's tanh GELU is
# built from element-wise ops whose vector and scalar code agree, MKL's tanh included), by architecture
ACTIVATIONS = {"GPT2LMHeadModel": ("activation_function", "gelu_new"),
               # Gemma's GeGLU (gelu_pytorch_tanh: one torch kernel, its vector and scalar tails differ) is refused
               "Gemma2ForCausalLM": ("hidden_activation", "silu"), "Gemma3ForCausalLM": ("hidden_activation", "silu")}
DEFAULT_ACTIVATION = ("hidden_act", "silu")


def _gguf_blocks(hf_config) -> list[str]:
    """The block types of a GGUF checkpoint's tensors (engine/gguf.py load_config), floats left out."""
    types = (getattr(hf_config, "gguf", None) or {}).get("types", ())
    return [t for t in types if t not in ("F32", "F16", "BF16")]


def check(config, device: torch.device, hf_config=None, architecture: str | None = None) -> None:
    """ValueError naming the option, where deterministic mode cannot hold its promise."""
    if not config.deterministic:
        return
    why = None
    if device.type != "cpu":
        why = (f"it runs on CPU only (on {device.type} the Triton kernels split their work by batch size); "
               f"use device=cpu or leave deterministic off")
    elif config.quantization is not None:
        why = f"quantization {config.quantization!r} has no batch-invariant kernel yet; leave quantization off"
    elif _gguf_blocks(hf_config):
        why = (f"{hf_config.gguf['file']} holds {', '.join(_gguf_blocks(hf_config))} blocks, which have no "
               f"batch-invariant kernel yet; use a GGUF file in F32, F16 or BF16")
    elif config.dtype == "float16":
        why = "float16 has no batch-invariant linear kernel on CPU; use dtype float32 or bfloat16"
    elif config.attention_backend not in ("auto", "cpu"):
        why = f"it needs attention_backend cpu (pagoda's C++ op), not {config.attention_backend!r}"
    elif "linear_attention" in (getattr(hf_config, "layer_types", None) or ()):
        why = (f"{architecture}'s linear-attention layers compute a prompt chunk by chunk, and where the chunks "
               f"fall depends on the batch; leave deterministic off")
    elif architecture == "GptOssForCausalLM":
        why = ("gpt-oss's experts (biases, clamped SwiGLU) run on torch's GEMMs, which are not batch-invariant; "
               "leave deterministic off")
    elif hf_config is not None:
        field, supported = ACTIVATIONS.get(architecture, DEFAULT_ACTIVATION)
        if getattr(hf_config, field, None) != supported:
            why = (f"the model's activation {getattr(hf_config, field, None)!r} has no batch-invariant kernel "
                   f"(supported: {supported})")
    if why:
        raise ValueError(f"deterministic mode: {why}")


def padded_rows(m: int) -> int:
    """The rows a PackedLinear call of m rows runs with (zero rows added): oneDNN keeps a primitive per
    row count it has seen (about 0.3-0.5 MB each, up to its cache's 1,024), so a server whose steps
    take every size up to its budget grew by hundreds of MB; padded, above ONE_THREAD_ROWS to a multiple
    of 4 rows and from 32 rows to 8 sizes per doubling (at most 1/8 more rows), a shape has ~50 sizes
    up to a 2,048-token step. oneDNN computes a row alike whatever the call's size (see BUCKETS)."""
    if m <= ONE_THREAD_ROWS:
        return m
    step = 1 << max(2, m.bit_length() - 4)
    return -(-m // step) * step


def zero_padded(x: torch.Tensor, size: int) -> torch.Tensor:
    # x: [m, in] -> [size, in], a fresh buffer: x's rows, then zero rows
    padded = x.new_empty(size, x.shape[1])
    padded[:x.shape[0]] = x
    padded[x.shape[0]:] = 0
    return padded


class PackedLinear:
    """x @ W^T (+ b) through oneDNN's inner product over W packed once for this CPU. Also the default for
    CPU linear layers outside deterministic mode (EngineConfig.cpu_linear, pack_linears_): measured
    faster than torch's default GEMM at the decode and prefill sizes of a 0.5B model, in float32 and bf16."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype | None = None):
        self.dtype = dtype or weight.dtype  # computed in; x and the result stay in theirs
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(self.dtype).contiguous(), None)
        self.bias = None if bias is None else bias.detach().to(self.dtype).contiguous()
        self.op = torch.ops.mkldnn._linear_pointwise.default

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in] -> [num_tokens, out]
        if x.dtype != self.dtype:
            return self(x.to(self.dtype)).to(x.dtype)
        m = x.shape[0]
        size = padded_rows(m)
        return self._run(x.contiguous()) if size == m else self._run(zero_padded(x, size))[:m]

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > ONE_THREAD_ROWS:
            return self.op(x, self.weight, self.bias, "none", [], "")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self.op(x, self.weight, self.bias, "none", [], "")
        finally:
            torch.set_num_threads(threads)


class WidenedLinear:
    """bfloat16 weights computed on in float32, each call widening its layer's weight (pack_linears_ without
    a second copy, on a CPU where bf16 is not native): no memory beyond the bf16 weights but one layer's
    float32 copy while it runs."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias  # the layer's own, not copies

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in] bf16 -> [num_tokens, out] bf16
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)


def computes_bf16() -> bool:
    """Whether bfloat16 linears compute in bf16 here: the CPU has native bf16 (loader.native_bf16) and oneDNN
    may use it (not capped below AVX-512 by ONEDNN_MAX_CPU_ISA). Elsewhere oneDNN emulates bf16 (2-3x float32's
    time at a 128-token prefill, AVX-512 without bf16) or cannot pack it at all (AVX2 only), leaving torch's
    bf16 GEMM, ~100x float32's: pack_linears_ then computes calls of many rows in float32 over bf16 weights."""
    return loader.native_bf16() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class BatchInvariantLinear(PackedLinear):
    """A PackedLinear called with `buckets` rows at a time (the last zero-padded)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, buckets=BUCKETS):
        try:
            super().__init__(weight, bias)
        except RuntimeError as e:  # bfloat16 on a CPU without AVX-512 (torch: "bf16 path needs ...")
            raise ValueError(f"deterministic mode: oneDNN cannot run {str(weight.dtype).removeprefix('torch.')} "
                             f"linear layers on this CPU ({str(e).splitlines()[0]}); use dtype float32") from None
        self.buckets = buckets

    @property
    def buckets(self) -> tuple[int, ...]:
        return self._buckets

    @buckets.setter
    def buckets(self, sizes) -> None:
        self._buckets, self.top = tuple(sizes), max(sizes)
        self.size_of = [sizes[bisect.bisect_left(sizes, m)] for m in range(self.top + 1)]  # rows -> call size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        if x.dim() == 2 and x.shape[0] <= self.top:  # a step's usual call: no reshaping, no joining
            return self._call(x)
        lead, x = x.shape[:-1], x.reshape(-1, x.shape[-1])
        parts = [self._call(x[a:a + self.top]) for a in range(0, x.shape[0], self.top)]
        y = parts[0] if len(parts) == 1 else torch.cat(parts)
        return y.view(*lead, y.shape[-1])

    def _call(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        size = self.size_of[m]
        if size != m or not x.is_contiguous() or x.data_ptr() % ALIGN:
            x = zero_padded(x, size)
        y = self._run(x)
        return y if size == m else y[:m]


def rows_agree(f, in_features: int, dtype: torch.dtype, sizes) -> bool:
    """Whether f computes each of random rows bitwise alike in calls of every size in `sizes`, and
    wherever the row sits in the call (checked against the largest size)."""
    g = torch.Generator().manual_seed(0)
    top = max(sizes)
    x = torch.randn(top + 1, in_features, generator=g).to(dtype)
    ref = f(x[:top])
    return all(torch.equal(f(x[top - m:top]), ref[top - m:]) and torch.equal(f(x[1:m + 1])[:m - 1], ref[1:m])
               for m in sizes)


def _buckets_for(weight, bias, dtype, checked: dict) -> tuple[int, ...]:
    key = (tuple(weight.shape), bias is not None, dtype)
    if key not in checked:
        probe = BatchInvariantLinear(weight, bias)
        if rows_agree(probe, weight.shape[1], dtype, BUCKETS):
            checked[key] = BUCKETS
        else:
            log.warning("deterministic mode: oneDNN computes a %s x %s layer's rows differently in calls of "
                        "different sizes on this machine; %d-row calls for it (slower)", *weight.shape[::-1],
                        FIXED_TILE)
            probe.buckets = (FIXED_TILE,)
            if not rows_agree(probe, weight.shape[1], dtype, (FIXED_TILE,)):
                raise RuntimeError(f"deterministic mode: oneDNN's {weight.shape[1]} x {weight.shape[0]} product "
                                   f"depends on a row's place in a call on this machine; leave deterministic off")
            checked[key] = (FIXED_TILE,)
    return checked[key]


def prepare_model_(model: torch.nn.Module, dtype: torch.dtype, fused_ops) -> None:
    """Every linear layer through BatchInvariantLinear (its float weight dropped unless an embedding shares
    it), row-parallel sums in rank order, the fused norms and SiLU in every dtype (the model runner binds
    them for float32; torch's rotary in other dtypes is products and sums, alike for every row)."""
    from pagoda.engine.executor import parallel
    from pagoda.engine.layers.rotary import RotaryEmbedding
    for m in model.modules():
        if hasattr(type(m), "fused_ops") and not isinstance(m, RotaryEmbedding):
            m.fused_ops = fused_ops
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    checked: dict = {}
    for m in model.modules():
        if isinstance(m, parallel.Linear):
            with torch.no_grad():
                buckets = _buckets_for(m.weight, m.bias, dtype, checked)
                m.batch_invariant = BatchInvariantLinear(m.weight, m.bias, buckets)
            if id(m.weight) not in embedded:
                m.weight = None
        if isinstance(m, parallel.RowParallelLinear):
            m.reduce = parallel.all_reduce_in_rank_order


def pack_linears_(model: torch.nn.Module, keep_weights: bool = False) -> int:
    """Every linear layer through a PackedLinear (outside deterministic mode). Its float weight is dropped
    unless an embedding shares it; with `keep_weights` (pagoda's CPU ops bound) a second copy serves calls
    of a few rows: float32 packed in panels (cpu_ops.PanelLinear, up to its `rows`), bfloat16 column-major
    for the few-row op (up to parallel.FEW_ROWS_PACKED rows): twice the weights' memory, for 1.1-2x on
    those calls. Layers oneDNN cannot pack (int8, float16) keep torch's GEMM. bfloat16 where bf16 is not
    native (computes_bf16): a float32 copy packed (with `keep_weights`: 6 bytes a weight beside float32's 8,
    prompts at float32's speed), else WidenedLinear (the bf16 weights only). Returns how many were packed."""
    from pagoda.engine.executor import parallel
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    widen = not computes_bf16()  # decided once, for the CPU
    count = 0
    for m in model.modules():
        if isinstance(m, parallel.Linear) and m.weight is not None and m.weight.dtype != torch.float16:
            in_float32 = widen and m.weight.dtype == torch.bfloat16
            try:
                with torch.no_grad():
                    m.packed = (WidenedLinear(m.weight, m.bias) if in_float32 and not keep_weights else
                                PackedLinear(m.weight, m.bias, torch.float32 if in_float32 else None))
            except RuntimeError:
                continue
            if id(m.weight) in embedded:
                pass
            elif keep_weights and m.weight.dtype == torch.float32:  # packed in panels for calls of a few rows
                from pagoda.engine.layers.cpu_ops import PanelLinear
                with torch.no_grad():
                    m.panels = PanelLinear(m.weight, m.bias)
                m.weight = None
            elif keep_weights or isinstance(m.packed, WidenedLinear):  # stored transposed, the few-row op's fast layout
                m.weight.data = m.weight.data.t().contiguous().t()
            else:
                m.weight = None
            count += 1
    return count


class BatchInvariantAttention:
    """pagoda's C++ op (engine/layers/cpu_attention.py), each token computed as a decode token is."""
    __name__ = "cpu_attention (batch-invariant)"

    def __init__(self, backend):
        self.fused_ops, self.cache_views, self.write_kv_cache = backend.fused_ops, backend.cache_views, \
            backend.write_kv_cache
        self.op = backend.ops().paged_attention

    def decode_attention(self, q, k_cache, v_cache, block_tables, context_lens, scale, variant=PLAIN):
        # q: [num_seqs, num_heads, head_dim] -> same shape
        return self.op(q, k_cache, v_cache, block_tables, None, context_lens, scale, True, *variant.op_args)

    def prefill_attention(self, q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
                          max_query_len, variant=PLAIN):
        # q: [num_tokens, num_heads, head_dim] flat over sequences -> same shape
        return self.op(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, True,
                       *variant.op_args)


def attention_backend(backend):
    """The deterministic form of the runner's attention backend; ValueError where there is none."""
    from pagoda.engine.layers import cpu_attention
    if backend is not cpu_attention:
        ok, why = cpu_attention.is_available(torch.device("cpu"))
        raise ValueError(f"deterministic mode needs pagoda's C++ attention op ({why if not ok else 'not selected'})")
    return BatchInvariantAttention(backend)

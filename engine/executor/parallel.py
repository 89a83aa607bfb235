"""Tensor parallelism, Megatron style, over torch.distributed process groups (gloo on CPU, NCCL on
CUDA; the same code for both): the group this process computes in, and the layers that split a
model's weights over it.

Column-parallel layers split their output features (QKV by heads, gate/up by the intermediate
size): no communication. Row-parallel layers split their input features and all-reduce their
output (the bias added once). The embedding and the LM head split the vocabulary (padded to a
multiple of the group size); the embedding all-reduces, the LM head's logits are gathered. With
fewer KV heads than ranks, each rank keeps the KV head its query heads use (replicated, as vLLM).

Each layer records which rows or columns of the checkpoint's tensors it holds (`tp_dim`,
`tp_parts`), so that the loader reads only those (engine/loader.py). The group is set by
`use_group` before a model is built; without one everything is a plain single-device layer."""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.engine.layers.quantization import gguf_embedding, quantized_linear


@dataclass(frozen=True)
class TPGroup:
    rank: int
    size: int
    pg: object = None  # a torch.distributed ProcessGroup (ProcessGroupGloo / ProcessGroupNCCL)


# the group the layers being built belong to (each layer keeps its own: a process may run several
# engines, one by one, and the engine loop may run in another thread than the one that built it)
_local = threading.local()
_SINGLE = TPGroup(0, 1)


def group() -> TPGroup:
    return getattr(_local, "group", _SINGLE)


def use_group(g: TPGroup | None) -> None:
    _local.group = g or _SINGLE


@dataclass(frozen=True)
class Stage:
    """A pipeline stage (engine/executor/pipeline.py): a contiguous share of the decoder layers, split as
    evenly as they go (the first stages one more). The first stage also holds the embedding and the LM head
    (the driver samples), the last the final norm."""
    index: int = 0
    size: int = 1

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.size - 1

    def layers(self, num_layers: int) -> range:
        per, extra = divmod(num_layers, self.size)
        start = self.index * per + min(self.index, extra)
        return range(start, start + per + (self.index < extra))


def stage() -> Stage:
    """The pipeline stage of the model being built (set by use_stage, as the group by use_group)."""
    return getattr(_local, "stage", None) or Stage()


def use_stage(s: Stage | None) -> None:
    _local.stage = s


def check_splits(cfg, size: int) -> None:
    """ValueError, naming what does not divide, if a model of this HF config cannot be split over
    `size` ranks (the layers' own checks, run before any rank starts)."""
    heads = getattr(cfg, "num_attention_heads", None) or cfg.n_head
    inner = getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * cfg.n_embd
    use_group(TPGroup(0, size))
    try:
        split(heads, "the number of attention heads")
        kv_heads(getattr(cfg, "num_key_value_heads", None) or heads)
        split(inner, "intermediate_size")
        for name in ("moe_intermediate_size", "shared_expert_intermediate_size",  # mixtures of experts
                     "linear_num_key_heads", "linear_num_value_heads"):  # linear attention (Qwen3.5)
            if getattr(cfg, name, None):
                split(getattr(cfg, name), name)
    finally:
        use_group(None)


def all_reduce(x: torch.Tensor, g: TPGroup) -> torch.Tensor:
    if g.size > 1:
        g.pg.allreduce([x]).wait()
    return x


def all_reduce_in_rank_order(x: torch.Tensor, g: TPGroup) -> torch.Tensor:
    """all_reduce with every element summed rank 0 first, then 1, ... (deterministic mode): a ring
    all-reduce adds each chunk of the buffer in another order, and the chunks move with its size."""
    if g.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(g.size)]
    g.pg.allgather([parts], [x]).wait()
    for p in parts[1:]:
        parts[0] += p
    return parts[0]


def all_gather_last(x: torch.Tensor, g: TPGroup) -> torch.Tensor:
    """x: [n, d] on every rank -> [n, size * d], rank order."""
    if g.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(g.size)]
    g.pg.allgather([parts], [x]).wait()
    return torch.cat(parts, dim=-1)


def split(n: int, what: str) -> int:
    """n split evenly over the group; a clear error where it does not divide."""
    size = group().size
    if n % size:
        raise ValueError(f"tensor_parallel_size {size} must divide {what} ({n})")
    return n // size


def kv_heads(num_kv_heads: int) -> tuple[int, int]:
    """(KV heads this rank holds, the first one's index): a share, or with fewer heads than ranks
    the one head this rank's query heads use (replicated)."""
    g = group()
    if num_kv_heads >= g.size:
        n = split(num_kv_heads, "the number of KV heads")
        return n, g.rank * n
    if g.size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size {g.size} must be a multiple of the number of KV heads "
                         f"({num_kv_heads}) when it exceeds it")
    return 1, g.rank * num_kv_heads // g.size


def _mark(layer: nn.Module, dim: int, parts: dict) -> nn.Module:
    """The checkpoint ranges the layer's weight holds: parts[shard] = [(start, length), ...] along dim
    (shard: the index of a fused piece, e.g. q/k/v, or None)."""
    layer.tp_dim, layer.tp_parts = dim, parts
    return layer


# rows up to which a float32 linear on CPU runs pagoda's op rather than torch's (MKL's sgemm costs a
# weight read per row there: a single stream's verification of 4 proposals cost 4-5x one row's decode),
# and rather than oneDNN's packed weights (about 20 us a call, 1.6-3x the op's time at <= 8 rows;
# oneDNN wins from 16 rows on a 0.5B model's layers: benchmarks/results/log.md, "few-row op or oneDNN")
FEW_ROWS = 64
FEW_ROWS_PACKED = 8  # and for bfloat16 whatever the packing (not measured against AMX: kept low)


class Linear(nn.Linear):
    """nn.Linear, or with weight-only int8 quantization (engine/layers/quantization.py) its int8
    weight and per-output scales in place of the float weight (a GGUF or 4-bit checkpoint's: its blocks, a
    GGUFWeight); in deterministic mode its engine/layers/deterministic.py BatchInvariantLinear."""
    qweight = scales = None
    batch_invariant = None
    packed = None  # engine/layers/deterministic.py PackedLinear: oneDNN over weights packed once (cpu_linear)
    panels = None  # engine/layers/cpu_ops.py PanelLinear (float32 beside `packed`): calls of a few rows
    lora = None  # engine/lora/adapters.py LoRASlots: adapters' per-row updates, added to the output (before a reduce)
    fused_ops = None  # pagoda's CPU ops, bound by the model runner (float32, bfloat16 on CPU): a few rows

    def forward(self, x):
        if self.batch_invariant is not None:
            y = self.batch_invariant(x)
        elif self.qweight is not None:
            y = quantized_linear(x, self)
        elif self.panels is not None and x.dim() == 2 and x.shape[0] <= self.panels.rows:
            y = self.panels(x)
        elif self.fused_ops is not None and self.weight is not None and x.dim() == 2 and x.shape[0] <= (
                FEW_ROWS if self.packed is None and x.dtype == torch.float32 else FEW_ROWS_PACKED):
            y = self.fused_ops.linear(x, self.weight, self.bias)
        elif self.packed is not None:
            y = self.packed(x)
        else:
            y = F.linear(x, self.weight, self.bias)
        return y if self.lora is None else self.lora.forward(x, y)

    def few_rows_op(self) -> tuple | None:
        """(weight, bias, rows): what forward hands pagoda's CPU op for calls of up to `rows` rows (the panels,
        or the few-row op's weight), for a caller that runs the op itself (models/llama.py FusedDecoderLayer);
        None where such calls take another path (batch-invariant, int8, LoRA, no CPU ops bound)."""
        if self.batch_invariant is not None or self.qweight is not None or self.lora is not None:
            return None
        if self.panels is not None:
            return self.panels.weight, self.panels.bias, self.panels.rows
        if self.fused_ops is None or self.weight is None:
            return None
        rows = FEW_ROWS if self.packed is None and self.weight.dtype == torch.float32 else FEW_ROWS_PACKED
        if self.weight.stride(1) == 1:  # row-major: cpu_ops.linear gives torch the calls above its limit
            rows = min(rows, self.fused_ops.ROW_MAJOR_ROWS)
        return self.weight, self.bias, rows


def column_parallel(in_features: int, out_features: int, bias: bool, pieces=None) -> Linear:
    """Output features split. `pieces`: the fused pieces' (full size, first row, rows held) by shard
    index, when the checkpoint stores them as separate tensors (q/k/v, gate/up) or as one (pieces
    under None as a list)."""
    g = group()
    if pieces is None:
        n = split(out_features, "a layer's output size")
        pieces = {None: [(g.rank * n, n)]}
    local = sum(length for ranges in pieces.values() for _, length in ranges)
    return _mark(Linear(in_features, local, bias=bias), 0, pieces)


class RowParallelLinear(Linear):
    """Input features split; the partial outputs are summed over the group (bias on rank 0 only)."""
    reduce = None  # deterministic mode: all_reduce_in_rank_order; None: all_reduce (looked up per call)

    def __init__(self, in_features: int, out_features: int, bias: bool):
        g = group()
        n = split(in_features, "a layer's input size")
        super().__init__(n, out_features, bias=bias)
        _mark(self, 1, {None: [(g.rank * n, n)]})
        self.tp = g

    def forward(self, x):
        return (self.reduce or all_reduce)(super().forward(x), self.tp)


def _vocab_share(vocab_size: int) -> tuple[int, int, int]:
    """(rows per rank, this rank's first row, rows of the checkpoint it holds)."""
    g = group()
    per = -(-vocab_size // g.size)
    start = g.rank * per
    return per, start, max(0, min(per, vocab_size - start))


class VocabParallelEmbedding(nn.Embedding):
    """The embedding's rows split by vocabulary; each rank looks up its own ids, zeros elsewhere, summed."""
    qweight = None  # a GGUF checkpoint's blocks (engine/gguf.py GGUFWeight; one rank): rows dequantized as looked up

    def __init__(self, vocab_size: int, dim: int):
        per, self.vocab_start, held = _vocab_share(vocab_size)
        super().__init__(per, dim)
        self.tp = group()
        _mark(self, 0, {None: [(self.vocab_start, held)]})

    def forward(self, ids):
        if self.qweight is not None:
            return gguf_embedding(ids, self.qweight)
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill_(outside[:, None], 0.0), self.tp)


class ParallelLMHead(Linear):
    """The LM head's rows split by vocabulary; logits gathered (padding rows dropped)."""

    def __init__(self, dim: int, vocab_size: int):
        per, start, held = _vocab_share(vocab_size)
        super().__init__(dim, per, bias=False)
        self.vocab_size, self.tp = vocab_size, group()
        _mark(self, 0, {None: [(start, held)]})

    def forward(self, hidden):
        return all_gather_last(super().forward(hidden), self.tp)[:, :self.vocab_size]  # [n, vocab]

"""The Llama family and the decoder parts its relatives share: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3
(q/k norm per head, own head_dim); Granite, SmolLM3, Phi-3 and OLMo 2 (their own files) switch parts on
through Parts."""
from dataclasses import dataclass

import torch
from torch import nn

from pagoda.engine.executor import parallel
from pagoda.engine.layers.activation import activation
from pagoda.engine.layers.attention import Attention, AttentionMetadata, Variant
from pagoda.engine.layers.rotary import RotaryEmbedding, apply_rotary, rotary_dim


class RMSNorm(nn.Module):
    fused_ops = None  # pagoda's CPU ops, bound by the model runner where they are built

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, residual=None):
        """norm(x); with residual: (norm(x + residual), x + residual), the residual add fused in."""
        if residual is not None:
            if self.fused_ops is not None:
                return self.fused_ops.add_rms_norm_(x, residual, self.weight, self.eps), residual
            residual = x + residual
            return self.forward(residual), residual
        if self.fused_ops is not None:
            return self.fused_ops.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


@dataclass(frozen=True)
class Parts:
    """What a family switches on over Llama's layers (each from the checkpoint's config, as transformers reads it)."""
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None  # "head": each head's q and k (Qwen3); "full": the whole projections (OLMo 2)
    attention_scale: float | None = None  # None: head_dim ** -0.5 (Granite: attention_multiplier)
    residual_multiplier: float = 1.0  # Granite: each block's output scaled before its residual add
    embedding_multiplier: float = 1.0  # Granite
    logits_divisor: float = 1.0  # Granite's logits_scaling
    rope_layers: tuple | None = None  # per layer, whether it rotates q and k (SmolLM3's NoPE layers); None: all
    attention_softcap: float = 0.0  # Gemma 2's attn_logit_softcapping
    sinks: bool = False  # a learned logit per head that each softmax also covers (gpt-oss)


LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")  # linear: no KV (linear_attention.py)


def attention_windows(cfg) -> list[int]:
    """layer_windows of the layers that keep KV (not the linear-attention ones)."""
    types = getattr(cfg, "layer_types", None) or [None] * cfg.num_hidden_layers
    return [w for w, t in zip(layer_windows(cfg), types) if t != "linear_attention"]


def layer_windows(cfg) -> list[int]:
    """Each layer's sliding window (0: full attention), as transformers reads the config: `layer_types`, or
    one `sliding_window` for every layer (Mistral), unless use_sliding_window is off (Qwen2)."""
    n, window = cfg.num_hidden_layers, getattr(cfg, "sliding_window", None) or 0
    if window >= (getattr(cfg, "max_position_embeddings", None) or window + 1):
        window = 0  # wider than any context: full attention
    types = getattr(cfg, "layer_types", None)
    if types is None:
        return [window if getattr(cfg, "use_sliding_window", True) else 0] * n
    for i, t in enumerate(types):
        if t not in LAYER_TYPES:
            raise ValueError(f"layer_types[{i}] {t!r} is not a layer type this server runs (one of "
                             f"{', '.join(LAYER_TYPES)})")
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for {n} layers (num_hidden_layers)")
    if "sliding_attention" in types and not window:
        raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
    return [window if t == "sliding_attention" else 0 for t in types]


class LlamaAttention(nn.Module):
    def __init__(self, cfg, parts: Parts, index: int):
        super().__init__()
        # this rank's share of the heads (all of them without tensor parallelism)
        heads = cfg.num_attention_heads
        self.head_dim = hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.num_heads = parallel.split(heads, "the number of attention heads")
        self.num_kv_heads, first_kv = parallel.kv_heads(getattr(cfg, "num_key_value_heads", None) or heads)
        self.q_size, self.kv_size = self.num_heads * hd, self.num_kv_heads * hd
        q_rows, kv_rows = (parallel.group().rank * self.q_size, self.q_size), (first_kv * hd, self.kv_size)
        self.qkv_proj = parallel.column_parallel(cfg.hidden_size, self.q_size + 2 * self.kv_size, parts.qkv_bias,
                                                 pieces={0: [q_rows], 1: [kv_rows], 2: [kv_rows]})
        self.qkv_proj.shard_offsets = (0, self.q_size, self.q_size + self.kv_size)
        kv_all = (getattr(cfg, "num_key_value_heads", None) or heads) * hd
        # a checkpoint that stores q, k and v as one tensor (Phi-3): this rank's rows of each
        self.qkv_proj.tp_parts[None] = [q_rows, (heads * hd + kv_rows[0], kv_rows[1]),
                                        (heads * hd + kv_all + kv_rows[0], kv_rows[1])]
        self.o_proj = parallel.RowParallelLinear(heads * hd, cfg.hidden_size, bias=parts.o_bias)
        use_rope = parts.rope_layers is None or bool(parts.rope_layers[index])
        self.qk_norm, self.use_rope, self.rotary_dim = parts.qk_norm, use_rope, rotary_dim(cfg, hd)
        if parts.qk_norm == "full" and parallel.group().size > 1:
            raise ValueError("q/k norms over the whole projection (OLMo 2) do not split across tensor-parallel "
                             "ranks: use --tensor-parallel-size 1")
        q_dim, k_dim = (self.q_size, self.kv_size) if parts.qk_norm == "full" else (hd, hd)
        self.q_norm = RMSNorm(q_dim, cfg.rms_norm_eps) if parts.qk_norm else None
        self.k_norm = RMSNorm(k_dim, cfg.rms_norm_eps) if parts.qk_norm else None
        scale = parts.attention_scale if parts.attention_scale is not None else hd ** -0.5
        self.sinks = None
        if parts.sinks:  # this rank's heads' (the loader reads them by tp_parts)
            self.sinks = nn.Parameter(torch.empty(self.num_heads))
            self.tp_dim, self.tp_parts = 0, {None: [(q_rows[0] // hd, self.num_heads)]}
        variant = Variant(window=layer_windows(cfg)[index], softcap=parts.attention_softcap, sinks=self.sinks)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale, variant)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.sinks is not None:  # float32 whatever the model's dtype: the attention backends take them so
            self.sinks.data = self.sinks.data.float()
        return self

    def forward(self, rope, x, meta: AttentionMetadata):
        # x: [num_tokens, hidden]; rope: (cos, sin) of each token's position
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        q = q.view(-1, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            q, k = apply_rotary(q, k, rope)
        out = self.attn(q, k, v, meta)
        return self.o_proj(out.flatten(1))


class LlamaMLP(nn.Module):
    fused_ops = None  # pagoda's CPU ops, bound by the model runner where they are built

    def __init__(self, cfg, intermediate_size: int | None = None):
        super().__init__()
        bias = getattr(cfg, "mlp_bias", False)
        full = intermediate_size or cfg.intermediate_size  # another size: a MoE model's dense or shared expert
        self.intermediate_size = n = parallel.split(full, "intermediate_size")
        rows = (parallel.group().rank * n, n)
        self.gate_up_proj = parallel.column_parallel(cfg.hidden_size, 2 * n, bias, pieces={0: [rows], 1: [rows]})
        self.gate_up_proj.shard_offsets = (0, n)
        self.gate_up_proj.tp_parts[None] = [rows, (full + rows[0], n)]  # stored as one (Phi-3)
        self.down_proj = parallel.RowParallelLinear(full, cfg.hidden_size, bias=bias)
        act = getattr(cfg, "hidden_activation", None) or cfg.hidden_act  # Gemma's name
        self.act = activation(act)
        self.is_silu = act == "silu"

    def forward(self, x):
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate]
        if self.fused_ops is not None and self.is_silu:
            return self.down_proj(self.fused_ops.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


class LlamaDecoderLayer(nn.Module):
    fused = None  # FusedDecoderLayer, bound by the model runner where the layer qualifies (fuse_decoder_layer)

    def __init__(self, cfg, parts: Parts, index: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, parts, index)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.residual_multiplier = parts.residual_multiplier

    def forward(self, rope, x, residual, meta):
        # the layer's input is x + residual (residual None: just x, the first layer); the residual
        # adds are folded into the norms that follow them
        if self.fused is not None and x.shape[0] <= self.fused.rows:
            return self.fused(rope, x, residual, meta)
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        m = self.residual_multiplier
        x = self.self_attn(rope, x, meta)
        x, residual = self.post_attention_layernorm(x if m == 1 else x * m, residual)
        x = self.mlp(x)
        return x if m == 1 else x * m, residual


class FusedDecoderLayer:
    """A decoder layer of up to `rows` rows as one CPU op (csrc/decoder_layer_cpu.cpp): the layer's own ops
    in its order, so bitwise its result, without the Python between them (about 0.1 ms a layer: a fifth of
    a one-stream step on a small model; docs/performance.md "One op a layer")."""

    def __init__(self, layer: LlamaDecoderLayer, ops, linears: list[tuple], max_rows: int | None):
        # linears: (weight, bias, rows) of qkv, o, gate_up and down, as parallel.Linear.few_rows_op gives them
        a, mlp = layer.self_attn, layer.mlp
        (qkv, qkv_b, _), (o, o_b, _), (gu, gu_b, _), (down, down_b, _) = linears
        self.rows = min([rows for _, _, rows in linears] + ([] if max_rows is None else [max_rows]))
        q_norm, k_norm = (None if n is None else n.weight for n in (a.q_norm, a.k_norm))
        self.weights = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight, qkv, qkv_b, q_norm,
                        k_norm, o, o_b, gu, gu_b, down, down_b]
        self.sizes = [a.num_heads, a.num_kv_heads, a.head_dim, a.o_proj.out_features, mlp.intermediate_size]
        self.eps, self.attn, self.ops = layer.input_layernorm.eps, a.attn, ops

    def __call__(self, rope, x, residual, meta: AttentionMetadata):
        a = self.attn
        if a.kv_group:
            meta = meta.of_group(a.kv_group)
        return self.ops.decoder_layer(
            x, residual, self.weights, self.sizes, self.eps, a.scale, rope.positions, rope.cos, rope.sin,
            a.k_cache, a.v_cache, meta.slot_mapping, meta.num_decode_tokens, meta.decode_block_tables,
            meta.decode_context_lens, meta.prefill_block_tables, meta.prefill_query_start_loc,
            meta.prefill_context_lens)


def fuse_decoder_layer(layer: LlamaDecoderLayer, ops, backend) -> FusedDecoderLayer | None:
    """The layer as one op where its own path for a few rows is that op's: every linear through pagoda's CPU
    op (panels or the few-row op: no LoRA, int8 or batch-invariant mode) and no tensor parallelism, the CPU
    ops bound for norms, SiLU and rotary, attention by `backend` (engine/layers/cpu_attention.py); `rows`
    stays below the prompt length from which that backend hands a prompt to SDPA."""
    a, mlp = layer.self_attn, layer.mlp
    linears = [m.few_rows_op() for m in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    norms = [layer.input_layernorm, layer.post_attention_layernorm] + [n for n in (a.q_norm, a.k_norm) if n]
    if None in linears or a.o_proj.tp.size > 1 or mlp.down_proj.tp.size > 1:
        return None
    if not (a.use_rope and a.qk_norm != "full" and layer.residual_multiplier == 1 and a.rotary_dim == a.head_dim
            and a.attn.variant.is_plain):
        return None  # parts the op does not have
    if not (mlp.is_silu and mlp.fused_ops is not None and all(n.fused_ops is not None for n in norms)
            and len({n.eps for n in norms}) == 1 and a.attn.backend is backend and a.attn.k_scale is None):
        return None
    least = backend.sdpa_min_tokens(a.head_dim)
    return FusedDecoderLayer(layer, ops, linears, None if least is None else least - 1)


class LlamaForCausalLM(nn.Module):
    # checkpoint name piece -> (our fused parameter piece, shard index)
    packed = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    layer_class = LlamaDecoderLayer

    def __init__(self, cfg, parts: Parts | None = None):
        super().__init__()
        bias = getattr(cfg, "attention_bias", False)
        self.parts = parts = parts or Parts(qkv_bias=bias, o_bias=bias)
        # a pipeline stage (engine/executor/pipeline.py) builds its own layers only, the others placeholders (so
        # layer i keeps its checkpoint name); the first stage the embedding and LM head, the last the final norm
        self.stage = stage = parallel.stage()
        self.stage_layers = owned = stage.layers(cfg.num_hidden_layers)
        self.embed_tokens = parallel.VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size) if stage.first else None
        self.layers = nn.ModuleList(self.layer_class(cfg, parts, i) if i in owned else nn.Identity()
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if stage.last else None
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.rotary = RotaryEmbedding(cfg, head_dim, cfg.max_position_embeddings)
        self.lm_head = parallel.ParallelLMHead(cfg.hidden_size, cfg.vocab_size) if stage.first else None
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if self.tie_word_embeddings and stage.first:
            self.lm_head.weight = self.embed_tokens.weight
        if stage.size > 1:  # the other stages' tensors skipped, whatever name the family maps them to
            mapped = self.checkpoint_name
            self.checkpoint_name = lambda name: self._on_stage(mapped(name))

    def forward(self, input_ids, positions, meta: AttentionMetadata, hidden=None):
        # input_ids, positions: [num_tokens] -> hidden: [num_tokens, hidden]. A later pipeline stage starts from
        # `hidden`, the previous stage's output; a stage before the last returns its layers' x + residual
        if hidden is None:
            hidden = self.embed_tokens(input_ids)
            if self.parts.embedding_multiplier != 1:
                hidden = hidden * self.parts.embedding_multiplier
        x, residual = hidden, None
        rope = self.rotary(positions, x.dtype)
        for layer in self.layers[self.stage_layers.start:self.stage_layers.stop]:
            x, residual = layer(rope, x, residual, meta)
        if not self.stage.last:
            return x + residual  # the next stage's layer input
        return self.norm(x, residual)[0]

    def _on_stage(self, mapped):
        """A checkpoint tensor's (parameter name, shard), or None where another pipeline stage holds it."""
        if mapped is None:
            return None
        top, _, rest = mapped[0].partition(".")
        if top == "layers":
            held = int(rest.split(".", 1)[0]) in self.stage_layers
        else:
            held = {"norm": self.stage.last, "embed_tokens": self.stage.first, "lm_head": self.stage.first}.get(top, True)
        return mapped if held else None

    def compute_logits(self, hidden):
        logits = self.lm_head(hidden)  # [num_seqs, vocab]
        return logits if self.parts.logits_divisor == 1 else logits / self.parts.logits_divisor

    def checkpoint_name(self, name: str) -> tuple[str, int | None] | None:
        """Map a checkpoint tensor name to (our parameter name, shard index), or None to skip."""
        name = name.removeprefix("model.")
        if "rotary_emb.inv_freq" in name:
            return None
        if self.tie_word_embeddings and name == "lm_head.weight":
            return None
        for piece, (fused, shard) in self.packed.items():
            if f".{piece}." in name:
                return name.replace(piece, fused), shard
        return name, None


def qwen2(cfg):
    return LlamaForCausalLM(cfg, Parts(qkv_bias=True))


def qwen3(cfg):
    bias = getattr(cfg, "attention_bias", False)
    return LlamaForCausalLM(cfg, Parts(qkv_bias=bias, o_bias=bias, qk_norm="head"))

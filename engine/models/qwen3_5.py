"""Qwen3.5 (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, and the language model of their
...ForConditionalGeneration checkpoints) and Qwen3-Next (Qwen3NextForCausalLM): hybrid models whose
`layer_types` put a gated DeltaNet (engine/layers/linear_attention.py) in most layers and gated full attention
(an output gate from q_proj, partial rotary, per-head q/k norms) in the others; (1 + w) RMSNorms; a dense
MLP (Qwen3.5) or Qwen2-MoE's experts beside a gated shared expert (Qwen3.5-MoE, Qwen3-Next)."""
import torch
from torch import nn

from pagoda.engine.executor import parallel
from pagoda.engine.layers.linear_attention import GatedDeltaNet
from pagoda.engine.layers.moe import MoeBlock, SparseMoeBlock
from pagoda.engine.layers.rotary import apply_rotary
from pagoda.engine.models.llama import LlamaAttention, LlamaMLP, Parts, RMSNorm
from pagoda.engine.models.mixtral import MixtralForCausalLM

_SKIPPED = ("mtp.", "model.visual.", "visual.")  # multi-token-prediction head, vision tower: not served
_LANGUAGE_MODEL = ("model.language_model.", "model.")  # a ...ForConditionalGeneration checkpoint's text model


def is_hybrid(hf_config) -> bool:
    """Whether the model has linear-attention layers (a state per sequence beside its KV)."""
    return "linear_attention" in (getattr(hf_config, "layer_types", None) or ())


class GatedAttention(LlamaAttention):
    """Qwen3's attention whose q_proj also gives, per head, a gate on the head's output (sigmoid)."""

    def __init__(self, cfg, parts: Parts, index: int):
        super().__init__(cfg, parts, index)
        q2, kv = 2 * self.q_size, self.kv_size
        _, first_kv = parallel.kv_heads(cfg.num_key_value_heads)
        q_rows, kv_rows = (parallel.group().rank * q2, q2), (first_kv * self.head_dim, kv)
        self.qkv_proj = parallel.column_parallel(cfg.hidden_size, q2 + 2 * kv, parts.qkv_bias,
                                                 pieces={0: [q_rows], 1: [kv_rows], 2: [kv_rows]})
        self.qkv_proj.shard_offsets = (0, q2, q2 + kv)

    def forward(self, rope, x, meta):
        # x: [num_tokens, hidden]; each head's q_proj rows: its query, then its gate
        qg, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        qg = qg.view(-1, self.num_heads, 2 * self.head_dim)
        q, gate = qg[..., :self.head_dim].contiguous(), qg[..., self.head_dim:]
        q = self.q_norm(q)  # [num_tokens, num_heads, head_dim]
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim))
        q, k = apply_rotary(q, k, rope)
        out = self.attn(q, k, v.reshape(-1, self.num_kv_heads, self.head_dim), meta)
        return self.o_proj((out * torch.sigmoid(gate)).flatten(1))


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg, parts: Parts, index: int):
        super().__init__()
        self.is_linear = cfg.layer_types[index] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg, parts, index)
        self.mlp = self.make_mlp(cfg, index)
        self.is_moe = isinstance(self.mlp, MoeBlock)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @staticmethod
    def make_mlp(cfg, index: int) -> nn.Module:
        if not getattr(cfg, "num_experts", 0):
            return LlamaMLP(cfg)
        if index in (getattr(cfg, "mlp_only_layers", None) or ()) or (index + 1) % getattr(
                cfg, "decoder_sparse_step", 1):
            return LlamaMLP(cfg)
        return SparseMoeBlock(cfg, getattr(cfg, "norm_topk_prob", True), round_weights=True,
                              shared_expert=LlamaMLP(cfg, cfg.shared_expert_intermediate_size))

    def forward(self, rope, x, residual, meta):
        # the layer's input is x + residual (residual None: just x); the residual adds are folded into the norms
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.linear_attn(x, meta) if self.is_linear else self.self_attn(rope, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return (self.mlp(x, meta) if self.is_moe else self.mlp(x)), residual


class Qwen3_5ForCausalLM(MixtralForCausalLM):
    layer_class = HybridDecoderLayer

    def __init__(self, cfg):
        bias = getattr(cfg, "attention_bias", False)
        super().__init__(cfg, Parts(qkv_bias=bias, o_bias=bias, qk_norm="head"))

    def checkpoint_name(self, name: str):
        if name.startswith(_SKIPPED):
            return None
        if name.startswith(_LANGUAGE_MODEL[0]):
            name = _LANGUAGE_MODEL[1] + name[len(_LANGUAGE_MODEL[0]):]
        for piece, shard in (("in_proj_qkv.", 0), ("in_proj_z.", 1), ("in_proj_b.", 0), ("in_proj_a.", 1)):
            if f".linear_attn.{piece}" in name:
                fused = "in_proj_ba." if piece in ("in_proj_b.", "in_proj_a.") else "in_proj_qkvz."
                return name.replace(piece, fused).removeprefix("model."), shard
        return super().checkpoint_name(name)

    def transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The (1 + w) norms stored as 1 + w, so that the shared RMSNorm (and its CPU op) computes them; the
        gated norm of the linear-attention layers scales by w itself."""
        if name.endswith("norm.weight") and ".linear_attn." not in name:
            return tensor + 1.0
        return tensor


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    def transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Qwen3-Next stores q, k, v, z (and b, a) grouped per key head: reordered into Qwen3.5's layout."""
        if name.endswith(("in_proj_qkvz.weight", "in_proj_ba.weight")):
            layer = next(m for m in self.modules() if isinstance(m, GatedDeltaNet))
            return _per_key_head_to_blocks(layer, name, tensor)
        return super().transform(name, tensor)


def _per_key_head_to_blocks(m: GatedDeltaNet, name: str, w: torch.Tensor) -> torch.Tensor:
    # w: [num_k_heads * (pieces of one key head), hidden] -> each piece's rows for every head, piece after piece
    r = m.num_v_heads // m.num_k_heads
    if name.endswith("in_proj_ba.weight"):
        sizes = [r, r]
    else:
        sizes = [m.head_k_dim, m.head_k_dim, r * m.head_v_dim, r * m.head_v_dim]
    pieces = w.view(m.num_k_heads, sum(sizes), -1).split(sizes, dim=1)
    return torch.cat([p.reshape(-1, w.shape[-1]) for p in pieces])

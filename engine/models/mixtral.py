"""Mixtral (MixtralForCausalLM): Mistral's attention with a sparse mixture of experts for the MLP (top-k of
the softmax over every expert, renormalised); the decoder layer and checkpoint names the other MoE families
(engine/models/qwen_moe.py) share."""
import re

from torch import nn

from pagoda.engine.layers.moe import MoeBlock, SparseMoeBlock
from pagoda.engine.models.llama import LlamaAttention, LlamaForCausalLM, Parts, RMSNorm

# one expert's projection in a checkpoint -> its piece of our fused weights (0 gate, 1 up, 2 down)
_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_PIECES = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}


class MoeDecoderLayer(nn.Module):
    """Llama's decoder layer with the MLP that make_mlp chooses for the layer (a MoE block for Mixtral)."""

    def __init__(self, cfg, parts: Parts, index: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, parts, index)
        self.mlp = self.make_mlp(cfg, index)
        self.is_moe = isinstance(self.mlp, MoeBlock)  # else a dense MLP (Qwen-MoE's mlp_only_layers)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def make_mlp(self, cfg, index: int) -> nn.Module:
        return SparseMoeBlock(cfg, norm_topk_prob=True, round_weights=False)

    def forward(self, rope, x, residual, meta):
        # the layer's input is x + residual (residual None: just x); the residual adds are folded into the norms
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(rope, x, meta), residual)
        return (self.mlp(x, meta) if self.is_moe else self.mlp(x)), residual


class MixtralForCausalLM(LlamaForCausalLM):
    layer_class = MoeDecoderLayer

    def checkpoint_name(self, name: str):
        """Each expert's projections (w1/w3/w2, or gate/up/down_proj) into the experts' fused weights, shard
        (expert, piece) (engine/layers/moe.py Experts.load_weight); already fused 3-d experts as they are."""
        name = name.replace(".block_sparse_moe.", ".mlp.")
        m = _EXPERT.search(name)
        if m is not None:
            piece = _PIECES[m[2]]
            fused = "down_proj" if piece == 2 else "gate_up_proj"
            return name[:m.start()].removeprefix("model.") + f".experts.{fused}", (int(m[1]), piece)
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            return name.removeprefix("model."), None
        return super().checkpoint_name(name)

"""Qwen2-MoE (Qwen2MoeForCausalLM) and Qwen3-MoE (Qwen3MoeForCausalLM): Qwen2's / Qwen3's attention with a
mixture of experts in the layers `decoder_sparse_step` picks and `mlp_only_layers` does not (a dense MLP
there), top-k weights renormalised where `norm_topk_prob` says; Qwen2-MoE adds a shared expert behind a
sigmoid gate."""
from pagoda.engine.layers.moe import SparseMoeBlock, num_experts
from pagoda.engine.models.llama import LlamaMLP, Parts
from pagoda.engine.models.mixtral import MixtralForCausalLM, MoeDecoderLayer


class QwenMoeDecoderLayer(MoeDecoderLayer):
    def make_mlp(self, cfg, index: int):
        sparse = (index not in (getattr(cfg, "mlp_only_layers", None) or []) and num_experts(cfg) > 0
                  and (index + 1) % getattr(cfg, "decoder_sparse_step", 1) == 0)
        if not sparse:
            return LlamaMLP(cfg)
        shared = getattr(cfg, "shared_expert_intermediate_size", None)
        return SparseMoeBlock(cfg, bool(cfg.norm_topk_prob), round_weights=True,
                              shared_expert=LlamaMLP(cfg, shared) if shared else None)


class QwenMoeForCausalLM(MixtralForCausalLM):
    layer_class = QwenMoeDecoderLayer


def qwen2_moe(cfg):
    return QwenMoeForCausalLM(cfg, Parts(qkv_bias=getattr(cfg, "qkv_bias", True)))


def qwen3_moe(cfg):
    bias = getattr(cfg, "attention_bias", False)
    return QwenMoeForCausalLM(cfg, Parts(qkv_bias=bias, o_bias=bias, qk_norm="head"))

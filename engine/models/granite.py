"""IBM Granite 3.x (GraniteForCausalLM): Llama's layers with four multipliers (embedding, residual,
attention scale, logits)."""
from pagoda.engine.models.llama import LlamaForCausalLM, Parts


def granite(cfg):
    bias = getattr(cfg, "attention_bias", False)
    return LlamaForCausalLM(cfg, Parts(qkv_bias=bias, o_bias=bias, attention_scale=cfg.attention_multiplier,
                                       residual_multiplier=cfg.residual_multiplier,
                                       embedding_multiplier=cfg.embedding_multiplier,
                                       logits_divisor=cfg.logits_scaling))

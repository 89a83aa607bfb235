"""SmolLM3 (SmolLM3ForCausalLM): Llama's layers, every fourth without rotary embeddings (NoPE)."""
from pagoda.engine.models.llama import LlamaForCausalLM, Parts


def smollm3(cfg):
    bias = getattr(cfg, "attention_bias", False)
    rope_layers = tuple(bool(r) for r in cfg.no_rope_layers)  # 1: the layer uses RoPE (transformers' naming)
    return LlamaForCausalLM(cfg, Parts(qkv_bias=bias, o_bias=bias, rope_layers=rope_layers))

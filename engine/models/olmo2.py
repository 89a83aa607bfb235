"""OLMo 2 (Olmo2ForCausalLM): norms after attention and after the MLP (none before), and q/k norms over
the whole projections."""
from pagoda.engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, Parts, RMSNorm
from torch import nn


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, cfg, parts: Parts, index: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, parts, index)
        self.mlp = LlamaMLP(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, rope, x, residual, meta):
        # in: the layer's input is x + residual; out: (the MLP's normed output, the residual stream before it)
        if residual is not None:
            x = x + residual
        x = x + self.post_attention_layernorm(self.self_attn(rope, x, meta))
        return self.post_feedforward_layernorm(self.mlp(x)), x


class Olmo2ForCausalLM(LlamaForCausalLM):
    layer_class = Olmo2DecoderLayer

    def __init__(self, cfg):
        bias = getattr(cfg, "attention_bias", False)
        super().__init__(cfg, Parts(qkv_bias=bias, o_bias=bias, qk_norm="full"))

"""Gemma 2 (Gemma2ForCausalLM) and Gemma 3's text model (Gemma3ForCausalLM, and the language model of a
Gemma3ForConditionalGeneration checkpoint): Llama's attention and MLP (GeGLU)
with norms before and after each block, (1 + w) norms, a scaled embedding, sliding-window layers beside full
ones (each layer type with its own RoPE base in Gemma 3), query_pre_attn_scalar, and Gemma 2's soft-capped
attention scores and logits."""
import torch
from torch import nn

from pagoda.engine.layers.rotary import RotaryEmbedding
from pagoda.engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, Parts, RMSNorm


_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
# (a multimodal checkpoint's prefix, the text model's): transformers' older and newer layouts
_LANGUAGE_MODEL = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                   ("model.language_model.", "model."))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg, parts: Parts, index: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, parts, index)
        self.mlp = LlamaMLP(cfg)
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.is_sliding = self.self_attn.attn.variant.window > 0

    def forward(self, ropes, x, residual, meta):
        # ropes: (full layers', sliding layers'); the layer's input is x + residual (None: just x)
        rope = ropes[self.is_sliding]
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(rope, x, meta))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaForCausalLM(LlamaForCausalLM):
    layer_class = GemmaDecoderLayer

    def __init__(self, cfg):
        super().__init__(cfg, Parts(qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
                                    qk_norm="head" if cfg.model_type.startswith("gemma3") else None,
                                    attention_scale=cfg.query_pre_attn_scalar ** -0.5,
                                    attention_softcap=getattr(cfg, "attn_logit_softcapping", None) or 0.0))
        self.embed_scale = cfg.hidden_size ** 0.5
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None) or 0.0
        head_dim = self.layers[0].self_attn.head_dim
        self.local_rotary = RotaryEmbedding(cfg, head_dim, cfg.max_position_embeddings, "sliding_attention")

    def forward(self, input_ids, positions, meta):
        # input_ids, positions: [num_tokens] -> hidden: [num_tokens, hidden]
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)  # rounded to the model's dtype, as transformers
        ropes = (self.rotary(positions, x.dtype), self.local_rotary(positions, x.dtype))
        residual = None
        for layer in self.layers:
            x, residual = layer(ropes, x, residual, meta)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden):
        logits = self.lm_head(hidden)  # [num_seqs, vocab]
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def checkpoint_name(self, name: str):
        """A Gemma3ForConditionalGeneration checkpoint's language model under its text model's names; its
        vision tower and projector are not loaded (this server takes text)."""
        if name.startswith(_VISION):
            return None
        for prefix, ours in _LANGUAGE_MODEL:
            if name.startswith(prefix):
                name = ours + name[len(prefix):]
        return super().checkpoint_name(name)

    def transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Gemma's norms scale by (1 + w): stored so, the shared RMSNorm (and its CPU op) computes them."""
        return tensor + 1.0 if name.endswith("norm.weight") else tensor

"""gpt-oss (GptOssForCausalLM): attention with q/k/v/o biases and a learned sink logit per head, sliding-window
layers beside full ones (`layer_types`), YaRN RoPE; a mixture of experts whose router takes the top k logits
(router bias included) and a softmax over those k, with biased experts and the clamped SwiGLU. Its experts
are loaded from float tensors, or kept in MXFP4 as gpt-oss ships them (quantization_config mxfp4)."""
from pagoda.engine.layers.moe import GptOssExperts, GptOssRouter, MoeBlock
from pagoda.engine.models.llama import Parts
from pagoda.engine.models.mixtral import MixtralForCausalLM, MoeDecoderLayer


class GptOssMoeBlock(MoeBlock):
    def __init__(self, cfg):
        super().__init__()
        self.router = GptOssRouter(cfg.hidden_size, cfg.num_local_experts, cfg.num_experts_per_tok)
        self.experts = GptOssExperts(cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size,
                                     cfg.swiglu_limit, getattr(cfg, "swiglu_alpha", 1.702), mxfp4=is_mxfp4(cfg))

    def forward(self, x, meta=None):
        # x: [num_tokens, hidden] -> [num_tokens, hidden]
        weights, ids = self.router(x)
        self.count_(ids, meta)
        return self.experts(x, weights, ids)


def is_mxfp4(cfg) -> bool:
    qc = getattr(cfg, "quantization_config", None) or {}
    return (qc if isinstance(qc, dict) else qc.to_dict()).get("quant_method") == "mxfp4"


class GptOssDecoderLayer(MoeDecoderLayer):
    def make_mlp(self, cfg, index: int):
        return GptOssMoeBlock(cfg)


class GptOssForCausalLM(MixtralForCausalLM):
    layer_class = GptOssDecoderLayer

    def __init__(self, cfg):
        qc = getattr(cfg, "quantization_config", None)
        if qc and not is_mxfp4(cfg):
            method = (qc if isinstance(qc, dict) else qc.to_dict()).get("quant_method")
            raise ValueError(f"config.json: gpt-oss with quantization_config {method!r} is not supported (its MXFP4 "
                             f"experts are, and float (bfloat16) weights)")
        bias = getattr(cfg, "attention_bias", True)
        super().__init__(cfg, Parts(qkv_bias=bias, o_bias=bias, sinks=True))

    def checkpoint_name(self, name: str):
        if ".mlp.experts." in name:  # fused tensors and their biases, as the checkpoint names them
            return name.removeprefix("model."), None
        return super().checkpoint_name(name)

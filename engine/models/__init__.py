"""Architectures pagoda runs, keyed by the `architectures` entry of a checkpoint's config.json."""
from pagoda.engine.models.gemma import GemmaForCausalLM
from pagoda.engine.models.gpt2 import GPT2LMHeadModel
from pagoda.engine.models.gpt_oss import GptOssForCausalLM
from pagoda.engine.models.granite import granite
from pagoda.engine.models.llama import LlamaForCausalLM, attention_windows, qwen2, qwen3
from pagoda.engine.models.mixtral import MixtralForCausalLM
from pagoda.engine.models.olmo2 import Olmo2ForCausalLM
from pagoda.engine.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3NextForCausalLM
from pagoda.engine.models.qwen_moe import qwen2_moe, qwen3_moe
from pagoda.engine.models.smollm3 import smollm3

MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": qwen2,
    "Qwen3ForCausalLM": qwen3,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "GraniteForCausalLM": granite,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,  # q/k/v and gate/up stored fused: LlamaAttention/LlamaMLP load either
    "SmolLM3ForCausalLM": smollm3,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": qwen2_moe,
    "Qwen3MoeForCausalLM": qwen3_moe,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
}


def architecture_of(hf_config) -> str:
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in MODELS:
            return arch
    raise ValueError(f"model architecture {archs or hf_config.model_type!r} is not supported; "
                     f"supported: {', '.join(MODELS)}")


def build_model(hf_config):
    return MODELS[architecture_of(hf_config)](hf_config)


def kv_windows(hf_config, *drafts) -> list[int]:
    """Each attention layer's window as the KV cache keeps it (engine/core/block_manager.py kv_groups): its
    sliding window, or 0 for the whole context. A draft model reads the first group's blocks (the narrowest
    window's), so where a draft sees further back than that, every layer keeps the whole context."""
    windows = attention_windows(hf_config)
    draft = [w for cfg in drafts for w in attention_windows(cfg)]
    if draft and min(windows) and (0 in draft or max(draft) > min(windows)):
        return [0] * len(windows)
    return windows

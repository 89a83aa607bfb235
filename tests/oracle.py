"""The oracle the engine's outputs are checked against: transformers' own implementation of the same
checkpoint (with PEFT for a LoRA adapter), greedy, in float32; and the random adapters PEFT makes."""
import random

import peft
import torch
import transformers

LORA_TARGETS = {"gpt2": ["c_attn", "c_proj", "c_fc"], "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
                "default": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
_GREEDY: dict = {}


def random_prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def greedy(path: str, prompts: list[list[int]], max_new: int, adapter: str | None = None) -> list[list[int]]:
    """transformers' (+ PEFT's, with `adapter`) greedy continuations of each prompt, float32 (remembered
    for the session: several tests ask for the same ones)."""
    key = (path, adapter, tuple(map(tuple, prompts)), max_new)
    if key not in _GREEDY:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        if adapter is not None:
            model = peft.PeftModel.from_pretrained(model, adapter)
        model.eval()
        outs = []
        with torch.no_grad():
            for p in prompts:
                ids = torch.tensor([p])
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=max_new, pad_token_id=0)
                outs.append(out[0, len(p):].tolist())
        _GREEDY[key] = outs
    return [list(o) for o in _GREEDY[key]]


def with_biases(path: str, seed: int = 0) -> transformers.PreTrainedModel:
    """transformers' float32 model of a checkpoint whose all-zero biases (gpt-oss's random init leaves its
    attention and expert biases zero) are drawn from N(0, 0.3), so that their loading is what a test checks."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") and not p.abs().any():
                p.normal_(0, 0.3)
    return model


def make_adapter(base: str, out: str, seed: int, r: int = 8, alpha: int = 16, targets=None, **options) -> str:
    """A PEFT LoRA adapter of `base` with random non-zero A and B, saved to `out`."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    family = model.config.model_type if model.config.model_type in LORA_TARGETS else "default"
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or LORA_TARGETS[family],
                             lora_dropout=0.0, **options)
    model = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    model.save_pretrained(out)
    return out

import os

# Triton reads this when its kernels are defined; set before anything imports them, so the
# Triton attention backend runs under the interpreter on CPU.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests share two cores (with each other under xdist, and with whatever else runs): OpenMP threads that
# spin while they wait would take the core from the test that has work (the CLI sets the same for itself).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402

from pagoda.engine.demo import build_tiny_checkpoint  # noqa: E402

# Tiny checkpoints of every supported family; peaky random weights (a wide init) keep greedy
# choices far from ties, so float32 rounding differences cannot flip them.
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
              linear_conv_kernel_dim=4)
FAMILIES = {
    "llama": dict(arch="llama", initializer_range=0.3),
    "llama3": dict(arch="llama", initializer_range=0.3, rope_theta=500000.0, max_position_embeddings=1024,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 256}),
    "llama-untied": dict(arch="llama", initializer_range=0.3, tie_word_embeddings=False, attention_bias=True),
    # Mistral v0.1's sliding window, small enough that prompts and continuations cross it
    "mistral": dict(arch="mistral", initializer_range=0.3, sliding_window=16),
    "qwen2": dict(arch="qwen2", initializer_range=0.3),
    "qwen3": dict(arch="qwen3", initializer_range=0.3, head_dim=48),
    "gpt2": dict(arch="gpt2", initializer_range=0.3),
    # Llama's relatives: each with the parts it switches on made to matter (multipliers far from 1, half the
    # layers without RoPE, half of each head rotated)
    "granite": dict(arch="granite", initializer_range=0.3, embedding_multiplier=3.0, residual_multiplier=0.5,
                    attention_multiplier=0.2, logits_scaling=2.0),
    "olmo2": dict(arch="olmo2", initializer_range=0.3),
    "smollm3": dict(arch="smollm3", initializer_range=0.3, no_rope_layer_interval=2),
    "phi3": dict(arch="phi3", initializer_range=0.3, partial_rotary_factor=0.5),
    # Gemma: windows of 16 beside full layers, soft-capped scores and logits (2), a RoPE base per layer type
    # with linear scaling on the full layers (3); untied, as a random tied head makes one token win every step
    "gemma2": dict(arch="gemma2", initializer_range=0.3, tie_word_embeddings=False, sliding_window=16, head_dim=16,
                   query_pre_attn_scalar=24, attn_logit_softcapping=3.0, final_logit_softcapping=5.0),
    "gemma3": dict(arch="gemma3", initializer_range=0.3, tie_word_embeddings=False, sliding_window=16, head_dim=16,
                   query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}),
    # mixtures of experts: 8 experts, top 2 (Qwen2-MoE: a shared expert beside them; Qwen3-MoE: a dense first layer)
    "mixtral": dict(arch="mixtral", initializer_range=0.3, num_local_experts=8, num_experts_per_tok=2,
                    intermediate_size=32),
    "qwen2_moe": dict(arch="qwen2_moe", initializer_range=0.3, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=64),
    "qwen3_moe": dict(arch="qwen3_moe", initializer_range=0.3, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0], head_dim=16),
    # gpt-oss: sinks, a window of 16 beside a full layer, YaRN (factor 4 over 128 positions); a swiglu_limit the
    # random activations reach
    "gpt_oss": dict(arch="gpt_oss", initializer_range=0.3, num_local_experts=8, num_experts_per_tok=2,
                    intermediate_size=32, head_dim=16, sliding_window=16, swiglu_limit=2.0,
                    layer_types=["sliding_attention", "full_attention"],
                    rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 128,
                                     "rope_theta": 150000.0}),
    # hybrid linear attention: three gated DeltaNet layers, then a gated full-attention one (a quarter of each
    # head rotated); 4 value heads over 2 key heads. Qwen3.5-MoE and Qwen3-Next route 8 experts, top 2, beside a
    # gated shared expert (Qwen3-Next: a dense first layer)
    "qwen3_5": dict(arch="qwen3_5", initializer_range=0.3, num_hidden_layers=4, head_dim=16, **LINEAR),
    "qwen3_5_moe": dict(arch="qwen3_5_moe", initializer_range=0.3, num_hidden_layers=4, head_dim=16, num_experts=8,
                        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                        **LINEAR),
    "qwen3_next": dict(arch="qwen3_next", initializer_range=0.3, num_hidden_layers=4, head_dim=16, num_experts=8,
                       num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                       mlp_only_layers=[0], **LINEAR),
}


def pytest_xdist_auto_num_workers(config):
    """-n auto: a worker per core, at most 4 (each loads torch and builds engines; more would wait on
    memory and on each other's servers rather than go faster)."""
    return max(1, min(4, os.cpu_count() or 1))

HYBRID = ("qwen3_5", "qwen3_5_moe", "qwen3_next")  # linear-attention layers beside attention (a state per sequence)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(name) -> path of a tiny checkpoint of that family, built once per session."""
    built = {}

    def get(name: str) -> str:
        if name not in built:
            path = str(tmp_path_factory.mktemp(name))
            built[name] = build_tiny_checkpoint(path, **FAMILIES[name])
        return built[name]
    return get

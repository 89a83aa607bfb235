"""The gated delta rule and the causal conv1d of linear-attention layers (Qwen3.5, Qwen3-Next's gated DeltaNet),
over a step's flat batch of sequences, each reading and updating its own state slot in place.

A sequence of one token takes the recurrent step; a longer one (a prefill chunk) the chunked form (chunks of
CHUNK tokens: within a chunk, a triangular solve; between chunks, the recurrence), starting from its slot's state,
so a prompt may be cut into chunks of any size. A slot's state is zero at a sequence's start (the layer clears
it: engine/layers/linear_attention.py).

Each public function runs Triton kernels on CUDA (triton_delta_rule.py), pagoda's C++ ops on CPU where they are
loaded (csrc/delta_rule_cpu.cpp; the CPU backend loads them), else its torch reference (`*_reference`), which
is also the oracle both kernels are tested against."""
import torch
import torch.nn.functional as F

from pagoda.engine.layers import cpu_ops

CHUNK = 64


def causal_conv1d(x, weight, conv_state, query_start_loc, state_slots):
    """Depthwise causal conv1d with SiLU, continuing each sequence from its slot's last inputs (in place).
    Shapes as causal_conv1d_reference."""
    if x.is_cuda:
        from pagoda.engine.layers import triton_delta_rule
        return triton_delta_rule.causal_conv1d(x, weight, conv_state, query_start_loc, state_slots)
    if (ops := _cpu_ops(x)) is not None:
        return ops.causal_conv1d_(x, weight, conv_state, query_start_loc, state_slots)
    return causal_conv1d_reference(x, weight, conv_state, query_start_loc, state_slots)


def gated_delta_rule(q, k, v, g, beta, state, query_start_loc, state_slots):
    """The gated delta rule over each sequence from its slot's state (in place). Shapes as gated_delta_rule_reference."""
    if v.is_cuda:
        from pagoda.engine.layers import triton_delta_rule
        return triton_delta_rule.gated_delta_rule(q, k, v, g, beta, state, query_start_loc, state_slots)
    if (ops := _cpu_ops(v)) is not None:
        return ops.gated_delta_rule_(q, k, v, g, beta, state, query_start_loc, state_slots)
    return gated_delta_rule_reference(q, k, v, g, beta, state, query_start_loc, state_slots)


def _cpu_ops(x):
    # the C++ ops take float32 and bfloat16; they are used where already loaded, never built here
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
        return cpu_ops.loaded()
    return None


def causal_conv1d_reference(x, weight, conv_state, query_start_loc, state_slots):
    """Depthwise causal conv1d with SiLU, continuing each sequence from its slot's last inputs.
    x: [num_tokens, channels]; weight: [channels, kernel]; conv_state: [num_slots, channels, kernel - 1] (updated
    to each sequence's last kernel - 1 inputs); query_start_loc: [num_seqs + 1]; state_slots: [num_seqs].
    Returns [num_tokens, channels]."""
    out = torch.empty_like(x)
    starts = query_start_loc.tolist()
    for i, slot in enumerate(state_slots.tolist()):
        a, b = starts[i], starts[i + 1]
        xs = torch.cat([conv_state[slot], x[a:b].t().to(conv_state.dtype)], dim=1)  # [channels, kernel - 1 + len]
        y = F.conv1d(xs[None].to(weight.dtype), weight[:, None], groups=weight.shape[0])[0]  # [channels, len]
        out[a:b] = F.silu(y).t().to(x.dtype)
        conv_state[slot] = xs[:, xs.shape[1] - conv_state.shape[2]:]
    return out


def l2norm(x, eps: float = 1e-6):
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule_reference(q, k, v, g, beta, state, query_start_loc, state_slots):
    """The gated delta rule, q and k L2-normalised here and q scaled by head_k_dim ** -0.5.
    q, k: [num_tokens, num_k_heads, head_k_dim]; v: [num_tokens, num_v_heads, head_v_dim] (each key head serves
    num_v_heads // num_k_heads consecutive value heads); g (log decay), beta: [num_tokens, num_v_heads];
    state: [num_slots, num_v_heads, head_k_dim, head_v_dim] float32, updated in place; query_start_loc:
    [num_seqs + 1]; state_slots: [num_seqs]. Returns [num_tokens, num_v_heads, head_v_dim] in v's dtype."""
    rep = v.shape[1] // k.shape[1]
    q = l2norm(q.float()).repeat_interleave(rep, dim=1) * q.shape[-1] ** -0.5
    k = l2norm(k.float()).repeat_interleave(rep, dim=1)
    v, g, beta = v.float(), g.float(), beta.float()
    out = torch.empty_like(v)
    starts = query_start_loc.tolist()
    for i, slot in enumerate(state_slots.tolist()):
        a, b = starts[i], starts[i + 1]
        step = _recurrent if b - a == 1 else _chunked
        out[a:b], state[slot] = step(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state[slot])
    return out.to(v.dtype)


def _recurrent(q, k, v, g, beta, s):
    # q, k: [len, heads, dk]; v: [len, heads, dv]; g, beta: [len, heads]; s: [heads, dk, dv]
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        delta = (v[t] - (s * k[t][:, :, None]).sum(1)) * beta[t][:, None]  # [heads, dv]
        s = s + k[t][:, :, None] * delta[:, None, :]
        out[t] = (s * q[t][:, :, None]).sum(1)
    return out, s


def _chunked(q, k, v, g, beta, s):
    # per head, in chunks of CHUNK: [heads, chunks, CHUNK, dim]
    n = q.shape[0]
    pad = -n % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1).unflatten(1, (-1, CHUNK)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, 0, 0, pad)).t().unflatten(1, (-1, CHUNK)) for x in (g, beta))
    decay = g.cumsum(-1)  # [heads, chunks, CHUNK]
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    pair = (decay[..., :, None] - decay[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * pair  # its unit diagonal is implied by the solve
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False,
                                              unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * pair
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    out = torch.empty_like(v)
    for c in range(q.shape[1]):
        v_new = values[:, c] - k_decayed[:, c] @ s
        out[:, c] = q[:, c] @ s + attn[:, c] @ v_new
        s = s * decay[:, c, -1].exp()[:, None, None] + k[:, c].transpose(-1, -2) @ v_new
    return out.flatten(1, 2)[:, :n].transpose(0, 1), s

"""GPT-2: learned positions, LayerNorm, fused c_attn, GELU; Conv1D weights stored transposed."""
import torch
from torch import nn

from pagoda.engine.executor import parallel
from pagoda.engine.layers.activation import activation
from pagoda.engine.layers.attention import Attention, AttentionMetadata


class GPT2Attention(nn.Module):
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.num_heads = parallel.split(cfg.n_head, "the number of attention heads")  # this rank's
        local = self.num_heads * self.head_dim
        first = parallel.group().rank * local
        # c_attn holds q, k and v one after another: this rank's heads of each
        pieces = {None: [(first, local), (cfg.n_embd + first, local), (2 * cfg.n_embd + first, local)]}
        self.c_attn = parallel.column_parallel(cfg.n_embd, 3 * local, True, pieces=pieces)
        self.c_proj = parallel.RowParallelLinear(cfg.n_embd, cfg.n_embd, bias=True)
        scale = self.head_dim ** -0.5 if getattr(cfg, "scale_attn_weights", True) else 1.0
        if getattr(cfg, "scale_attn_by_inverse_layer_idx", False):
            scale /= layer_idx + 1
        self.attn = Attention(self.num_heads, self.num_heads, self.head_dim, scale)

    def forward(self, x, meta: AttentionMetadata):
        # x: [num_tokens, n_embd] -> q, k, v: [num_tokens, num_heads, head_dim]
        q, k, v = self.c_attn(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        return self.c_proj(self.attn(q, k, v, meta).flatten(1))


class GPT2MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        inner = cfg.n_inner or 4 * cfg.n_embd
        self.c_fc = parallel.column_parallel(cfg.n_embd, inner, True)
        self.c_proj = parallel.RowParallelLinear(inner, cfg.n_embd, bias=True)
        self.act = activation(cfg.activation_function)

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = GPT2Attention(cfg, layer_idx)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x, meta):
        x = x + self.attn(self.ln_1(x), meta)
        return x + self.mlp(self.ln_2(x))


class GPT2LMHeadModel(nn.Module):
    _conv1d = ("c_attn.weight", "c_proj.weight", "c_fc.weight")

    def __init__(self, cfg):
        super().__init__()
        self.wte = parallel.VocabParallelEmbedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.h = nn.ModuleList(GPT2Block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", True))
        self.lm_head = parallel.ParallelLMHead(cfg.n_embd, cfg.vocab_size)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.wte.weight

    def forward(self, input_ids, positions, meta: AttentionMetadata):
        x = self.wte(input_ids) + self.wpe(positions)  # [num_tokens, n_embd]
        for block in self.h:
            x = block(x, meta)
        return self.ln_f(x)

    def compute_logits(self, hidden):
        return self.lm_head(hidden)

    def checkpoint_name(self, name: str) -> tuple[str, None] | None:
        name = name.removeprefix("transformer.")
        if name.endswith((".attn.bias", ".attn.masked_bias")):  # causal-mask buffers of old checkpoints
            return None
        if self.tie_word_embeddings and name == "lm_head.weight":
            return None
        return name, None

    def stored_transposed(self, name: str) -> bool:
        return name.endswith(self._conv1d)

    def transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.t() if self.stored_transposed(name) else tensor

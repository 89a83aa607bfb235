"""The MLP activations of the supported families, by the config's name, as transformers computes them
(its ACT2FN names and formulas, op for op, so that float32 outputs stay token-identical). A name not
here comes from transformers.activations, imported only then: importing it costs every process that
builds a model (the engine's, each tensor-parallel rank) about 1.5 s of start-up."""
import math

import torch
from torch import nn


class NewGELU(nn.Module):
    """GPT-2's "gelu_new" (the tanh approximation, written as transformers writes it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class QuickGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


_ACTIVATIONS = {"silu": nn.SiLU, "swish": nn.SiLU, "gelu": nn.GELU, "gelu_new": NewGELU, "relu": nn.ReLU,
                "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"), "quick_gelu": QuickGELU}


def activation(name: str) -> nn.Module:
    if name in _ACTIVATIONS:
        return _ACTIVATIONS[name]()
    from transformers.activations import ACT2FN  # a rarer activation: transformers' own

    return ACT2FN[name]

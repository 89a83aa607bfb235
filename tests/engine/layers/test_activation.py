"""engine/layers/activation.py: the families' activations, bitwise transformers' own (its ACT2FN)."""
import pytest
import torch
from transformers.activations import ACT2FN

from pagoda.engine.layers.activation import activation


@pytest.mark.parametrize("name", ["silu", "swish", "gelu", "gelu_new", "relu", "gelu_pytorch_tanh", "quick_gelu",
                                  "gelu_fast"])  # the last: not ours, transformers' own
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitwise_transformers(name, dtype):
    x = (torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    assert torch.equal(activation(name)(x), ACT2FN[name](x)), name


def test_an_unknown_activation_is_refused():
    with pytest.raises(KeyError, match="nonsense"):
        activation("nonsense")

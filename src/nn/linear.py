"""Linear layers: dense (float weight Tensor) and packed (quantized weight, never expanded)."""
from ..ops.linear import PackedMatmul
from ..tensor import Tensor
from .module import Module


class PackedLinear(Module):
    """A linear layer whose weight (out, in) stays packed in forward and backward."""

    def __init__(self, weight, bias=None):
        self.weight = weight  # PackedWeight, not a parameter
        self.bias = bias
        self.out_features, self.in_features = weight.shape

    def forward(self, x, value=True):
        return PackedMatmul.apply(x, self.bias, weight=self.weight, value=value)

    def __repr__(self):
        return f"PackedLinear({self.in_features}->{self.out_features}, {self.weight.format})"


class Linear(Module):
    """A dense linear layer: y = x @ W.T + b, W a float Tensor (out, in)."""

    def __init__(self, weight: Tensor, bias=None):
        self.weight = weight
        self.bias = bias
        self.out_features, self.in_features = weight.shape

    def forward(self, x, value=True):
        """value: ignored (the product is one recorded matmul; a dense base computes it)."""
        y = x @ self.weight.T
        return y + self.bias if self.bias is not None else y

    def __repr__(self):
        return f"Linear({self.in_features}->{self.out_features}, dense)"

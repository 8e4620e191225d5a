"""Neural-network layers built on packlora ops."""
from .checkpoint import checkpoint
from .layers import Embedding, RMSNorm, gather_packed_rows
from .head_loss import head_cross_entropy
from .linear import Linear, PackedLinear, PackedMatmul
from .module import Module

__all__ = ["Module", "Linear", "PackedLinear", "PackedMatmul", "Embedding", "RMSNorm",
           "checkpoint", "gather_packed_rows", "head_cross_entropy"]

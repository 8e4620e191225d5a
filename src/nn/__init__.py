"""Neural-network layers (Modules) built on packlora ops."""
from .layers import Embedding, RMSNorm, gather_packed_rows
from .linear import Linear, PackedLinear
from .module import Module

__all__ = ["Module", "Linear", "PackedLinear", "Embedding", "RMSNorm", "gather_packed_rows"]

"""LoRA (and DoRA) layers on a frozen linear layer; the fused product is ops.lora.LoraMatmul."""
from ..config import lora_scale
from ..nn import Module
from ..ops.lora import LoraMatmul, row_norms
from ..tensor import Tensor


class LoraLinear(Module):
    """A frozen base linear (PackedLinear or Linear) plus trainable lora_A (r, in), lora_B (out, r)
    and, with DoRA, lora_magnitude_vector (out,)."""

    def __init__(self, base, rank, alpha, dropout=0.0, use_rslora=False, use_dora=False):
        self.base = base
        self.rank, self.alpha, self.dropout = int(rank), float(alpha), float(dropout)
        self.use_rslora, self.use_dora = bool(use_rslora), bool(use_dora)
        self.scale = lora_scale(self.alpha, self.rank, self.use_rslora)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.lora_A = None
        self.lora_B = None
        self.lora_magnitude_vector = None

    @property
    def weight(self):
        return self.base.weight

    @property
    def bias(self):
        return self.base.bias

    def init_dora(self, device):
        """Magnitude = the row norms of the (adapted) base weight, as PEFT initialises it."""
        norms = row_norms(self.weight, self.lora_A.data, self.lora_B.data, self.scale, device)
        with device.memory.category("adapters"):
            self.lora_magnitude_vector = Tensor(norms, self.lora_A.device).require_grad()

    def forward(self, x, value=True):
        mag = self.lora_magnitude_vector
        norm = None
        if mag is not None:
            norm = row_norms(self.weight, self.lora_A.data, self.lora_B.data, self.scale,
                             self.lora_A.device)
        p = self.dropout if self.training else 0.0
        return LoraMatmul.apply(x, self.lora_A, self.lora_B, mag, self.bias, weight=self.weight,
                                scale=self.scale, dropout=p, norm=norm, value=value)

    def delta_weight(self):
        """s * B @ A as a float32 numpy array (out, in), for merging."""
        return self.scale * (self.lora_B.numpy() @ self.lora_A.numpy())

    def __repr__(self):
        kind = "DoRA" if self.use_dora else "LoRA"
        return f"{kind}(r={self.rank}, alpha={self.alpha:g}, base={self.base!r})"

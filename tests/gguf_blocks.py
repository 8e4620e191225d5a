"""Random GGUF blocks for tests: random codes and sub-scales, small finite fp16 scale and min
(the K-quants are not quantized from float here; their decoders and kernels are checked on
these against gguf.quants and the numpy reference)."""
import numpy as np
from packlora.quant import REGISTRY, PackedWeight


def random_blocks(fmt, n, k, rng):
    """(n, k // elems * nbytes) uint8: ggml blocks of format `fmt` (a registry name)."""
    lay = REGISTRY[fmt].layout
    raw = rng.integers(0, 256, (n, k // lay.elems, lay.nbytes), dtype=np.uint8)
    for at in (lay.scale_at, lay.min_at):
        if at is not None:
            half = rng.uniform(-0.05, 0.05, raw.shape[:2]).astype("<f2")
            raw[..., at:at + 2] = half.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(n, -1)


def random_packed(fmt, n, k, rng):
    """A PackedWeight of format `fmt` made of random blocks."""
    return PackedWeight.from_gguf(fmt.upper(), (n, k), random_blocks(fmt, n, k, rng))

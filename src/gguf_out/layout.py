"""A base model as llama.cpp sees it: its GGUF architecture, tensor names, and the row order of
its Q/K projections.

For a GGUF base all of it is read from the file. For a Hugging Face base it is what llama.cpp's
converter makes of that model: Llama and Mistral become architecture "llama" with Q/K rows
permuted into adjacent rotary pairs; Qwen2/Qwen3 keep their own names and row order."""
import numpy as np

from ..errors import ModelError
from ..models.gguf_file import GGUF_ARCH, QK_PERMUTED_ARCHS, qk_row_order
from ..models.resolve import resolve_source
from ..models.sources import GGUFSource, open_source


class BaseLayout:
    """`source`: a model source (models.sources); `arch`: its GGUF architecture."""

    def __init__(self, source):
        self.source = source
        self.config = source.config
        if isinstance(source, GGUFSource):
            self.gguf = source.file
            self.arch = self.gguf.architecture
        else:
            self.gguf = None
            self.arch = GGUF_ARCH[self.config.model_type]
        self.qk_permuted = self.arch in QK_PERMUTED_ARCHS

    @classmethod
    def open(cls, model):
        return cls(open_source(resolve_source(model)))

    @property
    def path(self):
        return self.source.path

    def gguf_rows(self, hf_name, n_rows):
        """Row indices putting HF-ordered rows of `hf_name` into the GGUF's order
        (gguf_rows = hf_rows[index]), or None when the orders agree."""
        if not self.qk_permuted:
            return None
        cfg = self.config
        module = hf_name.rsplit(".", 1)[0] if hf_name.endswith((".weight", ".bias")) else hf_name
        if module.endswith("self_attn.q_proj"):
            heads = cfg.num_heads
        elif module.endswith("self_attn.k_proj"):
            heads = cfg.num_kv_heads
        else:
            return None
        return np.argsort(qk_row_order(n_rows, heads))

    def shape(self, hf_name):
        """(out, in) of a base tensor, or a ModelError naming it when the base lacks it."""
        if hf_name not in self.source.names():
            raise ModelError(f"{self.path}: the base has no tensor {hf_name!r}")
        return tuple(self.source.shape(hf_name))

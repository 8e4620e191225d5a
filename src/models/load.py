"""load_model: a model name, HF folder, GGUF file or packed folder -> LlamaForCausalLM on a device.

Tensors stream one at a time, in the order models/tensors.py lists them: each linear weight is
quantized as it arrives (unless it is already packed, as GGUF tensors of the registry's types
are) and its dense copy is dropped before the next.
"""
import numpy as np

from ..device import Device
from ..errors import ModelError
from ..kernels import quantize as quantize_fn
from ..nn import Embedding, Linear, PackedLinear, RMSNorm
from ..tensor import Tensor
from .llama import MLP, Attention, Backbone, DecoderLayer, LlamaForCausalLM
from .identity import base_identity
from .resolve import resolve_source
from .sources import open_source
from .tensors import model_tensors, quant_record


class _Builder:
    """Pulls tensors from a source by name, checks shapes, packs and places them as listed."""

    def __init__(self, src, device):
        self.src, self.device = src, device
        self.names = src.names()
        self.mem = device.memory

    def _take(self, name, shape):
        if name not in self.names:
            raise ModelError(f"{self.src.path}: tensor {name!r} is missing")
        value = self.src.get(name)
        if tuple(value.shape) != tuple(shape):
            raise ModelError(f"{self.src.path}: tensor {name!r} has shape {tuple(value.shape)}, "
                             f"but the model config needs {tuple(shape)}")
        return value

    def place(self, spec):
        """The tensor of `spec` on the device as the spec holds it: a PackedWeight (tracked
        under the spec's category) or a float32 Tensor."""
        with self.mem.category(spec.category):
            value = self._take(spec.name, spec.shape)
            if spec.packed and getattr(value, "format", None) != spec.format:
                value = value.dequantize() if hasattr(value, "dequantize") else value
                value = quantize_fn(value, spec.format, block_size=spec.block_size,
                                    double_quant=spec.double_quant, name=spec.name)
            if not spec.packed:
                value = value.dequantize() if hasattr(value, "dequantize") else value
                return Tensor(self.device.xp.asarray(value, dtype=np.float32), self.device)
            value = value.to_device(self.device)
        for buf in value.buffers.values():  # to_device tracks packed buffers as base_packed
            self.mem.retag(buf, spec.category)
        return value


def _linear(t, prefix):
    w, b = t[f"{prefix}.weight"], t.get(f"{prefix}.bias")
    return Linear(w, b) if isinstance(w, Tensor) else PackedLinear(w, b)


def _norm(t, name, eps):
    w = t.get(name)
    return None if w is None else RMSNorm(w, eps)


def _layer(t, cfg, i):
    p, eps = f"model.layers.{i}", cfg.rms_norm_eps
    attn = Attention(cfg, *(_linear(t, f"{p}.self_attn.{n}_proj") for n in "qkvo"),
                     _norm(t, f"{p}.self_attn.q_norm.weight", eps),
                     _norm(t, f"{p}.self_attn.k_norm.weight", eps))
    mlp = MLP(*(_linear(t, f"{p}.mlp.{n}_proj") for n in ("gate", "up", "down")))
    return DecoderLayer(_norm(t, f"{p}.input_layernorm.weight", eps), attn,
                        _norm(t, f"{p}.post_attention_layernorm.weight", eps), mlp)


def load_model(source, device=None, quant=None, with_tokenizer=True):
    """Load a Llama-family model with packed linear layers.

    source: a model name (`smollm2-135m-instruct`), a Hugging Face folder, a GGUF file, an
    Ollama model (`ollama:llama3.2:1b`) or a folder written by `packlora quantize`. device: a
    Device (default CPU). quant: a QuantConfig, a dict of its fields (YAML's defaults fill the
    rest), a format name, "none", or None (NF4 + double quant); see models.tensors.quant_spec.
    """
    device = Device.parse(device) if device is not None else Device.cpu()
    path = resolve_source(source)
    src = open_source(path)
    cfg = src.config
    bd = _Builder(src, device)
    t = {spec.name: bd.place(spec) for spec in model_tensors(cfg, quant, src.stored_tensors())}
    layers = [_layer(t, cfg, i) for i in range(cfg.num_layers)]
    norm = _norm(t, "model.norm.weight", cfg.rms_norm_eps)
    lm_head = _linear(t, "lm_head") if "lm_head.weight" in t else None
    tok = src.tokenizer if with_tokenizer else None
    model = LlamaForCausalLM(cfg, Backbone(Embedding(t["model.embed_tokens.weight"]), layers,
                                           norm), lm_head, device, tok, path)
    model.quant = quant_record(quant, cfg.hidden_size)
    model.source_name = str(source)  # as the user gave it: a model name stays a name
    model.base_identity = base_identity(source, path, model.quant)  # saved with adapters
    return model

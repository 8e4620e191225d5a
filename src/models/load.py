"""load_model: a model name, HF folder, GGUF file or packed folder -> LlamaForCausalLM on a device.

Tensors stream one at a time: each linear weight is quantized as it arrives (unless it is
already packed, as GGUF Q4_0/Q4_1/Q8_0 tensors are) and its dense copy is dropped before the next.
"""
import numpy as np

from ..config_coerce import quant_config
from ..device import Device
from ..errors import ModelError
from ..nn import Embedding, Linear, PackedLinear, RMSNorm
from ..quant import quantize as quantize_fn
from ..tensor import Tensor
from .llama import MLP, Attention, Backbone, DecoderLayer, LlamaForCausalLM
from .resolve import resolve_source
from .sources import open_source

DOUBLE_QUANT_FORMATS = ("nf4", "fp4")  # the formats whose absmax can be double-quantized


def quant_spec(quant):
    """How load_model packs float linear weights, as a dict {format, block_size, double_quant}
    (format None: keep float32). `quant` is anything config_coerce.quant_config takes: None
    (NF4 + double quant, the QLoRA default), "none"/False, a format name, a dict or a
    QuantConfig; double quantization applies to nf4/fp4 only."""
    q = quant_config(quant)
    fmt = None if q.format == "none" else q.format
    return {"format": fmt, "block_size": q.block_size if fmt else None,
            "double_quant": bool(q.double_quant) and fmt in DOUBLE_QUANT_FORMATS}


class _Builder:
    """Pulls tensors from a source by name, checks shapes, packs and places them."""

    def __init__(self, src, device, quant):
        self.src, self.device, self.quant = src, device, quant
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

    def param(self, name, shape):
        value = self._take(name, shape)
        if hasattr(value, "dequantize"):
            value = value.dequantize()
        return Tensor(self.device.xp.asarray(value, dtype=np.float32), self.device)

    def packed_or_dense(self, name, shape, quantize=True):
        """A PackedWeight on the device, or a float Tensor if quantization is off."""
        value = self._take(name, shape)
        fmt = self.quant["format"]
        if not hasattr(value, "dequantize") and quantize and fmt is not None:
            value = quantize_fn(value, fmt, block_size=self.quant["block_size"],
                                double_quant=self.quant["double_quant"], name=name)
        if hasattr(value, "dequantize"):
            return value.to_device(self.device)
        return Tensor(self.device.xp.asarray(value, dtype=np.float32), self.device)

    def linear(self, prefix, n_out, n_in, bias=False):
        with self.mem.category("base_packed"):
            w = self.packed_or_dense(f"{prefix}.weight", (n_out, n_in))
        with self.mem.category("base_other"):
            b = self.param(f"{prefix}.bias", (n_out,)) if bias else None
        return Linear(w, b) if isinstance(w, Tensor) else PackedLinear(w, b)

    def norm(self, name, dim, eps):
        with self.mem.category("base_other"):
            return RMSNorm(self.param(name, (dim,)), eps)


def _layer(bd, cfg, i):
    p = f"model.layers.{i}"
    d, hd, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    qn = kn = None
    if cfg.qk_norm:
        qn = bd.norm(f"{p}.self_attn.q_norm.weight", hd, cfg.rms_norm_eps)
        kn = bd.norm(f"{p}.self_attn.k_norm.weight", hd, cfg.rms_norm_eps)
    bias, q_out, kv_out = cfg.attention_bias, cfg.num_heads * hd, cfg.num_kv_heads * hd
    attn = Attention(cfg,
                     bd.linear(f"{p}.self_attn.q_proj", q_out, d, bias),
                     bd.linear(f"{p}.self_attn.k_proj", kv_out, d, bias),
                     bd.linear(f"{p}.self_attn.v_proj", kv_out, d, bias),
                     bd.linear(f"{p}.self_attn.o_proj", d, q_out), qn, kn)
    mlp = MLP(bd.linear(f"{p}.mlp.gate_proj", f, d), bd.linear(f"{p}.mlp.up_proj", f, d),
              bd.linear(f"{p}.mlp.down_proj", d, f))
    return DecoderLayer(bd.norm(f"{p}.input_layernorm.weight", d, cfg.rms_norm_eps), attn,
                        bd.norm(f"{p}.post_attention_layernorm.weight", d, cfg.rms_norm_eps), mlp)


def load_model(source, device=None, quant=None, with_tokenizer=True):
    """Load a Llama-family model with packed linear layers.

    source: a model name (`smollm2-135m-instruct`), a Hugging Face folder, a .gguf file or a
    folder written by `packlora quantize`. device: a Device (default CPU). quant: see quant_spec.
    """
    device = Device.parse(device) if device is not None else Device.cpu()
    path = resolve_source(source)
    src = open_source(path)
    cfg = src.config
    bd = _Builder(src, device, quant_spec(quant))
    with device.memory.category("base_other"):
        embed = bd.packed_or_dense("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size),
                                   quantize=False)
    layers = [_layer(bd, cfg, i) for i in range(cfg.num_layers)]
    norm = bd.norm("model.norm.weight", cfg.hidden_size, cfg.rms_norm_eps)
    lm_head = None
    if not cfg.tie_word_embeddings and "lm_head.weight" in bd.names:
        with device.memory.category("base_other"):
            w = bd.packed_or_dense("lm_head.weight", (cfg.vocab_size, cfg.hidden_size),
                                   quantize=False)
        lm_head = Linear(w) if isinstance(w, Tensor) else PackedLinear(w)
    tok = src.tokenizer if with_tokenizer else None
    if not isinstance(embed, Tensor):  # a packed table (GGUF Q8_0) is still an embedding
        for buf in embed.buffers.values():
            device.memory.retag(buf, "base_other")
    model = LlamaForCausalLM(cfg, Backbone(Embedding(embed), layers, norm), lm_head, device, tok,
                             path)
    model.quant = bd.quant
    return model

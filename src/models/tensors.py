"""The base tensors of a Llama-family model, from its config (and, when known, its stored
tensor types) without reading tensor data: name, shape, and how load_model holds each one —
packed (format, block, double quant) or float32 — under which memory category.

load_model loads exactly this list and the memory planner prices exactly this list, so the
two cannot disagree about which tensors exist or how they are held."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from ..config_coerce import quant_config
from ..quant import packed_nbytes
from ..quant.formats import resolve_block_size
from ..quant.presets import PRESETS, llama_cpp_70b, preset_format
from ..quant.registry import DOUBLE_QUANT_FORMATS, GGML_ROWS, REGISTRY

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor: its name and logical shape; format None means a float32 array."""

    name: str
    shape: tuple
    format: str | None = None
    block_size: int | None = None
    double_quant: bool = False
    category: str = "base_other"  # the memory category load_model tracks it under

    def __post_init__(self):  # a packed spec names its block size, as its PackedWeight would
        if self.format is not None and self.block_size is None:
            object.__setattr__(self, "block_size", resolve_block_size(self.format, None))

    @property
    def packed(self) -> bool:
        return self.format is not None

    @property
    def nbytes(self) -> int:
        if self.format is None:
            n = 4
            for d in self.shape:
                n *= int(d)
            return n
        return packed_nbytes(self.format, self.shape, self.block_size, self.double_quant)


def quant_spec(quant):
    """How load_model packs float linear weights, as a dict {format, block_size, double_quant}
    (format None: keep float32). `quant` is anything config_coerce.quant_config takes: None
    (NF4 + double quant, the QLoRA default), "none"/False, a format name, a dict or a
    QuantConfig; double quantization applies to the formats the registry allows it for."""
    q = quant_config(quant)
    fmt = None if q.format == "none" else q.format
    return {"format": fmt, "block_size": q.block_size if fmt else None,
            "double_quant": bool(q.double_quant) and fmt in DOUBLE_QUANT_FORMATS}


EMBEDDING_AUTO = "q8_0"  # quant.embeddings: auto, when the run packs its linear weights
EMBEDDING_WEIGHTS = ("model.embed_tokens.weight", "lm_head.weight")  # what quant.embeddings holds


def embedding_spec(quant, dim):
    """How load_model holds a float embedding / LM head of rows `dim` long, as quant_spec's dict
    (format None: float32). A format whose blocks do not divide the rows keeps float32."""
    q = quant_config(quant)
    fmt = q.embeddings
    if fmt == "auto":
        fmt = EMBEDDING_AUTO if q.format != "none" else "float"
    entry = REGISTRY.get(fmt)
    if entry is None or (entry.storage == GGML_ROWS and dim % entry.layout.elems):
        return {"format": None, "block_size": None, "double_quant": False}
    return {"format": fmt, "block_size": entry.default_block_size, "double_quant": False}


def quant_record(quant, dim):
    """quant_spec plus the format the embedding and LM head take ("embeddings": None when they
    stay float): what a model records of how it holds a float base (adapters keep it, and a merge
    into the quantized base replays it)."""
    return quant_spec(quant) | {"embeddings": embedding_spec(quant, dim)["format"]}


def held_formats(specs):
    """{format ("float32" for float arrays): how many of `specs` are held in it}, most common
    first: what a loaded model actually keeps (stored GGUF types stay as stored)."""
    counts = Counter(spec.format or "float32" for spec in specs)
    return dict(counts.most_common())


def _held(name, shape, stored, quant, category, quantize, place=None):
    """Stored-packed tensors stay as stored; float linear weights get the run's format (when
    `quantize`; a preset picks it from `place`, the weight's `linear_place`);
    everything else is float32. 16-bit float weights (F16 / BF16) count as float where the run
    quantizes them, and stay 16-bit otherwise (`quant.format: none`, embeddings, the head)."""
    kept = (stored or {}).get(name)
    runs_format = quantize and quant["format"] is not None
    if kept is not None and kept.packed and not (runs_format and REGISTRY[kept.format].float16):
        return replace(kept, name=name, shape=tuple(shape), category=category)
    if quantize and quant["format"] in PRESETS:
        fmt = preset_format(quant["format"], *place, shape[-1])
        return TensorSpec(name, tuple(shape), fmt, REGISTRY[fmt].default_block_size,
                          category=category)
    if quantize and quant["format"] is not None:
        return TensorSpec(name, tuple(shape), quant["format"], quant["block_size"],
                          quant["double_quant"], category)
    return TensorSpec(name, tuple(shape), category=category)


def linear_place(cfg, projection, layer):
    """What a preset picks a linear weight's format from: (projection, layer, layers,
    whether llama.cpp calls the model 70B)."""
    seventy_b = llama_cpp_70b(cfg.model_type, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads)
    return projection, layer, cfg.num_layers, seventy_b


def _layer_tensors(cfg, i, stored, quant):
    p = f"model.layers.{i}"
    d, hd, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
    shapes = dict(zip(PROJECTIONS, [(q_out, d), (kv_out, d), (kv_out, d), (d, q_out),
                                    (f, d), (f, d), (d, f)], strict=True))
    out = []
    for proj, shape in shapes.items():
        out.append(_held(f"{p}.{proj}.weight", shape, stored, quant, "base_packed", True,
                         linear_place(cfg, proj, i)))
        if cfg.attention_bias and proj in PROJECTIONS[:3]:  # q/k/v biases (Qwen2)
            out.append(TensorSpec(f"{p}.{proj}.bias", (shape[0],)))
    norms = [("input_layernorm", d), ("post_attention_layernorm", d)]
    if cfg.qk_norm:  # per-head q/k RMSNorm (Qwen3)
        norms += [("self_attn.q_norm", hd), ("self_attn.k_norm", hd)]
    return out + [TensorSpec(f"{p}.{n}.weight", (dim,)) for n, dim in norms]


def model_tensors(cfg, quant=None, stored=None) -> list[TensorSpec]:
    """Every base tensor load_model places, in load order. cfg: a ModelConfig; quant: anything
    quant_spec takes; stored: {name: TensorSpec} as the source stores them (a source's
    `stored_tensors()`), or None when only the config is known (an untied head is then assumed
    to be present)."""
    q = quant_spec(quant)
    v, d = cfg.vocab_size, cfg.hidden_size
    emb = embedding_spec(quant, d)
    embed, head = EMBEDDING_WEIGHTS
    out = [_held(embed, (v, d), stored, emb, "base_other", True)]
    for i in range(cfg.num_layers):
        out += _layer_tensors(cfg, i, stored, q)
    out.append(TensorSpec("model.norm.weight", (d,)))
    if not cfg.tie_word_embeddings and (stored is None or head in stored):
        out.append(_held(head, (v, d), stored, emb, "base_other", True))
    return out

"""Mixed presets: a format for each linear weight of a model, picked the way llama.cpp's
quantizer picks them for its K-quant files of the same name (llama_tensor_get_type in
src/llama-quant.cpp), for a model without experts:

  Q3_K_S, Q5_K_S  the base type everywhere
  Q3_K_M          attn_v: Q5_K in layers 0 and 1, Q4_K after; ffn_down: Q5_K in the first
                  sixteenth of the layers, Q4_K after; attn_output: Q4_K; the rest Q3_K
  Q3_K_L          attn_v, ffn_down and attn_output Q5_K; the rest Q3_K
  Q4_K_S          attn_v: Q5_K in layers 0-3; ffn_down: Q5_K in the first eighth; the rest Q4_K
  Q4_K_M, Q5_K_M  attn_v and ffn_down get Q6_K in the layers that get more bits (the first and
                  last eighth and every third layer between), the base type elsewhere
  a model llama.cpp calls 70B (see `llama_cpp_70b`): an attn_v picked Q3_K or Q4_K above
                  takes Q5_K (its 8 query heads share each attn_v row)
  a row length (K) that is no multiple of 256 falls back: Q2_K / Q3_K -> Q4_0, Q4_K -> Q5_0,
  Q5_K -> Q5_1, Q6_K -> Q8_0, IQ4_XS -> IQ4_NL (what llama.cpp does, e.g. for every tensor of
  SmolLM2 whose rows are 576 long)
The token embedding and LM head of a file written under a preset (a merge into GGUF,
`embedding_format`): the head Q6_K (Q8_0 for rows that are no multiple of 256), an embedding tied
to it likewise, an untied embedding the base type with the fallback. In training they are no
linear weights: `quant.embeddings` holds them under every format.
llama.cpp's Q2_K and IQ4_XS files are mixes too; here `q2_k` and `iq4_xs` name the one type.
"""
from .registry import REGISTRY

PRESETS = {"q3_k_s": "q3_k", "q3_k_m": "q3_k", "q3_k_l": "q3_k", "q4_k_s": "q4_k",
           "q4_k_m": "q4_k", "q5_k_s": "q5_k", "q5_k_m": "q5_k"}   # preset -> base type
FALLBACK = {"q2_k": "q4_0", "q3_k": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0",
            "iq4_xs": "iq4_nl"}
ATTN_V, FFN_DOWN, ATTN_OUTPUT = "self_attn.v_proj", "mlp.down_proj", "self_attn.o_proj"
# llama.cpp architectures whose 80-layer models it calls 70B: (arch, needs grouped-query heads)
SEVENTY_B = {"llama": True, "mistral": True, "qwen2": False}  # HF "mistral" converts to llama


def fit_rows(fmt, k):
    """`fmt`, or llama.cpp's fallback (FALLBACK) where rows k long hold no whole block of it."""
    if k % REGISTRY[fmt].layout.elems and fmt in FALLBACK:
        return FALLBACK[fmt]
    return fmt


def llama_cpp_70b(arch, n_layers, heads, kv_heads):
    """Whether llama.cpp's model loader types this model 70B (src/models/llama.cpp, qwen2.cpp):
    80 layers, and for the Llama family grouped-query attention (with as many KV heads as query
    heads it is the 65B)."""
    return n_layers == 80 and arch in SEVENTY_B and (heads != kv_heads or not SEVENTY_B[arch])


def use_more_bits(layer, n_layers):
    """llama.cpp's choice of the layers whose attn_v / ffn_down get Q6_K."""
    eighth = n_layers // 8
    return layer < eighth or layer >= 7 * n_layers // 8 or (layer - eighth) % 3 == 2


def _attn_v(preset, layer, n_layers):
    if preset == "q3_k_m":
        return "q5_k" if layer < 2 else "q4_k"
    if preset == "q3_k_l" or preset == "q4_k_s" and layer < 4:
        return "q5_k"
    if preset in ("q4_k_m", "q5_k_m") and use_more_bits(layer, n_layers):
        return "q6_k"
    return PRESETS[preset]


def _ffn_down(preset, layer, n_layers):
    if preset == "q3_k_m":
        return "q5_k" if layer < n_layers // 16 else "q4_k"
    if preset == "q3_k_l" or preset == "q4_k_s" and layer < n_layers // 8:
        return "q5_k"
    if preset in ("q4_k_m", "q5_k_m") and use_more_bits(layer, n_layers):
        return "q6_k"
    return PRESETS[preset]


def preset_format(preset, projection, layer, n_layers, seventy_b, k):
    """The format of linear weight `projection` (e.g. "mlp.down_proj") of layer `layer` of
    `n_layers`, whose rows are k long, under `preset`; `seventy_b`: `llama_cpp_70b` of the
    model."""
    if projection == ATTN_V:
        fmt = _attn_v(preset, layer, n_layers)
        if seventy_b and fmt in ("q3_k", "q4_k"):
            fmt = "q5_k"
    elif projection == FFN_DOWN:
        fmt = _ffn_down(preset, layer, n_layers)
    elif projection == ATTN_OUTPUT:
        fmt = {"q3_k_m": "q4_k", "q3_k_l": "q5_k"}.get(preset, PRESETS[preset])
    else:
        fmt = PRESETS[preset]
    return fit_rows(fmt, k)


def embedding_format(preset, k, head):
    """The format llama.cpp's quantizer gives, under `preset`, the LM head or an embedding tied
    to it (`head`), or else the token embedding, whose rows are k long."""
    return fit_rows("q6_k" if head else PRESETS[preset], k)

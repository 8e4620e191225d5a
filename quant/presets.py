"""Mixed presets: a format for each linear weight of a model, picked the way llama.cpp's
quantizer picks them for its Q3_K_M, Q4_K_M and Q5_K_M files (llama_tensor_get_type in
src/llama-quant.cpp), for a Llama-family model without experts:

  Q4_K_M, Q5_K_M  attn_v and ffn_down get Q6_K in the layers that get more bits (the first and
                  last eighth and every third layer between), the base type elsewhere
  Q3_K_M          attn_v: Q5_K in layers 0 and 1, Q4_K after; ffn_down: Q5_K in the first
                  sixteenth of the layers, Q4_K after; attn_output: Q4_K; the rest Q3_K
  a row length (K) that is no multiple of 256 falls back: Q2_K / Q3_K -> Q4_0, Q4_K -> Q5_0,
  Q5_K -> Q5_1, Q6_K -> Q8_0, IQ4_XS -> IQ4_NL (what llama.cpp does, e.g. for every tensor of
  SmolLM2 whose rows are 576 long)
Embeddings and the LM head are not linear weights here: they stay as every format keeps them.
"""
from .registry import REGISTRY

PRESETS = {"q3_k_m": "q3_k", "q4_k_m": "q4_k", "q5_k_m": "q5_k"}   # preset -> base type
MORE_BITS = ("self_attn.v_proj", "mlp.down_proj")                  # attn_v, ffn_down
FALLBACK = {"q2_k": "q4_0", "q3_k": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0",
            "iq4_xs": "iq4_nl"}


def use_more_bits(layer, n_layers):
    """llama.cpp's choice of the layers whose attn_v / ffn_down get Q6_K."""
    eighth = n_layers // 8
    return layer < eighth or layer >= 7 * n_layers // 8 or (layer - eighth) % 3 == 2


def _q3_k_m(projection, layer, n_layers):
    if projection == "self_attn.v_proj":
        return "q5_k" if layer < 2 else "q4_k"
    if projection == "mlp.down_proj":
        return "q5_k" if layer < n_layers // 16 else "q4_k"
    return "q4_k" if projection == "self_attn.o_proj" else "q3_k"


def preset_format(preset, projection, layer, n_layers, k):
    """The format of linear weight `projection` (e.g. "mlp.down_proj") of layer `layer` of
    `n_layers`, whose rows are k long, under `preset`."""
    fmt = PRESETS[preset]
    if preset == "q3_k_m":
        fmt = _q3_k_m(projection, layer, n_layers)
    elif projection in MORE_BITS and use_more_bits(layer, n_layers):
        fmt = "q6_k"
    if k % REGISTRY[fmt].layout.elems:
        fmt = FALLBACK[fmt]
    return fmt

"""Mixed presets (quant/presets.py): llama.cpp's K-quant mixes (Q3_K_S ... Q5_K_M), a format per
linear weight, the fallbacks for rows that are no multiple of 256, and the one tensor list that
load_model, the memory plan and `packlora quantize` share."""
import model_factory as mf
import numpy as np
import pytest
from packlora import ConfigError, load_model
from packlora.config import QuantConfig
from packlora.export import export_model
from packlora.models import ModelConfig, model_tensors

LLAMA2_7B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
             "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 32, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
# 32 layers: the first and last eighth (0-3, 28-31) and every third layer from 6 get more bits
MORE_BITS_32 = {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31}


def _formats(cfg, quant):
    return {t.name: t.format for t in model_tensors(ModelConfig.from_hf(cfg, "cfg"), quant)}


@pytest.mark.parametrize("preset,base", [("q4_k_m", "q4_k"), ("q5_k_m", "q5_k")])
def test_llama_7b_layers_get_the_llama_cpp_mix(preset, base):
    got = _formats(LLAMA2_7B, preset)
    for i in range(32):
        p = f"model.layers.{i}"
        more = "q6_k" if i in MORE_BITS_32 else base
        assert got[f"{p}.self_attn.v_proj.weight"] == more, i
        assert got[f"{p}.mlp.down_proj.weight"] == more, i
        for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj"):
            assert got[f"{p}.{proj}.weight"] == base, (i, proj)
    # quant.embeddings: auto
    assert got["model.embed_tokens.weight"] == "q8_0" and got["lm_head.weight"] == "q8_0"


def test_llama_7b_q3_k_m():
    """Q3_K_M's own rule: attn_v Q5_K in layers 0-1 and Q4_K after, ffn_down Q5_K in the first
    sixteenth (layers 0-1 of 32) and Q4_K after, attn_output Q4_K, the rest Q3_K."""
    got = _formats(LLAMA2_7B, "q3_k_m")
    for i in range(32):
        p = f"model.layers.{i}"
        first = "q5_k" if i < 2 else "q4_k"
        assert got[f"{p}.self_attn.v_proj.weight"] == first, i
        assert got[f"{p}.mlp.down_proj.weight"] == first, i
        assert got[f"{p}.self_attn.o_proj.weight"] == "q4_k", i
        for proj in ("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert got[f"{p}.{proj}.weight"] == "q3_k", (i, proj)


def test_llama_7b_q4_k_s_and_q3_k_l():
    """Q4_K_S: attn_v Q5_K in layers 0-3, ffn_down Q5_K in the first eighth; Q3_K_L: attn_v,
    ffn_down and attn_output Q5_K, the rest Q3_K."""
    s, big = _formats(LLAMA2_7B, "q4_k_s"), _formats(LLAMA2_7B, "q3_k_l")
    for i in range(32):
        p = f"model.layers.{i}"
        assert s[f"{p}.self_attn.v_proj.weight"] == s[f"{p}.mlp.down_proj.weight"] == (
            "q5_k" if i < 4 else "q4_k"), i
        assert s[f"{p}.self_attn.o_proj.weight"] == s[f"{p}.mlp.up_proj.weight"] == "q4_k", i
        for proj in ("self_attn.v_proj", "mlp.down_proj", "self_attn.o_proj"):
            assert big[f"{p}.{proj}.weight"] == "q5_k", (i, proj)
        assert big[f"{p}.self_attn.q_proj.weight"] == big[f"{p}.mlp.gate_proj.weight"] == "q3_k"


@pytest.mark.parametrize("arch,kv_heads,bumped", [("llama", 8, True), ("llama", 64, False),
                                                  ("qwen2", 64, True)])
def test_what_llama_cpp_calls_70b_keeps_attn_v_at_q5_k(arch, kv_heads, bumped):
    """80 layers: Llama-2/3-70B (8 KV heads) and Qwen2-72B; not the Llama 65B (no GQA)."""
    cfg = {**LLAMA2_7B, "model_type": arch, "hidden_size": 8192, "intermediate_size": 28672,
           "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": kv_heads}
    for preset, plain in (("q3_k_s", "q3_k"), ("q3_k_m", "q4_k"), ("q4_k_m", "q4_k")):
        got = _formats(cfg, preset)
        v = {got[f"model.layers.{i}.self_attn.v_proj.weight"] for i in range(2, 80)}
        assert (plain in v) is not bumped and ("q5_k" in v) is bumped, (preset, v)


def test_rows_that_are_no_multiple_of_256_fall_back():
    smol = {**LLAMA2_7B, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
            "num_attention_heads": 9, "num_key_value_heads": 3}
    got = _formats(smol, "q4_k_m")
    assert got["model.layers.0.self_attn.q_proj.weight"] == "q5_0"      # K = 576
    assert got["model.layers.0.self_attn.v_proj.weight"] == "q8_0"      # Q6_K, K = 576
    assert got["model.layers.0.mlp.gate_proj.weight"] == "q5_0"         # K = 576
    assert got["model.layers.0.mlp.down_proj.weight"] == "q6_k"         # K = 1536 = 6 * 256
    assert got["model.layers.4.mlp.down_proj.weight"] == "q4_k"


def test_load_quantize_and_plan_share_the_mix(tmp_path):
    folder = mf.tiny_chat_model(tmp_path / "model")                     # K = 64 or 96
    model = load_model(str(folder), quant="q4_k_m", with_tokenizer=False)
    want = _formats(mf.hf_config("llama"), "q4_k_m")
    held = {f"{n}.weight": m.weight.format for n, m in model.named_modules()
            if hasattr(getattr(m, "weight", None), "format")}
    assert held and all(held[n] == want[n] for n in held)
    assert set(held.values()) == {"q5_0", "q8_0"}
    export_model(str(folder), tmp_path / "packed", quantize="q4_k_m")
    again = load_model(str(tmp_path / "packed"), with_tokenizer=False)
    for n, m in again.named_modules():
        if f"{n}.weight" in held:
            assert m.weight.format == held[f"{n}.weight"]
            np.testing.assert_array_equal(m.weight.dequantize(),
                                          dict(model.named_modules())[n].weight.dequantize())
    assert QuantConfig(format="q4_k_m").format == "q4_k_m"
    with pytest.raises((ConfigError, ValueError), match="q4_k_x"):
        QuantConfig(format="q4_k_x")

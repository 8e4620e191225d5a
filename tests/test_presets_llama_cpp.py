"""The mixed presets (quant/presets.py) against llama.cpp's own quantizer: a Llama or Qwen2
GGUF of zeros (llama.cpp picks each type from the tensor's name, its shape and the model's
hyper-parameters alone) is quantized by llama_model_quantize to every preset, and the type it
stored for every linear weight must be the one packlora's tensor list picks, and for every
tensor the one a GGUF merge of that file writes. Shapes: 80 layers (what llama.cpp calls a 70B
for Llama with grouped-query attention and for Qwen2, not for the Llama 65B), 16 layers whose
rows are 576 long (the fallbacks), and 16 layers whose head is the embedding (tied)."""
import ctypes
import importlib.util

import gguf
import model_factory as mf
import numpy as np
import pytest
from packlora.gguf_out.layout import BaseLayout
from packlora.gguf_out.merge import plan_jobs
from packlora.models import model_tensors
from packlora.models.gguf_file import gguf_name
from packlora.quant.presets import PRESETS


def _shape(layers, hidden, inter, heads, kv_heads, tied=False):
    """model_factory.write_layout_gguf's shape."""
    return {"vocab": 256, "layers": layers, "hidden": hidden, "inter": inter, "heads": heads,
            "kv_heads": kv_heads, "tied": tied}


SHAPES = {"llama-70b": ("llama", _shape(80, 256, 256, 4, 1)),
          "llama-65b": ("llama", _shape(80, 256, 256, 4, 4)),
          "qwen2-72b": ("qwen2", _shape(80, 256, 256, 4, 4)),
          "llama-576": ("llama", _shape(16, 576, 512, 9, 3)),
          "llama-tied": ("llama", _shape(16, 256, 512, 4, 2, tied=True))}


def _zeros(name, dims):
    """Zero weights in F16 (llama.cpp's choice of types reads no values), unit norms."""
    return np.ones(dims, np.float32) if len(dims) == 1 else np.zeros(dims, np.float16)


@pytest.fixture(scope="module", params=list(SHAPES))
def zeros(request, tmp_path_factory):
    """(shape name, path) of each shape's F16 file."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (scripts/test.sh builds it once)")
    path = tmp_path_factory.mktemp("zeros") / f"{request.param}.gguf"
    return request.param, mf.write_layout_gguf(path, *SHAPES[request.param], _zeros)


def _llama_cpp_types(src, preset, out):
    """{GGUF name: type name} of `src` quantized by llama.cpp to `preset`."""
    import llama_cpp  # optional: only where scripts/test.sh installed it
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{preset.upper()}")
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(),
                                          ctypes.byref(params)) == 0, preset
    types = {t.name: t.tensor_type.name.lower() for t in gguf.GGUFReader(str(out)).tensors}
    out.unlink()
    return types


def test_every_preset_picks_the_types_llama_cpp_picks(zeros, tmp_path):
    shape, path = zeros
    base = BaseLayout.open(str(path))
    cfg = base.config
    seen = {}
    for preset in PRESETS:
        stored = _llama_cpp_types(path, preset, tmp_path / f"{preset}.gguf")
        mine = {gguf_name(t.name): t.format for t in model_tensors(cfg, preset)
                if t.category == "base_packed"}
        assert len(mine) == 7 * cfg.num_layers
        wrong = {n: (f, stored[n]) for n, f in mine.items() if stored[n] != f}
        assert not wrong, (shape, preset, dict(list(wrong.items())[:6]))
        merged = {j.gguf: j.out_type.name.lower() for j in plan_jobs(base, (), preset, "float")}
        assert merged == stored, (shape, preset, set(merged.items()) ^ set(stored.items()))
        seen[preset] = {stored[n] for n in mine if ".attn_v." in n}, stored["token_embd.weight"]
    # each shape shows the rule it is here for: Q3_K_S's attn_v (Q3_K) as llama.cpp keeps it, and
    # its embedding: Q3_K, Q4_0 (rows of 576), Q6_K (the head)
    assert seen["q3_k_s"] == {"llama-70b": ({"q5_k"}, "q3_k"), "qwen2-72b": ({"q5_k"}, "q3_k"),
                              "llama-65b": ({"q3_k"}, "q3_k"), "llama-576": ({"q4_0"}, "q4_0"),
                              "llama-tied": ({"q3_k"}, "q6_k")}[shape]

"""Config objects at the API boundary: a dict passed to apply_lora/load_model gets the YAML
defaults, one LoRA scale rule, PEFT's first-match patterns and its default lora_alpha on load
and on merge alike."""
import json

import model_factory as mf
import numpy as np
import pytest
from packlora import Device, LoraConfig
from packlora.adapters import apply_lora, load_adapter
from packlora.errors import ConfigError
from packlora.export import export_model
from packlora.models import load_model
from packlora.quant import PackedWeight
from safetensors.numpy import load_file, save_file


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    folder, _ = mf.write_hf(tmp_path_factory.mktemp("boundary") / "m", "llama")
    return folder


def _model(hf, quant="none"):
    dev = Device.cpu().autodiff()
    dev.seed(0)
    return load_model(hf, dev, quant=quant, with_tokenizer=False)


def test_apply_lora_dict_gets_lora_config_defaults(hf):
    want = LoraConfig()
    m = apply_lora(_model(hf), {})
    suffixes = {p.rsplit(".", 1)[-1] for p in m.lora_paths}
    assert suffixes == set(want.targets)
    layer = m.get_module(m.lora_paths[0])
    assert (layer.rank, layer.alpha) == (want.rank, want.alpha)
    assert isinstance(m.lora_config, LoraConfig)


def test_apply_lora_dict_is_validated(hf):
    with pytest.raises(ConfigError, match="rnak"):
        apply_lora(_model(hf), {"rnak": 4})
    with pytest.raises(ConfigError, match="rank"):
        apply_lora(_model(hf), {"rank": 0})


def test_load_model_quant_dict_gets_quant_config_defaults(hf):
    m = load_model(hf, quant={"format": "nf4"}, with_tokenizer=False)
    w = m.get_module("model.layers.0.self_attn.q_proj").weight
    assert isinstance(w, PackedWeight) and w.double_quant  # YAML's quant.double_quant: true
    assert w.block_size == 64
    with pytest.raises(ConfigError, match="block_size"):
        load_model(hf, quant={"format": "nf4", "block_size": 48}, with_tokenizer=False)


def _peft_adapter(folder, hf, config):
    """A PEFT-style adapter on q_proj and o_proj of every layer (random weights)."""
    rng = np.random.default_rng(3)
    cfg = mf.hf_config("llama")
    d, hd = cfg["hidden_size"], mf.HEAD_DIM
    shapes = {"self_attn.q_proj": (mf.HEADS * hd, d), "self_attn.o_proj": (d, mf.HEADS * hd)}
    tensors = {}
    for i in range(mf.LAYERS):
        for name, (n, k) in shapes.items():
            pre = f"base_model.model.model.layers.{i}.{name}"
            tensors[f"{pre}.lora_A.weight"] = rng.standard_normal((2, k)).astype(np.float32)
            tensors[f"{pre}.lora_B.weight"] = rng.standard_normal((n, 2)).astype(np.float32)
    folder.mkdir()
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    (folder / "adapter_config.json").write_text(json.dumps(
        dict({"peft_type": "LORA", "r": 2, "target_modules": ["q_proj", "o_proj"]}, **config)))
    return folder


def _merged_delta(hf, adapter, out, path):
    export_model(hf, out, adapter=adapter)
    name = f"{path}.weight"
    return load_file(str(out / "model.safetensors"))[name] - load_file(
        str(hf / "model.safetensors"))[name]


OVERLAPPING = {"lora_alpha": 4, "alpha_pattern": {r"self_attn\..*_proj": 6.0, "o_proj": 10.0}}


@pytest.mark.parametrize("config", [{}, OVERLAPPING], ids=["no-lora_alpha", "overlapping"])
def test_merge_scales_adapters_as_load_adapter_does(hf, tmp_path, config):
    adapter = _peft_adapter(tmp_path / "ad", hf, config)
    model = load_adapter(_model(hf), adapter)
    for path in ("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.o_proj"):
        layer = model.get_module(path)
        if not config:
            assert layer.alpha == 8  # PEFT's default lora_alpha
        else:
            assert layer.alpha == 6.0  # the first pattern that matches wins, as in PEFT
        got = _merged_delta(hf, adapter, tmp_path / path, path)
        np.testing.assert_allclose(got, layer.delta_weight(), rtol=1e-5, atol=1e-6)

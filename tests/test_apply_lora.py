"""LoRA on a model: apply_lora's targets and initialisation, LoftQ, and the PEFT adapter format
(save, load, PEFT-style keys). The LoraMatmul math itself: test_adapters.py."""
import json

import model_factory as mf
import numpy as np
import pytest
from gradcheck import DEV
from packlora import without_autodiff
from packlora.adapters import LoraLinear, apply_lora, load_adapter, save_adapter
from packlora.errors import ConfigError, ModelError
from packlora.memory import plan
from packlora.models import load_model
from packlora.models.sources import open_source
from safetensors import safe_open
from safetensors.numpy import save_file

LINEAR_SHAPES = {"q_proj": (mf.HEADS * mf.HEAD_DIM, mf.HIDDEN),
                 "k_proj": (mf.KV_HEADS * mf.HEAD_DIM, mf.HIDDEN),
                 "v_proj": (mf.KV_HEADS * mf.HEAD_DIM, mf.HIDDEN),
                 "o_proj": (mf.HIDDEN, mf.HEADS * mf.HEAD_DIM),
                 "gate_proj": (mf.INTER, mf.HIDDEN), "up_proj": (mf.INTER, mf.HIDDEN),
                 "down_proj": (mf.HIDDEN, mf.INTER)}


# --- apply_lora ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    folder, _ = mf.write_hf(tmp_path_factory.mktemp("tiny") / "m", "llama")
    return folder


def _model(hf_dir, quant="nf4", seed=0):
    DEV.seed(seed)
    return load_model(hf_dir, DEV, quant=quant, with_tokenizer=False)


def test_targets_suffix_list_all_linear_and_regex(hf_dir):
    m = apply_lora(_model(hf_dir), {"targets": ["q_proj", "v_proj"], "rank": 4})
    assert m.lora_paths == [f"model.layers.{i}.self_attn.{p}" for i in range(mf.LAYERS)
                            for p in ("q_proj", "v_proj")]
    assert isinstance(m.get_module("model.layers.0.self_attn.q_proj"), LoraLinear)
    assert not isinstance(m.get_module("model.layers.0.self_attn.k_proj"), LoraLinear)
    m = apply_lora(_model(hf_dir), {"targets": "all-linear", "rank": 4})
    assert len(m.lora_paths) == 7 * mf.LAYERS
    assert not any(p.endswith("lm_head") for p in m.lora_paths)
    assert not isinstance(m.lm_head, LoraLinear)
    m = apply_lora(_model(hf_dir), {"targets": r".*\.1\.mlp\.(up|down)_proj", "rank": 4})
    assert sorted(m.lora_paths) == ["model.layers.1.mlp.down_proj", "model.layers.1.mlp.up_proj"]


def test_layers_and_patterns(hf_dir):
    cfg = {"targets": ["q_proj", "v_proj", "down_proj"], "rank": 4, "alpha": 8, "layers": [1],
           "rank_pattern": {"v_proj": 2}, "alpha_pattern": {"down_proj": 3.0}}
    m = apply_lora(_model(hf_dir), cfg)
    assert all(".layers.1." in p for p in m.lora_paths) and len(m.lora_paths) == 3
    v = m.get_module("model.layers.1.self_attn.v_proj")
    q = m.get_module("model.layers.1.self_attn.q_proj")
    d = m.get_module("model.layers.1.mlp.down_proj")
    assert (q.rank, q.alpha, v.rank, v.alpha, d.rank, d.alpha) == (4, 8, 2, 8, 4, 3.0)
    assert v.lora_A.shape == (2, mf.HIDDEN) and v.lora_B.shape == (LINEAR_SHAPES["v_proj"][0], 2)
    assert d.scale == pytest.approx(3.0 / 4)


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], "all-linear"])
def test_only_adapters_train_and_count(hf_dir, targets):
    r = 4
    m = apply_lora(_model(hf_dir), {"targets": targets, "rank": r})
    names = [n for n, _ in m.trainable()]
    assert names and all(n.rsplit(".", 1)[-1] in ("lora_A", "lora_B") for n in names)
    frozen = [n for n, p in m.named_parameters() if not p.requires_grad]
    assert any("norm" in n for n in frozen)
    assert m.model.embed_tokens.weight.format == "q8_0"  # packed: never a trainable tensor
    wanted = list(LINEAR_SHAPES) if targets == "all-linear" else targets
    per_layer = sum(r * (LINEAR_SHAPES[t][0] + LINEAR_SHAPES[t][1]) for t in wanted)
    assert m.trainable_parameters() == mf.LAYERS * per_layer


def test_unknown_target_lists_available(hf_dir):
    with pytest.raises(ConfigError, match="qproj") as e:
        apply_lora(_model(hf_dir), {"targets": ["qproj"]})
    for name in LINEAR_SHAPES:
        assert name in str(e.value)
    with pytest.raises(ConfigError, match="matched no"):
        apply_lora(_model(hf_dir), {"targets": r"nothing\.here"})


def test_layers_the_model_lacks_are_named_as_layers(hf_dir):
    """A layer index past the model's said "no module named 'q_proj'" while listing q_proj."""
    last = mf.LAYERS - 1
    with pytest.raises(ConfigError) as e:
        apply_lora(_model(hf_dir), {"targets": ["q_proj"], "layers": [0, 99, 7 + mf.LAYERS]})
    assert str(e.value) == (f"lora.layers: the model has no layer {7 + mf.LAYERS}, 99 (its "
                            f"layers: 0 to {last})")
    with pytest.raises(ConfigError) as e:  # lm_head lies in no decoder layer
        apply_lora(_model(hf_dir), {"targets": ["q_proj", "lm_head"], "layers": [last]})
    assert str(e.value) == f"lora.targets: 'lm_head' is in none of lora.layers [{last}]"


def test_a_second_apply_lora_is_refused(hf_dir):
    """It said "no module named 'q_proj'" (q_proj was wrapped) while listing linear modules."""
    m = apply_lora(_model(hf_dir), {"targets": ["q_proj"], "rank": 2})
    with pytest.raises(ConfigError, match=f"already has LoRA adapters on {mf.LAYERS} modules"):
        apply_lora(m, {"targets": ["v_proj"], "rank": 2})


def test_kaiming_and_gaussian_init(hf_dir):
    m = apply_lora(_model(hf_dir), {"targets": "all-linear", "rank": 8})
    for path in m.lora_paths:
        layer = m.get_module(path)
        bound = 1 / np.sqrt(layer.in_features)
        a = layer.lora_A.numpy()
        assert np.abs(a).max() <= bound and np.abs(a).max() > 0.9 * bound
        assert not layer.lora_B.numpy().any()
    r = 8
    m = apply_lora(_model(hf_dir), {"targets": "all-linear", "rank": r, "init": "gaussian"})
    a = np.concatenate([m.get_module(p).lora_A.numpy().ravel() for p in m.lora_paths])
    assert abs(a.std() * r - 1) < 0.05 and abs(a.mean()) < 0.01
    assert not any(m.get_module(p).lora_B.numpy().any() for p in m.lora_paths)


def test_initial_adapter_leaves_output_unchanged(hf_dir):
    ids = np.arange(12, dtype=np.int32).reshape(2, 6) % mf.VOCAB
    base = _model(hf_dir)
    with without_autodiff():
        want = base(ids).numpy()
        got = apply_lora(_model(hf_dir), {"targets": "all-linear", "rank": 4})(ids).numpy()
    np.testing.assert_array_equal(got, want)


def test_loftq_reduces_quantization_error(hf_dir):
    r = 8
    m = apply_lora(_model(hf_dir), {"targets": ["q_proj", "down_proj"], "rank": r, "alpha": 16,
                                    "init": "loftq"})
    src = open_source(hf_dir)
    for path in m.lora_paths:
        layer = m.get_module(path)
        w = src.get(f"{path}.weight").astype(np.float64)
        deq = layer.weight.dequantize().astype(np.float64)
        err0 = np.linalg.norm(w - deq)
        err1 = np.linalg.norm(w - deq - layer.delta_weight())
        assert err1 < 0.9 * err0, path
        assert layer.lora_B.numpy().any()


def test_loftq_iterations_fit_better_and_change_the_base(hf_dir):
    """More LoftQ alternations: a smaller ||W - (deq(Q) + s B A)||, with Q no longer Q(W)."""
    src = open_source(hf_dir)
    lora = {"targets": ["q_proj", "down_proj"], "rank": 4, "alpha": 8, "init": "loftq"}
    one = apply_lora(_model(hf_dir), lora)
    three = apply_lora(_model(hf_dir), {**lora, "loftq_iter": 3})
    for path in one.lora_paths:
        w = src.get(f"{path}.weight").astype(np.float64)
        err = [np.linalg.norm(w - m.get_module(path).weight.dequantize()
                              - m.get_module(path).delta_weight()) for m in (one, three)]
        assert err[1] < err[0], path
        base1, base3 = (m.get_module(path).weight.dequantize() for m in (one, three))
        assert not np.array_equal(base1, base3)  # LoftQ picked another quantized base
    assert three.get_module(path).weight.format == "nf4"


def test_loftq_rank_beyond_the_weight_is_a_config_error(hf_dir):
    with pytest.raises(ConfigError, match=r"lora.rank: 80 .*\(at most 64\)"):
        apply_lora(_model(hf_dir), {"targets": ["q_proj"], "rank": 80, "init": "loftq"})
    plan_cfg = {"model": str(hf_dir), "data": {"train": "x"}, "quant": {"format": "nf4"},
                "lora": {"targets": ["q_proj"], "rank": 80, "init": "loftq"}}
    with pytest.raises(ConfigError, match="lora.rank"):
        plan(plan_cfg)


def test_loftq_errors_on_gguf_and_float_bases(hf_dir, tmp_path):
    path, _ = mf.write_gguf(tmp_path / "m.gguf", "llama", "Q4_0")
    model = load_model(path, DEV, with_tokenizer=False)
    with pytest.raises(ConfigError, match=r"loftq.*already quantized.*Q4_0|loftq.*q4_0"):
        apply_lora(model, {"targets": ["q_proj"], "init": "loftq"})
    with pytest.raises(ConfigError, match="loftq"):
        apply_lora(_model(hf_dir, quant="none"), {"targets": ["q_proj"], "init": "loftq"})


# --- PEFT format -----------------------------------------------------------------------------
def _trained_like(model):
    """Give every adapter tensor random values (as if trained)."""
    for i, (_, p) in enumerate(model.trainable()):
        p.data[...] = np.random.default_rng(100 + i).standard_normal(p.shape) * 0.1
    return model


@pytest.mark.parametrize("dora", [False, True])
def test_save_adapter_peft_layout(hf_dir, tmp_path, dora):
    m = apply_lora(_model(hf_dir), {"targets": ["q_proj", "up_proj"], "rank": 4, "alpha": 8,
                                    "use_dora": dora, "rank_pattern": {"up_proj": 2}})
    save_adapter(m, tmp_path)
    with safe_open(str(tmp_path / "adapter_model.safetensors"), "np") as f:
        meta = f.metadata()
        assert meta["format"] == "pt"  # PEFT's; the base it was trained on rides along
        base = json.loads(meta["packlora.base"])
        assert base["name"] == str(hf_dir) and base["size"] > 0 and base["quant"]["format"]
        keys = set(f.keys())
        shapes = {k: f.get_tensor(k).shape for k in keys}
    want = set()
    for i in range(mf.LAYERS):
        for name, r in (("self_attn.q_proj", 4), ("mlp.up_proj", 2)):
            pre = f"base_model.model.model.layers.{i}.{name}"
            out, inp = LINEAR_SHAPES[name.split(".")[1]]
            want |= {f"{pre}.lora_A.weight", f"{pre}.lora_B.weight"}
            assert shapes[f"{pre}.lora_A.weight"] == (r, inp)
            assert shapes[f"{pre}.lora_B.weight"] == (out, r)
            if dora:
                want.add(f"{pre}.lora_magnitude_vector")
                assert shapes[f"{pre}.lora_magnitude_vector"] == (out,)
    assert keys == want
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM"
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and cfg["use_dora"] is dora
    assert sorted(cfg["target_modules"]) == ["q_proj", "up_proj"]
    assert cfg["rank_pattern"] == {f"model.layers.{i}.mlp.up_proj": 2 for i in range(mf.LAYERS)}
    for key in ("lora_dropout", "use_rslora", "bias", "base_model_name_or_path", "fan_in_fan_out"):
        assert key in cfg
    assert set(cfg) <= PEFT_LORA_KEYS  # PEFT's LoraConfig fields and nothing of our own
    assert cfg["init_lora_weights"] is True  # the default kaiming init is PEFT's True


# Fields of PEFT's LoraConfig (and its PeftConfig base) that adapter_config.json may carry
PEFT_LORA_KEYS = {
    "peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "target_modules",
    "rank_pattern", "alpha_pattern", "use_rslora", "use_dora", "bias", "fan_in_fan_out",
    "inference_mode", "modules_to_save", "layers_to_transform", "layers_pattern",
    "init_lora_weights", "base_model_name_or_path", "revision", "auto_mapping"}


def test_adapter_config_says_which_init_and_which_base(hf_dir, tmp_path):
    m = apply_lora(_model(hf_dir), {"targets": ["q_proj"], "rank": 2, "init": "gaussian"})
    save_adapter(m, tmp_path / "g")
    cfg = json.loads((tmp_path / "g" / "adapter_config.json").read_text())
    assert cfg["init_lora_weights"] == "gaussian" and "loftq_config" not in cfg
    assert cfg["base_model_name_or_path"] == str(hf_dir)   # the path as given, reusable
    m = apply_lora(_model(hf_dir), {"targets": ["q_proj"], "rank": 2, "init": "loftq"})
    save_adapter(m, tmp_path / "l")
    cfg = json.loads((tmp_path / "l" / "adapter_config.json").read_text())
    # PEFT refuses init_lora_weights "loftq" without a loftq_config
    assert cfg["init_lora_weights"] == "loftq"
    assert cfg["loftq_config"] == {"loftq_bits": 4, "loftq_iter": 1}
    assert set(cfg) <= PEFT_LORA_KEYS | {"loftq_config"}


@pytest.mark.parametrize("dora", [False, True])
def test_load_adapter_roundtrip_exact(hf_dir, tmp_path, dora):
    m = _trained_like(apply_lora(_model(hf_dir), {"targets": "all-linear", "rank": 4,
                                                  "alpha_pattern": {"o_proj": 5.0},
                                                  "rank_pattern": {"gate_proj": 2},
                                                  "use_rslora": True, "use_dora": dora}))
    save_adapter(m, tmp_path)
    fresh = load_adapter(_model(hf_dir, seed=9), tmp_path)
    got, want = dict(fresh.trainable()), dict(m.trainable())
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name].numpy(), want[name].numpy())
    for path in m.lora_paths:
        a, b = m.get_module(path), fresh.get_module(path)
        assert (a.rank, a.alpha, a.scale, a.use_dora) == (b.rank, b.alpha, b.scale, b.use_dora)
    ids = (np.arange(16, dtype=np.int32) * 7 % mf.VOCAB).reshape(2, 8)
    with without_autodiff():
        np.testing.assert_array_equal(fresh(ids).numpy(), m(ids).numpy())


@pytest.mark.parametrize("targets", [r".*\.1\.mlp\.up_proj", "all-linear"])
def test_roundtrip_keeps_exactly_the_adapted_modules(hf_dir, tmp_path, targets):
    m = _trained_like(apply_lora(_model(hf_dir), {"targets": targets, "rank": 2}))
    save_adapter(m, tmp_path)
    fresh = load_adapter(_model(hf_dir), tmp_path)
    assert sorted(fresh.lora_paths) == sorted(m.lora_paths)
    assert fresh.trainable_parameters() == m.trainable_parameters()


def test_load_adapter_layers_to_transform_as_int(hf_dir, tmp_path):
    m = _trained_like(apply_lora(_model(hf_dir), {"targets": ["k_proj"], "rank": 2,
                                                  "layers": [1]}))
    save_adapter(m, tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["layers_to_transform"] == [1]
    cfg["layers_to_transform"] = 1  # PEFT allows a single int
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    assert load_adapter(_model(hf_dir), tmp_path).lora_paths == ["model.layers.1.self_attn.k_proj"]


@pytest.mark.parametrize("change, problem", [
    ({"lora_alpha": -4}, "lora_alpha: must be greater than 0, got -4"),
    ({"r": "x"}, "r: expected an integer"),
    ({"rank_pattern": [1]}, r"rank_pattern: expected a mapping, got \[1\]"),
    ({"alpha_pattern": {"k_proj": "x"}}, "alpha_pattern.k_proj: expected a number, got 'x'"),
    ({"peft_type": "IA3"}, "peft_type 'IA3' is no LoRA adapter"),
    ({"target_modules": "k_proj"}, "target_modules: 'k_proj' matched no linear module"),
    ({"layers_to_transform": 7}, "layers_to_transform: the model has no layer 7"),
    ({"init_lora_weights": "pissa_niter_4"}, "init_lora_weights 'pissa_niter_4': PEFT made "
                                             "this adapter on a base it rewrote"),
    ({"init_lora_weights": "olora"}, "init_lora_weights 'olora': .*path_initial_model_for"),
])
def test_adapter_config_values_are_named_by_the_file_s_keys(hf_dir, tmp_path, change, problem):
    """adapter_config.json's values were checked as a YAML lora: section and named so
    ("lora: alpha: ..."), a non-LoRA peft_type was read as LoRA, rank_pattern [1] was an
    internal AttributeError, and a PiSSA / OLoRA adapter (trained against a base PEFT rewrote
    to W minus the adapter's start) was applied to W as it is. (A string target_modules is a
    regex of the whole module name, as in PEFT, so 'k_proj' alone matches none.)"""
    save_adapter(apply_lora(_model(hf_dir), {"targets": ["k_proj"], "rank": 2}), tmp_path)
    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(ModelError, match=f"^{path}: {problem}"):
        load_adapter(_model(hf_dir), tmp_path)


def test_an_adapter_with_a_whole_trained_module_is_refused_by_name(hf_dir, tmp_path):
    """PEFT's modules_to_save keeps whole trained modules (here the LM head) in the adapter;
    loading one said the model had no module 'lm_head.modules_to_save.weight'."""
    save_adapter(apply_lora(_model(hf_dir), {"targets": ["k_proj"], "rank": 2}), tmp_path)
    weights = tmp_path / "adapter_model.safetensors"
    with safe_open(str(weights), framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["base_model.model.lm_head.modules_to_save.default.weight"] = np.zeros(
        (mf.VOCAB, mf.HIDDEN), np.float32)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(ModelError, match="'lm_head.modules_to_save.weight' is no LoRA or DoRA "
                                         "weight of a linear layer"):
        load_adapter(_model(hf_dir), tmp_path)


def test_load_peft_style_keys(hf_dir, tmp_path):
    """An adapter as PEFT's in-memory state dict names it: `.default.` keys, DoRA magnitude
    with a `.weight` suffix."""
    rng = np.random.default_rng(0)
    tensors, pre = {}, "base_model.model.model.layers"
    for i in range(mf.LAYERS):
        out, inp = LINEAR_SHAPES["v_proj"]
        tensors[f"{pre}.{i}.self_attn.v_proj.lora_A.default.weight"] = \
            rng.standard_normal((2, inp)).astype(np.float32)
        tensors[f"{pre}.{i}.self_attn.v_proj.lora_B.default.weight"] = \
            rng.standard_normal((out, 2)).astype(np.float32)
        tensors[f"{pre}.{i}.self_attn.v_proj.lora_magnitude_vector.default.weight"] = \
            rng.random(out).astype(np.float32) + 0.5
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["v_proj"],
         "use_dora": True, "lora_dropout": 0.1, "bias": "none"}))
    m = load_adapter(_model(hf_dir), tmp_path)
    assert len(m.lora_paths) == mf.LAYERS
    for i in range(mf.LAYERS):
        layer = m.get_module(f"model.layers.{i}.self_attn.v_proj")
        assert layer.use_dora and layer.scale == 2.0
        key = f"{pre}.{i}.self_attn.v_proj."
        np.testing.assert_array_equal(layer.lora_A.numpy(), tensors[key + "lora_A.default.weight"])
        np.testing.assert_array_equal(layer.lora_B.numpy(), tensors[key + "lora_B.default.weight"])
        np.testing.assert_array_equal(layer.lora_magnitude_vector.numpy(),
                                      tensors[key + "lora_magnitude_vector.default.weight"])

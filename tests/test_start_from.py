"""lora.start_from: a run that continues training an adapter — its own earlier run, a PEFT
folder, or a llama.cpp LoRA GGUF — starts from exactly that adapter's weights, and an adapter
the run's lora section does not fit is refused by name before anything is written."""
import warnings

import pytest
from packlora import export_gguf_adapter, load_model
from packlora.adapters import adapter_state, apply_lora
from packlora.adapters.peft_io import BaseMismatchWarning
from packlora.errors import ConfigError
from packlora.training.run import finetune
from safetensors.numpy import load_file
from test_trainer import run_cfg, tiny_run_files


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    setup = tiny_run_files(tmp_path_factory)
    out = setup["dir"] / "first"
    first = finetune(run_cfg(setup, out, max_steps=12, lr=3e-2), progress=False)
    return setup, out, first.history


def _weights(folder):
    return load_file(str(folder / "adapter_model.safetensors"))


@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_a_run_starts_from_the_adapter_s_weights(trained, tmp_path, source):
    """With a learning rate too small to move a float32 weight, the run's adapter is the one it
    started from, bit for bit; and its first loss is the trained adapter's, not a fresh one's."""
    setup, first, history = trained
    start = first
    if source == "gguf":
        start = export_gguf_adapter(first, tmp_path / "first.gguf", model=setup["model"])
    cfg = run_cfg(setup, tmp_path / "again", max_steps=1, lr=1e-30, warmup_steps=0)
    cfg["lora"]["start_from"] = str(start)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BaseMismatchWarning)  # the same base: nothing to say
        again = finetune(cfg, progress=False)
    got, want = _weights(tmp_path / "again"), _weights(first)
    assert sorted(got) == sorted(want)
    for key in want:
        assert (got[key] == want[key]).all(), key
    fresh = finetune(run_cfg(setup, tmp_path / "fresh", max_steps=1), progress=False)
    assert again.history[0]["loss"] < 0.8 * fresh.history[0]["loss"]
    assert again.history[0]["loss"] < history[0]["loss"]


def test_an_adapter_the_run_does_not_fit_is_refused(trained, tmp_path):
    setup, first, _ = trained
    cases = [({"alpha": 16}, r"down_proj has rank 4, scale 2 in .*first; the run's lora section "
                             r"gives rank 4, scale 4"),
             ({"rank": 8}, r"has rank 4, .* gives rank 8"),
             ({"targets": ["q_proj", "v_proj"]}, r"adapts model.layers.0.mlp.down_proj, which "
                                                 r"lora.targets / lora.layers leave out"),
             ({"start_from": str(tmp_path / "nope")}, r"lora.start_from: .*nope/adapter_config"
                                                      r".json: adapter file not found")]
    for lora, words in cases:
        cfg = run_cfg(setup, tmp_path / "out", max_steps=1)
        cfg["lora"].update({"start_from": str(first), **lora})
        with pytest.raises(ConfigError, match=words):
            finetune(cfg, progress=False)
        assert not (tmp_path / "out").exists()
    cfg = run_cfg(setup, tmp_path / "out", max_steps=1)
    cfg["lora"].update({"start_from": str(first), "init": "loftq"})
    with pytest.raises(ConfigError, match="from an adapter's weights or from LoftQ's"):
        finetune(cfg, progress=False)


def test_apply_lora_starts_from_the_adapter_too(trained):
    """The Python API's apply_lora reads start_from as finetune does (it once ignored it)."""
    setup, first, _ = trained
    cfg = run_cfg(setup, first)["lora"]
    model = apply_lora(load_model(setup["model"], quant="nf4"), {**cfg, "start_from": str(first)})
    want = _weights(first)
    got = adapter_state(model)
    assert sorted(got) == sorted(want)
    for key in want:
        assert (got[key] == want[key]).all(), key

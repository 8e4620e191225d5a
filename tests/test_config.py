"""Tests for the run configuration: validation, coercion, overrides and error messages."""
from pathlib import Path

import pytest
import yaml
from packlora.config import (
    DataConfig,
    LoraConfig,
    QuantConfig,
    RunConfig,
    TrainConfig,
    load_config,
    parse_config,
)
from packlora.errors import ConfigError
from pydantic import ValidationError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = {
    "model": "smollm2-135m-instruct",
    "device": "cpu",
    "quant": {"format": "nf4", "block_size": 64, "double_quant": True},
    "lora": {"rank": 16, "alpha": 32, "dropout": 0.0,
             "targets": ["q_proj", "k_proj", "v_proj", "o_proj"], "layers": None,
             "rank_pattern": {}, "alpha_pattern": {}, "use_rslora": False, "use_dora": False,
             "init": "kaiming"},
    "data": {"train": "data/train.jsonl", "valid": None, "val_size": 0, "format": "auto",
             "max_seq_len": 512, "train_on_inputs": False, "packing": False, "shuffle": True},
    "train": {"max_steps": 200, "epochs": None, "batch_size": 4, "grad_accum": 1, "lr": 2.0e-4,
              "schedule": "cosine", "warmup_steps": 10, "warmup_ratio": None,
              "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1.0e-8, "max_grad_norm": 1.0,
              "grad_checkpointing": False, "eval_every": 50, "save_every": 50, "keep_last": 2,
              "log_every": 1, "seed": 0, "loss_chunk": 256},
    "resume": None, "overwrite": False, "output_dir": "runs/demo",
}
MINIMAL = {"model": "m", "data": {"train": "t.jsonl"}}


def write(tmp_path, text, name="x.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    return str(info.value)


def test_example_dict_validates_and_round_trips():
    cfg = parse_config(EXAMPLE)
    assert cfg.lora.rank == 16 and cfg.train.betas == (0.9, 0.999)
    assert cfg.train.max_steps == 200 and cfg.train.epochs is None
    again = parse_config(yaml.safe_load(cfg.to_yaml()))
    assert again == cfg


def test_shipped_configs_load():
    paths = sorted((ROOT / "configs").glob("**/*.y*ml"))
    loaded = [load_config(path) for path in paths]  # raises ConfigError naming a bad one
    assert len(loaded) == len(paths) and all(isinstance(c, RunConfig) for c in loaded)


def test_to_yaml_writes_file(tmp_path):
    cfg = parse_config(MINIMAL)
    out = tmp_path / "resolved.yaml"
    text = cfg.to_yaml(out)
    assert out.read_text() == text
    assert load_config(out) == cfg


def test_unknown_key_suggests_nearest(tmp_path):
    path = write(tmp_path, "model: m\ndata: {train: t.jsonl}\nlora:\n  rnak: 8\n")
    assert error_of(load_config, path) == f"{path}: lora.rnak: unknown key, did you mean 'rank'?"
    msg = error_of(parse_config, {**MINIMAL, "trian": {}}, source="c.yaml")
    assert msg == "c.yaml: trian: unknown key, did you mean 'train'?"


def test_data_fields_names_a_wrong_key(tmp_path):
    assert parse_config({**MINIMAL, "data": {"train": "t", "fields": {"prompt": "q"}}}
                        ).data.fields == {"prompt": "q"}
    msg = error_of(parse_config, {**MINIMAL, "data": {"train": "t", "fields": {"promt": "q"}}},
                   source="c.yaml")
    assert msg.startswith("c.yaml: data.fields: promt: no format reads this key")
    assert msg.endswith("did you mean 'prompt'?")
    msg = error_of(parse_config, {**MINIMAL, "data": {"train": "t", "fields": {"text": ""}}},
                   source="c")
    assert msg == "c: data.fields: text: expected the name of a key of the records, got ''"


def test_float_coercion_from_yaml(tmp_path):
    path = write(tmp_path, "model: m\ndata: {train: t.jsonl}\ntrain: {lr: 1e-5, eps: 1e-6}\n")
    assert yaml.safe_load(path.read_text())["train"]["lr"] == "1e-5"  # the PyYAML quirk
    cfg = load_config(path)
    assert cfg.train.lr == 1e-5 and isinstance(cfg.train.lr, float) and cfg.train.eps == 1e-6


def test_wrong_type_names_the_key(tmp_path):
    path = write(tmp_path, "model: m\ndata: {train: t.jsonl}\ntrain: {lr: fast}\n")
    assert error_of(load_config, path) == f"{path}: train.lr: expected a number, got 'fast'"
    msg = error_of(parse_config, {**MINIMAL, "train": {"batch_size": True}}, source="c")
    assert "train.batch_size: expected an integer" in msg
    msg = error_of(parse_config, {**MINIMAL, "train": {"schedule": "cosin"}}, source="c")
    assert "train.schedule:" in msg and "did you mean 'cosine'?" in msg


def test_malformed_yaml_names_the_line(tmp_path):
    path = write(tmp_path, "model: m\ndata:\n  train: t.jsonl\n  valid: [a, b\nlora: {}\n")
    msg = error_of(load_config, path)
    assert msg.startswith(f"{path}:5:") and "malformed YAML" in msg
    dup = write(tmp_path, "model: m\nmodel: n\ndata: {train: t}\n", "dup.yaml")
    assert error_of(load_config, dup).startswith(f"{dup}:2:")
    assert "not found" in error_of(load_config, tmp_path / "missing.yaml")


def test_overrides_win(tmp_path):
    path = write(tmp_path, "model: m\ndata: {train: t.jsonl}\ntrain: {lr: 1e-3}\n")
    cfg = load_config(path, ["train.lr=1e-4", "lora.targets=[q_proj,v_proj]",
                             "lora.rank_pattern.o_proj=4", "device=cuda:1", "resume=auto"])
    assert cfg.train.lr == 1e-4
    assert cfg.lora.targets == ["q_proj", "v_proj"]
    assert cfg.lora.rank_pattern == {"o_proj": 4}
    assert cfg.device == "cuda:1" and cfg.resume == "auto"


def test_bad_overrides(tmp_path):
    path = write(tmp_path, "model: m\ndata: {train: t.jsonl}\n")
    msg = error_of(load_config, path, ["lora.rnak=8"])
    assert msg == f"{path}: override 'lora.rnak=8': lora.rnak: unknown key, did you mean 'rank'?"
    assert "expected key.path=value" in error_of(load_config, path, ["train.lr"])
    assert "is a value, not a section" in error_of(load_config, path, ["train.lr.x=1"])
    msg = error_of(load_config, path, ["train.lr=fast"])
    assert msg == f"{path}: override 'train.lr=fast': train.lr: expected a number, got 'fast'"


def test_a_path_beside_the_config_but_not_here_is_named(tmp_path, monkeypatch):
    """Run from another folder, a config's relative data path said only "dataset file not
    found" once the model had loaded (and a model folder, "not a known model name")."""
    (tmp_path / "proj" / "data").mkdir(parents=True)
    (tmp_path / "proj" / "data" / "t.jsonl").write_text("{}\n")
    path = write(tmp_path / "proj", "model: m\ndata: {train: data/t.jsonl}\n")
    monkeypatch.chdir(tmp_path)
    msg = error_of(load_config, path)
    assert msg.startswith(f"{path}: data.train: data/t.jsonl is not in the current folder "
                          f"({tmp_path}) but is beside the config")
    monkeypatch.chdir(tmp_path / "proj")
    assert load_config(path).data.train == "data/t.jsonl"  # found from here: no complaint
    (tmp_path / "proj" / "auto").mkdir()  # resume: auto is no path, whatever lies beside it
    monkeypatch.chdir(tmp_path / "proj" / "data")
    assert load_config(path, ["data.train=t.jsonl", "resume=auto"]).resume == "auto"


def test_length_and_warmup_rules():
    assert parse_config({**MINIMAL, "train": {"epochs": 3}}).train.max_steps is None
    msg = error_of(parse_config, {**MINIMAL, "train": {"epochs": 3, "max_steps": 5}})
    assert "exactly one of max_steps and epochs" in msg
    msg = error_of(parse_config, {**MINIMAL, "train": {"max_steps": None}})
    assert "exactly one" in msg
    t = TrainConfig(warmup_ratio=0.1)
    assert t.warmup_steps == 0 and t.warmup(200) == 20 and t.total_steps(7) == 200
    assert TrainConfig(epochs=2, max_steps=None).total_steps(7) == 14
    with pytest.raises(ValidationError, match="lr"):
        TrainConfig(lr=0)


def test_section_rules():
    assert QuantConfig(format="q4_0").block_size == 32
    msg = error_of(parse_config, {**MINIMAL, "quant": {"format": "q8_0", "block_size": 64}})
    assert "q8_0 uses blocks of 32" in msg
    assert "power of two" in error_of(parse_config, {**MINIMAL, "quant": {"block_size": 48}})
    assert "lora.rank:" in error_of(parse_config, {**MINIMAL, "lora": {"rank": 0}})
    assert "invalid regex" in error_of(parse_config, {**MINIMAL, "lora": {"targets": "q_(proj"}})
    assert parse_config({**MINIMAL, "lora": {"targets": "all-linear"}}).lora.targets == \
        "all-linear"
    assert "device:" in error_of(parse_config, {**MINIMAL, "device": "gpu"})
    msg = error_of(parse_config, {"model": "m", "data": {"train": "t", "valid": "v",
                                                         "val_size": 10}})
    assert "not both" in msg
    assert DataConfig(train="t", val_size=0.1).val_size == 0.1
    assert DataConfig(train="t", val_size="20").val_size == 20
    assert "data: missing required key" in error_of(parse_config, {"model": "m"}, source="s")


def test_tf32_needs_a_gpu(tmp_path):
    """TF32 is a GPU tensor-core format: on the CPU it is an error naming the key and the file;
    on a GPU it is kept (off unless asked)."""
    assert parse_config(MINIMAL).tf32 is False
    assert parse_config({**MINIMAL, "device": "cuda:1", "tf32": True}).tf32 is True
    path = write(tmp_path, "model: m\ndata: {train: t.jsonl}\n")
    msg = error_of(load_config, path, ["tf32=true"])
    assert f"{path}: override 'tf32=true': tf32: needs device cuda" in msg and "\n" not in msg
    msg = error_of(load_config, write(tmp_path, "model: m\ntf32: true\ndata: {train: t}\n"))
    assert msg.endswith("x.yaml: tf32: needs device cuda (TF32 is a tensor-core format of "
                        "NVIDIA GPUs; the CPU computes in float32)")
    assert "tf32: expected true or false" in error_of(parse_config, {**MINIMAL, "tf32": "fast"})


def test_python_defaults_standalone():
    lora = LoraConfig(rank=8, alpha=16)
    assert lora.scaling() == 2.0 and lora.targets == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert LoraConfig(rank=16, alpha=32, use_rslora=True).scaling() == 8.0
    train = TrainConfig()
    assert train.max_steps == 200 and train.schedule == "cosine" and train.lr == 2e-4
    assert LoraConfig().rank_pattern is not LoraConfig().rank_pattern

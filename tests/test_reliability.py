"""What a run promises under faults: incomplete or damaged checkpoints are skipped (saying so),
a torn metrics line is tolerated, a resume that would continue a different run is refused,
damaged adapters and full disks are clear errors, and an unexpected error is one line."""
import errno
import fcntl
import json
import os
from pathlib import Path

import model_factory as mf
import numpy as np
import packlora.training.run as run_module
import packlora.training.trainer as trainer_module
import pytest
from packlora.adapters import apply_lora, load_adapter
from packlora.data import Example
from packlora.cli import main
from packlora.device import Device
from packlora.config import parse_config
from packlora.errors import ConfigError, DataError, ModelError, TrainingError
from packlora.models import load_model
from packlora.training import finetune
from packlora.training.checkpoints import MANIFEST, list_checkpoints
from packlora.training.fingerprint import check_resume, default_settings, fingerprint
from packlora.training.metrics import MetricsLog
from packlora.training.trainer import Trainer, train
from safetensors.numpy import load_file, save_file


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return mf.sums_run_files(tmp_path_factory.mktemp("rel"))


def cfg(d, out, **train):
    t = {"max_steps": 6, "batch_size": 2, "lr": 5e-3, "warmup_steps": 1, "eval_every": 0,
         "save_every": 2, "keep_last": 3, "seed": 0}
    t.update(train)
    return {"model": str(d / "model"), "quant": {"format": "nf4"},
            "lora": {"rank": 4, "alpha": 8, "dropout": 0.1, "targets": ["q_proj", "v_proj"]},
            "data": {"train": str(d / "train.jsonl"), "max_seq_len": 64}, "train": t,
            "resume": "auto", "output_dir": str(out)}


def losses(out):
    return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    finetune(cfg(setup, out), progress=False)
    return out


# --- checkpoints ----------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["no_manifest", "truncated", "flipped"])
def test_resume_skips_an_unusable_checkpoint_and_says_so(setup, tmp_path, reference, damage,
                                                         capsys):
    out = tmp_path / "run"
    c = cfg(setup, out)
    finetune(c, progress=False)
    step6 = out / "checkpoints" / "step-6"
    if damage == "no_manifest":
        (step6 / MANIFEST).unlink()
    elif damage == "truncated":
        p = step6 / "optimizer.safetensors"
        p.write_bytes(p.read_bytes()[:-7])
    else:  # same size, one byte changed: only the hash sees it
        p = step6 / "adapter_model.safetensors"
        raw = bytearray(p.read_bytes())
        raw[-3] ^= 0xFF
        p.write_bytes(bytes(raw))
    assert [s for s, _ in list_checkpoints(out)] == ([2, 4] if damage != "flipped" else
                                                     [2, 4, 6])
    (out / "adapter_model.safetensors").unlink()
    finetune(c, progress=False)  # resumes from step 4 and runs steps 5, 6 again
    said = capsys.readouterr().out
    assert "skipped checkpoint" in said and "step-6" in said
    assert losses(out) == losses(reference)
    got = load_file(str(out / "adapter_model.safetensors"))
    want = load_file(str(reference / "adapter_model.safetensors"))
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_a_named_checkpoint_that_is_damaged_is_an_error(setup, tmp_path):
    out = tmp_path / "run"
    finetune(cfg(setup, out, max_steps=2), progress=False)
    step2 = out / "checkpoints" / "step-2"
    (step2 / MANIFEST).unlink()
    c = cfg(setup, tmp_path / "other")
    c["resume"] = str(step2)
    with pytest.raises(ConfigError, match=r"^resume: .*step-2: no valid manifest"):
        finetune(c, progress=False)
    c["resume"] = str(out / "checkpoints" / "step-9")  # a typo: it said "its write was interrupted"
    with pytest.raises(ConfigError, match=r"^resume: .*step-9: no such folder"):
        finetune(c, progress=False)
    # the checkpoints' folder, or the run's: it said "no valid manifest.json", or (with the
    # output_dir holding a run) "is another folder's checkpoint"
    for given, listed in ((out / "checkpoints", "step-2"), (out, "checkpoints/step-2")):
        c["resume"] = str(given)
        with pytest.raises(ConfigError, match=rf"holds checkpoints \({listed}\) but is not one"):
            finetune(c, progress=False)
    assert not (tmp_path / "other").exists()  # refused before anything was written


class _Kill(Exception):
    pass


def test_torn_metrics_line_is_tolerated(setup, tmp_path, reference, monkeypatch):
    out = tmp_path / "run"
    real = Trainer.train_step

    def dies_at_5(self):
        if self.step == 4:
            raise _Kill
        return real(self)
    monkeypatch.setattr(Trainer, "train_step", dies_at_5)
    with pytest.raises(_Kill):
        finetune(cfg(setup, out), progress=False)
    monkeypatch.setattr(Trainer, "train_step", real)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 0.12')  # a kill in the middle of a line
    with pytest.warns(UserWarning, match=r"metrics.jsonl:5: .*torn"):
        finetune(cfg(setup, out), progress=False)
    assert losses(out) == losses(reference)


# --- resume fingerprint ---------------------------------------------------------------------
def test_resume_refuses_changed_settings_and_data(setup, tmp_path, reference):
    out = tmp_path / "run"
    finetune(cfg(setup, out, max_steps=4), progress=False)
    changed = cfg(setup, out, max_steps=8)
    changed["lora"]["alpha"] = 16
    with pytest.raises(TrainingError, match=r"lora.alpha: 8.0 -> 16.0.*train.max_steps: 4 -> 8"
                                            r".*resume_allow: \[lora.alpha, train.max_steps\]"):
        finetune(changed, progress=False)
    data = tmp_path / "more.jsonl"
    data.write_text(Path(setup / "train.jsonl").read_text() * 2)
    other = cfg(setup, out, max_steps=4)
    other["data"]["train"] = str(data)
    with pytest.raises(TrainingError, match=r"data.train: .* the training data: 12 examples"):
        finetune(other, progress=False)
    longer = cfg(setup, out, max_steps=6)
    longer["resume_allow"] = ["train.max_steps"]
    res = finetune(longer, progress=False)
    assert [r["step"] for r in res.history] == [5, 6]
    # a mistyped key allowed nothing, without a word; a section allows every key in it
    changed["resume_allow"] = ["train.max_step"]
    with pytest.raises(ConfigError, match="resume_allow: train.max_step: unknown key, did you "
                                          "mean 'max_steps'"):
        finetune(changed, progress=False)
    changed["resume_allow"] = ["lora", "train"]
    assert [r["step"] for r in finetune(changed, progress=False).history] == [7, 8]


def _run_bytes(out):
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file()}


def test_resume_auto_never_starts_over_on_a_run_it_cannot_continue(setup, tmp_path):
    """A checkpoint written for another adapter shape is this run differing, not a damaged
    checkpoint to pass over (it was passed over, and the fresh run then replaced the old one);
    a refused resume leaves every file as it was; and when every checkpoint is damaged,
    starting over needs overwrite: true."""
    out = tmp_path / "run"
    finetune(cfg(setup, out, max_steps=4), progress=False)
    before = _run_bytes(out)
    wider = cfg(setup, out, max_steps=4)
    wider["lora"]["rank"] = 8
    with pytest.raises(TrainingError, match=r"wrote .*step-4: lora.rank: 4 -> 8"):
        finetune(wider, progress=False)
    wider["resume_allow"] = ["lora.rank"]
    with pytest.raises(TrainingError, match=r"step-4: cannot read checkpoint .*needs \(8, 64\)"):
        finetune(wider, progress=False)
    assert _run_bytes(out) == before  # run_config.yaml too: it still describes the run kept
    for step in (2, 4):
        (out / "checkpoints" / f"step-{step}" / MANIFEST).unlink()
    before = _run_bytes(out)
    with pytest.raises(TrainingError, match=r"no checkpoint to continue in .*step-2, .*step-4, "
                                            r".*adapter_model.safetensors\); starting over "
                                            r"would replace it: set overwrite: true"):
        finetune(cfg(setup, out, max_steps=4), progress=False)
    assert _run_bytes(out) == before
    again = cfg(setup, out, max_steps=4)
    again["overwrite"] = True
    assert [r["step"] for r in finetune(again, progress=False).history] == [1, 2, 3, 4]
    assert [s for s, _ in list_checkpoints(out)] == [2, 4]


def test_a_folder_another_run_is_using_is_refused(setup, tmp_path):
    """The same command started twice (two terminals, a job resubmitted) trained both runs
    into one folder, mixing their checkpoints and metrics; with overwrite: true the second
    deleted the running one's files. A run holds output_dir for its life (flock on the folder,
    released however the process ends); the holder here stands for that other process."""
    out = tmp_path / "run"
    finetune(cfg(setup, out, max_steps=2), progress=False)
    before = _run_bytes(out)
    holder = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        again = dict(cfg(setup, out, max_steps=2), overwrite=True, resume=None)
        with pytest.raises(ConfigError, match=f"output_dir: {out} is in use by another packlora "
                                              "run"):
            finetune(again, progress=False)
        assert _run_bytes(out) == before
    finally:
        os.close(holder)
    assert [r["step"] for r in finetune(again, progress=False).history] == [1, 2]
    # a run stopped by its data before writing leaves no folder it made, parents included
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    stopped = cfg(setup, tmp_path / "new" / "deeper" / "run")
    stopped["data"]["train"] = str(bad)
    with pytest.raises(DataError, match="bad JSON"):
        finetune(stopped, progress=False)
    assert not (tmp_path / "new").exists()


def test_train_called_alone_holds_its_output_dir_too(setup, tmp_path):
    """train() of the Python API took no lock: two processes training into one folder mixed
    their checkpoints. It holds output_dir as finetune does (finetune calls it: a process enters
    a lock it holds again)."""
    model = load_model(str(setup / "model"), Device.cpu().autodiff(), quant="nf4")
    apply_lora(model, {"targets": ["q_proj"], "rank": 2, "alpha": 4})
    ids = np.arange(1, 9, dtype=np.int32)
    rows = [Example(ids, np.roll(ids, -1).astype(np.int64))] * 2
    steps = {"max_steps": 1, "batch_size": 2, "save_every": 1, "eval_every": 0}
    out = tmp_path / "run"
    out.mkdir()
    holder = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ConfigError, match=f"output_dir: {out} is in use by another packlora "
                                              "run"):
            train(model, rows, steps, output_dir=out, progress=False)
        assert list(out.iterdir()) == []
    finally:
        os.close(holder)
    assert [r["step"] for r in train(model, rows, steps, output_dir=out, progress=False)] == [1]
    assert [s for s, _ in list_checkpoints(out)] == [1]


def test_resume_of_a_checkpoint_older_than_a_setting():
    """A checkpoint written before a setting existed ran with its default: resuming with the
    default is no change, with another value it is, and the message says from what."""
    run = parse_config({"model": "m", "device": "cuda", "data": {"train": "t.jsonl"}})
    now = fingerprint(run, [], world_size=1)
    old = json.loads(json.dumps(now))
    for key in ("tf32", "train.step_in_backward", "world_size"):  # none of them recorded yet
        del old["settings"][key]
    check_resume(old, now, defaults=default_settings(run))
    with pytest.raises(TrainingError, match="tf32: None -> False"):  # without the defaults
        check_resume(old, now)
    now["settings"]["tf32"] = True
    with pytest.raises(TrainingError, match=r"tf32: False -> True.*resume_allow: \[tf32\]"):
        check_resume(old, now, defaults=default_settings(run))


# --- damaged adapters, full disks, unexpected errors ---------------------------------------
def test_adapter_with_nan_names_the_tensor(setup, tmp_path, reference):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((reference / "adapter_config.json").read_text())
    tensors = load_file(str(reference / "adapter_model.safetensors"))
    key = sorted(tensors)[1]
    tensors[key][0, 0] = np.nan
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(ModelError, match=rf"tensor '{key}' has 1 NaN or infinite"):
        load_adapter(load_model(str(setup / "model"), Device.cpu()), bad)


def test_full_disk_at_the_final_adapter_keeps_the_checkpoints(setup, tmp_path, monkeypatch):
    out = tmp_path / "run"
    real = run_module.save_adapter

    def full(model, folder):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(run_module, "save_adapter", full)
    with pytest.raises(TrainingError, match=r"cannot write the adapter .*No space left.*step-6"):
        finetune(cfg(setup, out), progress=False)
    monkeypatch.setattr(run_module, "save_adapter", real)
    assert [s for s, _ in list_checkpoints(out)] == [2, 4, 6]
    finetune(cfg(setup, out), progress=False)  # the retry only writes the adapter
    assert (out / "adapter_model.safetensors").is_file()


def test_unexpected_error_is_one_line_unless_debug(setup, tmp_path, monkeypatch, capsys):
    def broken(*a, **k):
        raise ValueError("something internal")
    monkeypatch.setattr("packlora.cli.finetune", broken)
    yaml_path = tmp_path / "c.yaml"
    yaml_path.write_text(json.dumps(cfg(setup, tmp_path / "o")))
    assert main(["finetune", str(yaml_path)]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ValueError: something internal" in err
    assert "this is a bug" in err and "Traceback" not in err
    assert main(["finetune", str(yaml_path), "--debug"]) == 3
    assert "Traceback" in capsys.readouterr().err


@pytest.mark.parametrize("writer", ["metrics", "plot", "run_config"])
def test_full_disk_in_any_writer_is_one_line_and_keeps_the_checkpoint(setup, tmp_path,
                                                                       monkeypatch, capsys,
                                                                       writer):
    out = tmp_path / "run"
    yaml_path = tmp_path / "c.yaml"
    yaml_path.write_text(json.dumps(cfg(setup, out)))
    assert main(["finetune", str(yaml_path), "--quiet"]) == 0  # a first run: checkpoints exist
    before = [s for s, _ in list_checkpoints(out)]

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(out / writer))
    target = {"metrics": (MetricsLog, "write"), "plot": (MetricsLog, "plot"),
              "run_config": (trainer_module, "write_text")}[writer]
    monkeypatch.setattr(*target, full)
    longer = cfg(setup, out, max_steps=8)
    longer["resume_allow"] = ["train.max_steps"]
    yaml_path.write_text(json.dumps(longer))
    assert main(["finetune", str(yaml_path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err and "Traceback" not in err
    assert before[-1] in [s for s, _ in list_checkpoints(out)]  # complete, resumable

"""Training that fails: a NaN loss or gradient, a full disk, a damaged checkpoint, bad data;
each a clear error, and what was written before is kept."""
import errno
from pathlib import Path

import numpy as np
import packlora.training.checkpoints as ckpt_mod
import pytest
from packlora.errors import DataError, TrainingError
from packlora.models import LlamaForCausalLM
from packlora.training.checkpoints import list_checkpoints, load_checkpoint
from packlora.training.run import finetune
from test_trainer import _examples, _trainer, run_cfg, tiny_run_files


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_run_files(tmp_path_factory)


def test_nan_loss_stops_with_clear_error_and_keeps_checkpoint(setup, tmp_path, monkeypatch):
    out = tmp_path / "nan"
    orig = LlamaForCausalLM.target_loss
    calls = {"n": 0}

    def poisoned(self, *a, **k):
        calls["n"] += 1
        loss = orig(self, *a, **k)
        if calls["n"] >= 3:
            loss.data[...] = np.nan
        return loss
    monkeypatch.setattr(LlamaForCausalLM, "target_loss", poisoned)
    with pytest.raises(TrainingError, match=r"step 3.*nan.*not finite") as e:
        finetune(run_cfg(setup, out, save_every=2), progress=False)
    assert f"{out / 'checkpoints' / 'step-2'} (step 2) is intact. Lower train.lr" in str(e.value)
    monkeypatch.setattr(LlamaForCausalLM, "target_loss", orig)
    assert [s for s, _ in list_checkpoints(out)] == [2]
    tr = _trainer(setup["model"], _examples(4, 8))
    state = load_checkpoint(out / "checkpoints" / "step-2", tr.model, tr.opt)
    assert state["step"] == 2 and tr.opt.t == 2
    assert all(np.isfinite(p.numpy()).all() for _, p in tr.model.trainable())


def test_a_base_that_gives_nan_is_named_before_any_update(setup, tmp_path, monkeypatch):
    """A loss that is not finite at the first step comes from the model as loaded, not from a
    learning rate; and no checkpoint exists to point to."""
    orig = LlamaForCausalLM.target_loss

    def poisoned(self, *a, **k):
        loss = orig(self, *a, **k)
        loss.data[...] = np.inf
        return loss
    monkeypatch.setattr(LlamaForCausalLM, "target_loss", poisoned)
    with pytest.raises(TrainingError) as e:
        finetune(run_cfg(setup, tmp_path / "inf", save_every=2), progress=False)
    assert str(e.value) == ("training stopped at step 1: the loss is inf (not finite); no "
                            "checkpoint was written yet. It came before any update, from the "
                            "model as loaded: its weights may hold NaN or inf; check them, or "
                            "the data")


def test_step_in_backward_stops_on_a_gradient_that_is_not_finite(setup, monkeypatch):
    """step_in_backward on the CPU checks each gradient before its update (on a GPU the norm is
    summed where the gradients live and checked once, after backward): a NaN gradient stops the
    run, and no adapter took it."""
    tr = _trainer(setup["model"], _examples(4, 8), batch_size=4, max_grad_norm=None,
                  step_in_backward=True)
    orig = tr._apply_now

    def poisoned(p):  # each gradient as backward completes it
        p.grad.data[...] = np.nan
        return orig(p)
    monkeypatch.setattr(tr, "_apply_now", poisoned)
    before = {n: p.numpy().copy() for n, p in tr.model.trainable()}
    with pytest.raises(TrainingError, match=r"step 1: the gradient norm is nan \(not finite\)"):
        tr.run()
    for n, p in tr.model.trainable():
        np.testing.assert_array_equal(p.numpy(), before[n], err_msg=n)


def test_disk_full_keeps_previous_checkpoint(setup, tmp_path, monkeypatch):
    out = tmp_path / "full"
    orig = ckpt_mod.save_safetensors
    calls = {"n": 0}

    def flaky(path, arrays, metadata=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return orig(path, arrays, metadata)
    monkeypatch.setattr(ckpt_mod, "save_safetensors", flaky)
    with pytest.raises(TrainingError, match=r"step-4: No space left.*step-2 is intact"):
        finetune(run_cfg(setup, out, save_every=2), progress=False)
    assert [s for s, _ in list_checkpoints(out)] == [2]
    assert not (out / "checkpoints" / "step-4.tmp").exists()
    tr = _trainer(setup["model"], _examples(4, 8))
    state = load_checkpoint(out / "checkpoints" / "step-2", tr.model, tr.opt)
    assert state["step"] == 2


def test_damaged_or_foreign_checkpoint_is_a_clear_error(setup, tmp_path):
    out = tmp_path / "c"
    finetune(run_cfg(setup, out, max_steps=2, save_every=2), progress=False)
    step = out / "checkpoints" / "step-2"
    tr = _trainer(setup["model"], _examples(4, 8))
    tr.opt.params.append(("extra.lora_A", tr.opt.params[0][1]))  # a param the file lacks
    tr.opt.m["extra.lora_A"] = tr.opt.m[tr.opt.params[0][0]]
    with pytest.raises(TrainingError, match="extra.lora_A.exp_avg"):
        load_checkpoint(step, tr.model, tr.opt)
    (step / "optimizer.safetensors").write_bytes(b"\x00" * 5)
    with pytest.raises(TrainingError, match="cannot read checkpoint"):
        load_checkpoint(step, _trainer(setup["model"], _examples(4, 8)).model, tr.opt)


def test_malformed_jsonl_names_file_and_line(setup, tmp_path):
    bad = tmp_path / "bad.jsonl"
    good = Path(setup["train"]).read_text().splitlines()
    bad.write_text("\n".join(good[:2] + ['{"messages": [oops'] + good[2:]) + "\n")
    cfg = run_cfg(setup, tmp_path / "o")
    cfg["data"]["train"] = str(bad)
    with pytest.raises(DataError, match=rf"{bad}:3: bad JSON"):
        finetune(cfg, progress=False)


def test_empty_dataset(setup, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    cfg = run_cfg(setup, tmp_path / "o")
    cfg["data"]["train"] = str(empty)
    with pytest.raises(DataError, match="no records"):
        finetune(cfg, progress=False)
    with pytest.raises(DataError, match="empty dataset"):
        _trainer(setup["model"], [])

"""Training: AdamW, schedules, clipping, accumulation, checkpointing, metrics, checkpoints,
bit-exact resume and a busy output dir (the failures: test_trainer_failures.py)."""
import io
import json
from pathlib import Path

import model_factory as mf
import numpy as np
import pytest
from packlora import Device, Tensor
from packlora.adapters import apply_lora
from packlora.config import TrainConfig
from packlora.data import Example, pack_examples
from packlora.errors import ConfigError, DataError
from packlora.models import load_model
from packlora.tracker import MemoryTracker
from packlora.training.checkpoints import list_checkpoints
from packlora.training.optim import AdamW, clip_grad_norm
from packlora.training.progress import Progress
from packlora.training.run import finetune
from packlora.training.schedule import Schedule
from packlora.training.trainer import Trainer, _bar_info, _memory_record, evaluate, train
from rich.console import Console


# --- a tiny chat model and data ---------------------------------------------------------------
def chat_data(path, n, seed=0):
    """n chat records `a+b` -> `a+b`; every record tokenizes to the same length."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        a, b = (int(v) for v in rng.integers(0, 5, 2))
        lines.append(json.dumps({"messages": [{"role": "user", "content": f"{a}+{b}"},
                                              {"role": "assistant", "content": str(a + b)}]}))
    Path(path).write_text("\n".join(lines) + "\n")
    return path


def tiny_run_files(tmp_path_factory):
    """A tiny chat model and its train/valid data, in a folder of their own."""
    d = tmp_path_factory.mktemp("trainer")
    model = mf.tiny_chat_model(d / "model")
    return {"model": str(model), "train": str(chat_data(d / "train.jsonl", 12)),
            "valid": str(chat_data(d / "valid.jsonl", 3, seed=1)), "dir": d}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_run_files(tmp_path_factory)


def run_cfg(setup, out, **train):
    t = {"max_steps": 6, "batch_size": 2, "lr": 5e-3, "warmup_steps": 1, "eval_every": 0,
         "save_every": 0, "seed": 0}
    t.update(train)
    return {"model": setup["model"], "quant": {"format": "nf4"},
            "lora": {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "down_proj"]},
            "data": {"train": setup["train"], "valid": setup["valid"], "max_seq_len": 64},
            "train": t, "output_dir": str(out)}


def losses(res):
    return [r["loss"] for r in res.history]


# --- optimizer, schedule, clipping ------------------------------------------------------------
def test_adamw_matches_numpy_reference():
    dev = Device.cpu()
    rng = np.random.default_rng(0)
    w0 = [rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal(5).astype(np.float32)]
    params = [("a", Tensor(w0[0].copy(), dev)), ("b", Tensor(w0[1].copy(), dev))]
    lr, b1, b2, eps, wd = 1e-2, 0.8, 0.95, 1e-6, 0.1
    opt = AdamW(params, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    ref = [w.astype(np.float64) for w in w0]
    m = [np.zeros_like(w) for w in ref]
    v = [np.zeros_like(w) for w in ref]
    for t in range(1, 4):
        step_lr = lr * t / 3
        grads = [rng.standard_normal(w.shape) for w in ref]
        for (_, p), g in zip(params, grads):
            p.grad = Tensor(g.astype(np.float32), dev)
        opt.step(step_lr)
        for i, g in enumerate(grads):
            g = g.astype(np.float32).astype(np.float64)
            ref[i] *= 1 - step_lr * wd
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            mhat, vhat = m[i] / (1 - b1 ** t), v[i] / (1 - b2 ** t)
            ref[i] -= step_lr * mhat / (np.sqrt(vhat) + eps)
        for (_, p), r in zip(params, ref):
            np.testing.assert_allclose(p.numpy(), r, rtol=1e-5, atol=1e-6)
    opt.zero_grad()
    assert all(p.grad is None for _, p in params)
    st = opt.state_arrays()
    np.testing.assert_allclose(st["a.exp_avg"], m[0], rtol=1e-5)
    np.testing.assert_allclose(st["b.exp_avg_sq"], v[1], rtol=1e-5)


def test_schedules_with_warmup():
    c = Schedule("constant", 1.0, 10, warmup_steps=4)
    assert [c(s) for s in (1, 2, 4, 5, 10)] == [0.25, 0.5, 1.0, 1.0, 1.0]
    lin = Schedule("linear", 2.0, 10, warmup_steps=2)
    assert [lin(s) for s in (1, 2, 6, 10)] == pytest.approx([1.0, 2.0, 1.0, 0.0])
    cos = Schedule("cosine", 2.0, 10, warmup_steps=2)
    assert [cos(s) for s in (1, 2, 6, 10)] == pytest.approx([1.0, 2.0, 1.0, 0.0])
    assert cos(4) == pytest.approx(1.0 + np.cos(np.pi * 0.25))
    assert Schedule("cosine", 1.0, 4)(1) == pytest.approx(0.5 * (1 + np.cos(np.pi / 4)))
    with pytest.raises(ValueError, match="unknown schedule"):
        Schedule("step", 1.0, 10)


def test_clip_grad_norm():
    dev = Device.cpu()
    a, b = Tensor(np.zeros(2, np.float32), dev), Tensor(np.zeros(1, np.float32), dev)
    a.grad, b.grad = Tensor(np.array([3.0, 0.0], np.float32), dev), Tensor(np.array([4.0],
                                                                                   np.float32), dev)
    params = [("a", a), ("b", b)]
    assert clip_grad_norm(params, 10.0) == pytest.approx(5.0)
    np.testing.assert_array_equal(a.grad.numpy(), [3.0, 0.0])  # under the limit: untouched
    assert clip_grad_norm(params, 1.0) == pytest.approx(5.0)
    total = np.sqrt((a.grad.numpy() ** 2).sum() + (b.grad.numpy() ** 2).sum())
    assert total == pytest.approx(1.0, rel=1e-5)
    np.testing.assert_allclose(a.grad.numpy() / b.grad.numpy()[0], [0.75, 0.0])
    assert clip_grad_norm(params, None) == pytest.approx(1.0, rel=1e-5)


# --- the loop --------------------------------------------------------------------------------
class _Pool:  # what a GPU's memory record reads of cupy's pool
    def total_bytes(self):
        return 3 << 30


def test_gpu_memory_record_and_progress_line_name_the_pool():
    rec = _memory_record(MemoryTracker("cuda", pool=_Pool()))
    assert rec["gpu_pool_bytes"] == 3 << 30 and rec["rss_peak"] > 0
    line = _bar_info({"loss": 1.0, "lr": 1e-3, "tokens_per_s": 10.0, **rec})
    assert "GPU pool 3072 MiB  peak RSS " in line
    assert "gpu_pool_bytes" not in _memory_record(MemoryTracker("cpu"))


def test_progress_in_a_pipe_prints_plain_lines_now_and_then():
    console = Console(file=io.StringIO())  # not a terminal
    bar = Progress(5, enabled=True, console=console)
    for step in range(1, 6):  # quicker than PLAIN_EVERY_S: the first and the last step,
        bar.update(step, f"loss {step}", evaluated=step == 3)  # and an evaluation's
    bar.close()
    assert console.file.getvalue().splitlines() == [f"train {s}/5  loss {s}" for s in (1, 3, 5)]


def test_loss_decreases_and_run_outputs(setup, tmp_path):
    out = tmp_path / "run"
    res = finetune(run_cfg(setup, out, max_steps=24, lr=1e-2, eval_every=8, save_every=8,
                           keep_last=2, log_every=1), progress=False)
    ls = losses(res)
    assert len(ls) == 24
    assert np.mean(ls[-4:]) < 0.6 * np.mean(ls[:2])
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, 25))
    for r in recs:
        assert {"step", "loss", "lr", "tokens_per_s"} <= set(r) and r["tokens_per_s"] > 0
        assert r["rss_peak"] > r["mem_tracked_peak"] > 0  # the process holds more than tracked
    assert [r["step"] for r in recs if "eval_loss" in r] == [8, 16, 24]
    evals = [r["eval_loss"] for r in recs if "eval_loss" in r]
    assert evals[-1] < evals[0] and all(np.isfinite(evals))
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert [s for s, _ in list_checkpoints(out)] == [16, 24]  # keep_last=2
    for name in ("adapter_model.safetensors", "adapter_config.json", "optimizer.safetensors",
                 "trainer_state.json"):
        assert (out / "checkpoints" / "step-24" / name).is_file()
    state = json.loads((out / "checkpoints" / "step-24" / "trainer_state.json").read_text())
    assert state["step"] == 24 and state["optimizer_step"] == 24
    assert (out / "adapter_model.safetensors").is_file()
    assert not list((out / "checkpoints").glob("*.tmp"))


def _examples(n, length, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(5, 200, length).astype(np.int32)
        out.append(Example(ids, rng.integers(5, 200, length).astype(np.int64)))
    return out


def _trainer(model_dir, examples, seed=0, **train):
    dev = Device.cpu().autodiff()
    dev.seed(seed)
    model = load_model(model_dir, dev, quant="nf4")
    apply_lora(model, {"targets": ["q_proj", "v_proj", "down_proj"], "rank": 4, "alpha": 8})
    cfg = TrainConfig(**{"max_steps": 2, "lr": 1e-2, "warmup_steps": 0, "eval_every": 0,
                         "save_every": 0, "schedule": "constant", **train})
    return Trainer(model, examples, cfg, progress=False)


def test_train_api_takes_a_dict_and_names_what_it_cannot_take(setup, tmp_path):
    """train(model, rows, {"max_steps": 1}) was an AttributeError ('dict' object has no
    attribute 'lr'), as were rows that are no Examples; finetune(path, overrides="k=v") took
    the string's characters for overrides."""
    dev = Device.cpu().autodiff()
    model = load_model(setup["model"], dev, quant="nf4")
    apply_lora(model, {"targets": ["q_proj"], "rank": 2, "alpha": 4})
    rows = _examples(4, 8)
    assert len(train(model, rows, {"max_steps": 1, "batch_size": 2}, progress=False)) == 1
    with pytest.raises(ConfigError, match="train: max_step: unknown key, did you mean .max_steps."):
        train(model, rows, {"max_step": 1}, progress=False)
    with pytest.raises(TypeError, match="train_examples must hold Example rows .*, not str"):
        train(model, "abc", {"max_steps": 1}, progress=False)
    with pytest.raises(TypeError, match="valid must hold Example rows .*, not dict"):
        train(model, rows, TrainConfig(max_steps=1), valid=[{"text": "x"}], progress=False)
    res = finetune(run_cfg(setup, tmp_path / "o"), overrides="train.max_steps=1", progress=False)
    assert len(res.history) == 1
    with pytest.raises(TypeError, match="a run config is a YAML path, a dict or a RunConfig"):
        finetune(None)


def test_grad_accumulation_equals_bigger_batch(setup):
    ex = _examples(8, 10)
    acc = _trainer(setup["model"], ex, batch_size=2, grad_accum=2)
    big = _trainer(setup["model"], ex, batch_size=4, grad_accum=1)
    h_acc, h_big = acc.run(), big.run()
    for ra, rb in zip(h_acc, h_big):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5)
        assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-4)
        assert ra["tokens"] == rb["tokens"] == 40
    for (n, p), (_, q) in zip(acc.model.trainable(), big.model.trainable()):
        np.testing.assert_allclose(p.numpy(), q.numpy(), rtol=1e-3, atol=1e-5, err_msg=n)


def test_packed_rows_train_as_the_examples_would_alone(setup):
    """data.packing: examples sharing a row attend only within themselves and restart their
    positions, so a batch holding them packed has the loss and the update of the same
    examples unpacked (padded rows)."""
    rng = np.random.default_rng(3)
    ex = [Example(rng.integers(5, 200, n).astype(np.int32), rng.integers(5, 200, n))
          for n in (5, 9, 3, 12, 7, 4)]
    packed = pack_examples(ex, 16)
    assert len(packed) < len(ex) and all(p.segment_ids is not None for p in packed)
    plain = _trainer(setup["model"], ex, batch_size=len(ex), max_steps=3)
    pack = _trainer(setup["model"], packed, batch_size=len(packed), max_steps=3)
    for ra, rb in zip(plain.run(), pack.run()):
        assert ra["target_tokens"] == rb["target_tokens"] == 40
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5)
    for (n, p), (_, q) in zip(plain.model.trainable(), pack.model.trainable()):
        np.testing.assert_allclose(q.numpy(), p.numpy(), rtol=1e-4, atol=1e-6, err_msg=n)


def test_ragged_accumulation_weighs_every_target_token_alike(setup):
    """batch 2 x accumulation 3 over ragged examples is batch 6: each micro-batch's mean is
    weighted by its share of the window's targets, not averaged with the others."""
    rng = np.random.default_rng(5)
    ex = [Example(rng.integers(5, 200, n).astype(np.int32), rng.integers(5, 200, n))
          for n in (3, 14, 5, 9, 2, 11)]
    acc = _trainer(setup["model"], ex, batch_size=2, grad_accum=3, max_steps=2)
    big = _trainer(setup["model"], ex, batch_size=6, grad_accum=1, max_steps=2)
    acc.batches.shuffle = big.batches.shuffle = False  # the same rows in the same windows
    for ra, rb in zip(acc.run(), big.run()):
        assert ra["target_tokens"] == rb["target_tokens"] == 44
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5)
        assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-4)
    for (n, p), (_, q) in zip(acc.model.trainable(), big.model.trainable()):
        np.testing.assert_allclose(p.numpy(), q.numpy(), rtol=1e-4, atol=1e-6, err_msg=n)


def test_max_grad_norm_clips_the_update(setup):
    ex = _examples(4, 10)
    tr = _trainer(setup["model"], ex, batch_size=4, max_grad_norm=1e-3, max_steps=1,
                  lr=1.0, betas=(0.0, 0.0), eps=1.0)  # update = lr * g / (|g| + 1): ~g for tiny g
    before = {n: p.numpy().copy() for n, p in tr.model.trainable()}
    seen = {}
    orig = tr.opt.step

    def spy(lr=None):
        seen["norm"] = np.sqrt(sum(float((p.grad.numpy().astype(np.float64) ** 2).sum())
                                   for _, p in tr.opt.params if p.grad is not None))
        orig(lr)
    tr.opt.step = spy
    hist = tr.run()
    assert hist[0]["grad_norm"] > 1e-2  # the raw norm was far above the limit ...
    assert seen["norm"] == pytest.approx(1e-3, rel=1e-3)  # ... and was clipped before the step
    delta = np.sqrt(sum(((p.numpy() - before[n]) ** 2).sum() for n, p in tr.model.trainable()))
    assert delta < 1.1e-3


@pytest.mark.parametrize("checkpointing", [False, True])
def test_step_in_backward_is_the_same_update(setup, checkpointing):
    """train.step_in_backward applies each adapter gradient as backward completes it and frees
    it: the same updates, bit for bit, as one step after backward (no clipping), and no grad
    outlives the step."""
    ex = _examples(4, 10)
    runs, grads_peak = [], []
    for sib in (False, True):
        tr = _trainer(setup["model"], ex, batch_size=4, max_steps=3, max_grad_norm=None,
                      weight_decay=0.01, step_in_backward=sib)
        tr.model.grad_checkpointing = checkpointing
        tr.device.memory.reset_peak()
        hist = tr.run()
        grads_peak.append(tr.device.memory.peak["grads"])
        runs.append((hist, {n: p.numpy().copy() for n, p in tr.model.trainable()}))
        assert all(p.grad is None for _, p in tr.model.trainable())
    (h0, w0), (h1, w1) = runs
    assert [r["loss"] for r in h0] == [r["loss"] for r in h1]
    for a, b in zip(h0, h1):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6)
    for n, p in w0.items():
        np.testing.assert_array_equal(p, w1[n], err_msg=n)
    # one block's adapters at a time, not all (2 blocks here; a checkpointed block's input
    # grad counts in both)
    assert grads_peak[1] < 0.6 * grads_peak[0], grads_peak


def test_step_in_backward_needs_no_clipping_and_no_accumulation():
    with pytest.raises(ValueError, match="max_grad_norm: null"):
        TrainConfig(step_in_backward=True)
    with pytest.raises(ValueError, match="grad_accum: 1"):
        TrainConfig(step_in_backward=True, max_grad_norm=None, grad_accum=2)


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_gradient_checkpointing_same_losses(setup, tmp_path, dropout):
    runs = []
    for gc in (False, True):
        cfg = run_cfg(setup, tmp_path / f"gc{gc}", max_steps=3, grad_checkpointing=gc)
        cfg["lora"]["dropout"] = dropout
        res = finetune(cfg, progress=False)
        runs.append((losses(res), {n: p.numpy() for n, p in res.model.trainable()}))
    assert runs[0][0] == runs[1][0]
    for n, p in runs[0][1].items():
        np.testing.assert_array_equal(p, runs[1][1][n], err_msg=n)


def test_eval_turns_dropout_off_and_leaves_training_alone(setup, tmp_path):
    """Evaluation measures the model without dropout, and draws nothing from the device RNG:
    training losses are the same with and without eval steps."""
    runs = []
    for every in (0, 2):
        cfg = run_cfg(setup, tmp_path / f"e{every}", max_steps=4, eval_every=every)
        cfg["lora"]["dropout"] = 0.3
        runs.append(finetune(cfg, progress=False))
    assert losses(runs[0]) == losses(runs[1])
    model, valid = runs[1].model, _examples(3, 9)
    first = evaluate(model, valid, 2)
    assert evaluate(model, valid, 2) == first and model.training
    model.eval()
    assert evaluate(model, valid, 2) == first and not model.training


# --- resume ----------------------------------------------------------------------------------
class _Crash(Exception):
    pass


def test_resume_is_bit_exact(setup, tmp_path, monkeypatch):
    """A run stopped after step 5 (checkpoint at 4) and resumed gives the same per-step losses
    as one never stopped; dropout makes the RNG state matter, 12 rows / bs 2 = 6 steps an epoch
    make the data order across epochs matter."""
    def cfg(out):
        c = run_cfg(setup, out, max_steps=9, save_every=2, keep_last=3, eval_every=3)
        c["lora"]["dropout"] = 0.1
        return c
    whole = finetune(cfg(tmp_path / "a"), progress=False)
    assert len(whole.history) == 9

    out = tmp_path / "b"
    orig = Trainer.train_step

    def crashing(self):
        if self.step == 5:
            raise _Crash("power cut")
        return orig(self)
    monkeypatch.setattr(Trainer, "train_step", crashing)
    with pytest.raises(_Crash):
        finetune(cfg(out), progress=False)
    monkeypatch.setattr(Trainer, "train_step", orig)
    assert [s for s, _ in list_checkpoints(out)] == [2, 4]
    with pytest.raises(ConfigError, match="already holds a run"):
        finetune(cfg(out), progress=False)
    c = cfg(out)
    c["resume"] = "auto"
    resumed = finetune(c, progress=False)
    assert [r["step"] for r in resumed.history] == [5, 6, 7, 8, 9]
    assert losses(resumed) == losses(whole)[4:]
    assert [r.get("eval_loss") for r in resumed.history] == \
        [r.get("eval_loss") for r in whole.history[4:]]
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, 10))
    assert [r["loss"] for r in recs] == losses(whole)
    for (n, p), (_, q) in zip(whole.model.trainable(), resumed.model.trainable()):
        np.testing.assert_array_equal(p.numpy(), q.numpy(), err_msg=n)


def test_resume_auto_says_when_there_is_nothing_to_do(setup, tmp_path, capsys):
    out = tmp_path / "o"
    finetune(run_cfg(setup, out, max_steps=2, save_every=2), progress=False)
    c = run_cfg(setup, out, max_steps=2, save_every=2)
    c["resume"] = "auto"
    assert finetune(c, progress=True).history == []
    assert "step-2 at step 2, train.max_steps: nothing left to train" in capsys.readouterr().out
    c = run_cfg(setup, tmp_path / "none", max_steps=1)  # no checkpoint: a fresh start, said
    c["resume"] = "auto"
    assert len(finetune(c, progress=True).history) == 1
    assert "no checkpoint to resume from in " in capsys.readouterr().out


def test_overwrite_replaces_a_run(setup, tmp_path):
    out = tmp_path / "o"
    finetune(run_cfg(setup, out, max_steps=2, save_every=2), progress=False)
    assert list_checkpoints(out)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    c = run_cfg(setup, out, max_steps=1)
    c["overwrite"] = True
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": 5}\n')
    with pytest.raises(DataError, match="bad.jsonl:1:"):  # it deleted the run it was to replace
        finetune({**c, "data": {**c["data"], "train": str(bad)}}, progress=False)
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    finetune(c, progress=False)
    assert list_checkpoints(out) == []  # the old run's checkpoints are gone
    recs = (out / "metrics.jsonl").read_text().splitlines()
    assert len(recs) == 1


def test_resume_from_another_folder_does_not_write_over_a_run(setup, tmp_path):
    """resume: <another run's checkpoint> into an output_dir that holds a run would rotate that
    run's checkpoints away and replace its adapter: refused unless overwrite: true."""
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        finetune(run_cfg(setup, out, max_steps=2, save_every=2), progress=False)
    before = {p.relative_to(a): p.read_bytes() for p in a.rglob("*") if p.is_file()}
    c = run_cfg(setup, a, max_steps=2, save_every=2)
    c["resume"] = str(b / "checkpoints" / "step-2")
    with pytest.raises(ConfigError, match=r"already holds a run .*\(resume: .*b/checkpoints/"
                                          r"step-2 is another folder's checkpoint\)"):
        finetune(c, progress=False)
    assert {p.relative_to(a): p.read_bytes() for p in a.rglob("*") if p.is_file()} == before
    c["resume"] = str(a / "checkpoints" / "step-2")  # its own checkpoint: a resume as usual
    assert finetune(c, progress=False).history == []
    c["resume"], c["overwrite"] = str(b / "checkpoints" / "step-2"), True
    assert finetune(c, progress=False).history == []  # b's state, in a's place
    assert (a / "adapter_model.safetensors").read_bytes() == \
        (b / "adapter_model.safetensors").read_bytes()

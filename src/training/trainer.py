"""The training loop: AdamW steps over batches, accumulation, clipping, eval, checkpoints, logs."""
import math
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np

from ..autodiff import on_complete_grad, without_autodiff
from ..config_coerce import train_config
from ..data import Batches, Example
from ..errors import TrainingError
from ..fileio import write_text
from ..tracker import rss_peak
from .checkpoints import (
    list_checkpoints,
    load_checkpoint,
    read_state,
    resume_candidates,
    save_checkpoint,
    start_over,
)
from .distributed import World, check_global_batch
from .fingerprint import check_resume, default_settings, fingerprint
from .metrics import MetricsLog
from .optim import AdamW, clip_grad_norm
from .output_lock import output_dir_lock
from .progress import Progress
from .schedule import Schedule
from .states import STATE_BITS


def evaluate(model, examples, batch_size, pad_id=0, chunk=256):
    """Mean loss per target token over `examples` (no gradients recorded, dropout off)."""
    batches = Batches(examples, batch_size, shuffle=False, pad_id=pad_id)
    total, count = 0.0, 0
    with model.evaluating(), without_autodiff(), model.device.memory.category("activations"):
        for ids, labels in batches.epoch_batches():
            n = int((labels != -100).sum())
            if n:
                total += model.target_loss(ids, labels, chunk=chunk).item() * n
                count += n
    return total / max(count, 1)


def _memory_record(mem):
    """The tracker's peaks by category (the explanation), the whole process's peak RSS (what
    the machine sees; None where the system does not say) and, on a GPU, the bytes cupy's pool
    holds there (freed blocks stay in it for reuse: what the GPU sees this process hold)."""
    rec = {"mem_peak": {c: int(v) for c, v in mem.peak.items() if v},
           "mem_tracked_peak": int(mem.total_peak), "rss_peak": rss_peak()}
    if mem.pool is not None:
        rec["gpu_pool_bytes"] = int(mem.pool.total_bytes())
    return rec


RUN_CONFIG = "run_config.yaml"  # the resolved config of the run in output_dir


class Trainer:
    """Runs `cfg` (a TrainConfig) on a model with LoRA adapters applied."""

    def __init__(self, model, train_examples, cfg, valid=None, output_dir=None, pad_id=0,
                 progress=True, run_config=None, world=None):
        self.model, self.cfg, self.valid = model, cfg, valid
        self.world = world if world is not None else World()
        # what resume compares: the whole run's settings when given (else the train section)
        compared = run_config if run_config is not None else cfg
        self.fingerprint = fingerprint(compared, train_examples, self.world.size)
        self.setting_defaults = default_settings(compared)
        self.resume_allow = tuple(getattr(run_config, "resume_allow", ()) or ())
        self.overwrite = bool(getattr(run_config, "overwrite", False))
        self.run_config = run_config
        self.output_dir, self.pad_id = output_dir, pad_id
        self.device = model.device
        params = model.trainable()
        if not params:
            raise TrainingError("nothing to train: no parameter requires grad (apply_lora first)")
        self.opt = AdamW(params, cfg.lr, tuple(cfg.betas), cfg.eps, cfg.weight_decay,
                         STATE_BITS[cfg.optimizer])
        self.flat = None  # the one float32 buffer the gradients are summed over ranks in
        self._names = {id(p): n for n, p in params}  # step_in_backward: which leaves to apply
        if self.world.size > 1:
            if cfg.step_in_backward:
                raise TrainingError("train.step_in_backward cannot run over several ranks: their "
                                    "gradients are summed after backward; turn it off")
            check_global_batch(cfg.batch_size, self.world.size)
            with self.device.memory.category("workspace"):
                self.flat = self.device.memory.track(self.device.xp.empty(
                    sum(p.data.size for _, p in params), np.float32))
        # packed rows (data.packing) carry segment ids: attention and positions stay per example
        self.packed = any(ex.segment_ids is not None for ex in train_examples)
        self.batches = Batches(train_examples, cfg.batch_size, seed=cfg.seed, pad_id=pad_id,
                               segments=self.packed)
        steps_per_epoch = max(1, math.ceil(len(self.batches) / cfg.grad_accum))
        self.total = cfg.total_steps(steps_per_epoch)
        self.schedule = Schedule(cfg.schedule, cfg.lr, self.total, cfg.warmup(self.total))
        self.step = 0
        self.progress_enabled = progress
        model.grad_checkpointing = bool(cfg.grad_checkpointing)

    # -- state --------------------------------------------------------------------------------
    def state(self):
        """The trainer state a checkpoint keeps (every rank's RNG state, gathered on rank 0)."""
        rngs = self.world.gather(self.device.rng_state())
        return {"step": self.step, "epoch": self.batches.epoch, "total_steps": self.total,
                "data": self.batches.state_dict(), "rng": self.device.rng_state(),
                "rng_ranks": rngs, "optimizer_step": self.opt.t,
                "schedule": self.schedule.state_dict(), "fingerprint": self.fingerprint}

    def resume_from(self, resume, log=print):
        """Load the checkpoint `resume` names on rank 0 and hand it to the other ranks; returns
        its path, or None to start fresh."""
        path = self._load_resume(resume, log) if self.world.is_main else None
        if self.world.size == 1:
            return path
        state = self.world.broadcast(self._resumed_state if path is not None else None)
        if state is None:
            return None
        arrays = [p.data for _, p in self.opt.params] + list(self.opt.state_arrays().values())
        self.world.broadcast_arrays(arrays)
        self.opt.t = int(state["optimizer_step"])
        self._apply_state(state)
        return self.world.broadcast(path)

    def _apply_state(self, state):
        self.batches.load_state_dict(state["data"])
        rngs = state.get("rng_ranks") or [state["rng"]]
        self.device.set_rng_state(rngs[self.world.rank] if self.world.rank < len(rngs)
                                  else state["rng"])
        self.step = int(state["step"])

    def _load_resume(self, resume, log):
        """`auto`: the newest usable checkpoint, falling back past damaged or incomplete ones
        and saying so; a path: that one."""
        candidates, notes = resume_candidates(self.output_dir, resume) if self.output_dir \
            else ([], [])
        for path in candidates:
            try:
                state = read_state(path)
            except TrainingError as e:  # damaged or incomplete: auto falls back past it
                if str(resume) != "auto":
                    raise
                notes.append(f"skipped checkpoint {path}: {e}")
                continue
            for note in notes:
                log(note)
            # another run's checkpoint is an error, not one to pass over: compared first
            check_resume(state.get("fingerprint"), self.fingerprint, self.resume_allow, path,
                         self.setting_defaults)
            load_checkpoint(path, self.model, self.opt, state)
            self._resumed_state = state
            self._apply_state(state)
            return path
        for note in notes:
            log(note)
        if self.output_dir and str(resume) == "auto":
            start_over(self.output_dir, self.overwrite)
            log(f"no checkpoint to resume from in {self.output_dir}: starting at step 0")
        return None

    # -- one optimizer step -------------------------------------------------------------------
    def train_step(self):
        """One optimizer step over a window of grad_accum global batches. Every target token of
        the window weighs the same, across micro-batches and ranks: each micro-batch's mean loss
        is scaled by its share of the window's targets before its backward."""
        cfg, xp, mem, world = self.cfg, self.device.xp, self.device.memory, self.world
        window = [next(self.batches) for _ in range(cfg.grad_accum)]
        if world.size > 1:  # this rank's rows of each global batch
            window = [tuple(a[world.shard(len(a))] for a in batch) for batch in window]
        counts = [int((batch[1] != -100).sum()) for batch in window]
        targets, tokens = world.sum_scalars(sum(counts), sum(int(b[0].size) for b in window))
        loss_sum = 0.0
        lr = self.schedule(self.step + 1)
        if cfg.step_in_backward:
            self.opt.begin_step(lr)
            self._grad_sq = 0.0
        for (ids, labels, *segments), n in zip(window, counts):
            if n == 0:
                continue  # no targets: nothing to learn from these rows
            with mem.category("activations"):
                loss = self.model.target_loss(ids, labels, chunk=cfg.loss_chunk,
                                              segments=segments[0] if segments else None)
                value = loss.item()
                if not math.isfinite(value):
                    raise TrainingError(self._bad_loss_message(value))
                self._backward(loss, xp.asarray(n / max(targets, 1), dtype=np.float32))
            loss_sum += value * n
        (loss_sum,) = world.sum_scalars(loss_sum)
        if cfg.step_in_backward:
            for _, p in self.opt.params:  # a grad the tape never reported complete
                if p.grad is not None:
                    self._apply_now(p)
            norm = math.sqrt(float(self._grad_sq))  # summed on the device: one host copy
            if not math.isfinite(norm):  # on a GPU, known only now: the update has taken it
                raise TrainingError(self._bad_loss_message(norm, "gradient norm", taken=True))
        else:
            norm = self._clip_and_step(lr)
        self.opt.zero_grad()
        self.step += 1
        return loss_sum / max(targets, 1), lr, norm, int(tokens), int(targets)

    def _backward(self, loss, scale):
        if not self.cfg.step_in_backward:
            return loss.backward(scale)
        with on_complete_grad(self._apply_now):
            loss.backward(scale)

    def _apply_now(self, p):
        """step_in_backward: apply a complete adapter gradient and free it (other leaves, such
        as a checkpointed block's input, are left to their owner)."""
        name = self._names.get(id(p))
        if name is None:
            return
        g = p.grad.data
        sq = (g * g).sum(dtype=np.float64)
        if self.device.kind == "cpu" and not math.isfinite(sq):  # free to check here, and before
            raise TrainingError(self._bad_loss_message(sq, "gradient norm"))  # the update
        self._grad_sq = self._grad_sq + sq  # on a GPU: checked once, after backward
        with self.device.memory.category("optimizer"):
            self.opt.update(name, p)
        p.grad = None

    def _clip_and_step(self, lr):
        """Sum over ranks, clip by the global norm, one optimizer step; returns the norm."""
        self.world.sum_grads(self.opt.params, self.flat)
        norm = clip_grad_norm(self.opt.params, self.cfg.max_grad_norm)
        if not math.isfinite(norm):
            raise TrainingError(self._bad_loss_message(norm, "gradient norm"))
        with self.device.memory.category("optimizer"):
            self.opt.step(lr)
        return norm

    def _bad_loss_message(self, value, what="loss", taken=False):
        """taken: the adapter in memory has taken this step's update (a GPU's step_in_backward
        learns the norm only after it)."""
        kept = list_checkpoints(self.output_dir) if self.output_dir else []
        where = (f"{kept[-1][1]} (step {kept[-1][0]}) is intact" if kept
                 else "no checkpoint was written yet")
        if taken:
            where = f"the adapter in memory has taken this step's update; {where}"
        if self.step == 0 and what == "loss":  # no update yet: no learning rate to blame
            why = ("It came before any update, from the model as loaded: its weights may hold "
                   "NaN or inf; check them, or the data")
        else:
            why = "Lower train.lr, set train.max_grad_norm, or check the data"
        return (f"training stopped at step {self.step + 1}: the {what} is {value} (not finite); "
                f"{where}. {why}")

    # -- the loop -----------------------------------------------------------------------------
    def run(self, resume=None):
        cfg, main = self.cfg, self.world.is_main  # rank 0 alone evaluates and writes
        resumed = self.resume_from(resume, log=lambda text: print(f"packlora: {text}", flush=True))
        writes = self.output_dir if main else None
        if writes and hasattr(self.run_config, "to_yaml"):  # once resume has taken this run
            write_text(Path(writes) / RUN_CONFIG, self.run_config.to_yaml())
        metrics = MetricsLog(writes, truncate_after=self.step) if writes else None
        bar = Progress(self.total, self.step, enabled=self.progress_enabled and main)
        if resumed:
            done = ", train.max_steps: nothing left to train" if self.step >= self.total else ""
            bar.log(f"resumed from {resumed} at step {self.step}{done}")
        history = []
        try:
            while self.step < self.total:
                t0 = time.perf_counter()
                loss, lr, norm, tokens, targets = self.train_step()
                dt = time.perf_counter() - t0
                rec = {"step": self.step, "epoch": self.batches.epoch, "loss": loss, "lr": lr,
                       "grad_norm": norm, "tokens": tokens, "target_tokens": targets,
                       "step_time_s": dt, "tokens_per_s": tokens / dt}
                if main and self.valid and ((cfg.eval_every and self.step % cfg.eval_every == 0)
                                   or self.step == self.total):
                    rec["eval_loss"] = evaluate(self.model, self.valid, cfg.batch_size,
                                                self.pad_id, cfg.loss_chunk)
                rec.update(_memory_record(self.device.memory))
                history.append(rec)
                if metrics and (self.step % cfg.log_every == 0 or "eval_loss" in rec
                                or self.step == self.total):
                    metrics.write(rec)
                bar.update(self.step, _bar_info(rec), "eval_loss" in rec)
                if self.output_dir and cfg.save_every and (self.step % cfg.save_every == 0
                                                           or self.step == self.total):
                    state = self.state()  # a collective: every rank takes part
                    if writes:
                        save_checkpoint(writes, self.step, self.model, self.opt, state,
                                        cfg.keep_last)
        finally:
            bar.close()
        if metrics:
            metrics.plot(f"{self.output_dir}/loss.png")
        return history


def _bar_info(rec):
    # what the machine sees (metrics.jsonl has the tracked categories that explain it)
    text = f"loss {rec['loss']:.4f}  lr {rec['lr']:.2e}  {rec['tokens_per_s']:.0f} tok/s  "
    if "gpu_pool_bytes" in rec:
        text += f"GPU pool {rec['gpu_pool_bytes'] / 2**20:.0f} MiB  "
    peak = ("RSS", rec["rss_peak"]) if rec.get("rss_peak") else ("tracked", rec["mem_tracked_peak"])
    text += f"peak {peak[0]} {peak[1] / 2**20:.0f} MiB"
    if "eval_loss" in rec:
        text += f"  eval {rec['eval_loss']:.4f}"
    return text


def train(model, train_examples, cfg, valid=None, output_dir=None, resume=None, pad_id=0,
          progress=True, run_config=None, world=None):
    """Train the model's adapters; returns the per-step records. `cfg`: a TrainConfig or a dict
    of its fields. `run_config` (the whole RunConfig) is what a resume is checked against;
    without it, the train section. `world` (distributed.World) makes this one rank of a
    data-parallel run. An `output_dir` is held for the run: another process training into it
    is refused (training/output_lock.py)."""
    cfg = train_config(cfg)
    for name, rows in (("train_examples", train_examples), ("valid", valid or [])):
        odd = next((r for r in rows if not isinstance(r, Example)), None)
        if odd is not None:
            raise TypeError(f"train: {name} must hold Example rows (packlora.data."
                            f"build_datasets makes them), not {type(odd).__name__}")
    main = world is None or world.is_main                       # rank 0 alone writes there
    with output_dir_lock(output_dir, held=main) if output_dir is not None else nullcontext():
        trainer = Trainer(model, train_examples, cfg, valid, output_dir, pad_id, progress,
                          run_config, world)
        return trainer.run(resume)

"""Measure a run's memory: real training steps on random B×T batches, tracker vs process."""
import gc
import json
import tempfile
import tracemalloc
from pathlib import Path

import numpy as np

from ..adapters import apply_lora
from ..config import resolve_config
from ..data.example import Example
from ..models import load_model
from ..tracker import CATEGORIES, reset_rss_peak, rss_now, rss_peak
from ..training.run import run_device
from ..training.trainer import Trainer
from .inputs import plan_inputs
from .planner import plan_from_inputs


def random_examples(batch, seq, vocab, seed=0):
    """`batch` rows of exactly `seq` random tokens, every position a target."""
    rng = np.random.default_rng(seed)
    return [Example(rng.integers(0, vocab, seq), rng.integers(0, vocab, seq),
                    origin=f"random:{i}") for i in range(batch)]


def _process_reset(dev):
    if dev.kind == "cuda":
        pool = dev.xp.get_default_memory_pool()
        pool.free_all_blocks()
    dev.memory.reset_peak()


def _process_peak(dev, start):
    """Peak bytes of the independent measure since the window began, above `start`."""
    cur, peak = dev.memory.process_measure()
    if peak is None:
        return None
    return int(peak - start)


def load_adapted(run, source, dev):
    """The model of `source` on dev, quantized and with adapters as `run` says (no tokenizer)."""
    model = load_model(source, dev, quant=run.quant, with_tokenizer=False)
    apply_lora(model, run.lora)
    return model


def measure_run(run, inp, steps=2, warmup=1, source=None):
    """Train `warmup` + `steps` steps of `run` at the shapes of `inp` (PlanInputs); the window
    after the warm-up is measured. Returns the `measured` dict (bytes above what was live
    before the model was loaded)."""
    import matplotlib  # imported before tracing: the trainer's loss plot must not count
    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401
    dev = run_device(run)
    tracing_before = dev.kind == "cpu" and tracemalloc.is_tracing()
    gc.collect()
    dev.memory.start_process_measure()
    try:
        return _measured_steps(run, inp, steps, warmup, source, dev)
    finally:  # a failed step (out of memory) must not leave the measure on
        if dev.kind == "cpu" and not tracing_before:
            tracemalloc.stop()
        dev.memory.stop_process_measure()
        gc.collect()


def _measured_steps(run, inp, steps, warmup, source, dev):
    mem = dev.memory
    base_cur, base_total = dict(mem.current), mem.total
    proc0 = mem.process_measure()[0] or 0
    rss0 = rss_now()
    model = load_adapted(run, run.model if source is None else source, dev)
    rss_load = rss_peak()  # VmHWM so far: loading (and whatever ran before it)
    tcfg = run.train.model_copy(update={
        "batch_size": inp.batch, "grad_checkpointing": inp.grad_checkpointing,
        "max_steps": warmup + steps, "epochs": None, "save_every": 0, "eval_every": 0,
        "log_every": 1})
    examples = random_examples(inp.batch, inp.seq, model.config.vocab_size, run.train.seed)
    with tempfile.TemporaryDirectory(prefix="packlora-mem-") as out:
        trainer = Trainer(model, examples, tcfg, output_dir=out, progress=False)
        for _ in range(warmup):
            trainer.train_step()
        gc.collect()
        _process_reset(dev)
        rss_warm = rss_peak()  # loading and the warm-up step
        rss_reset = reset_rss_peak()
        win_tracker, win_proc = mem.total, mem.process_measure()[0]
        history = trainer.run()
        proc_peak = _process_peak(dev, proc0)
        rss_high = rss_peak()
        records = _metrics_records(out)
    return {"categories": {c: int(mem.peak[c] - base_cur[c]) for c in CATEGORIES},
            "peak_bytes": int(mem.total_peak - base_total),
            "process_peak_bytes": proc_peak,
            "window_peak_bytes": int(mem.total_peak - win_tracker),
            "process_window_peak_bytes": (None if proc_peak is None
                                          else int(proc_peak + proc0 - win_proc)),
            "process_measure": "tracemalloc" if dev.kind == "cpu" else "cupy memory pool",
            "rss_peak_bytes": rss_high if rss_reset else None,
            "rss_load_peak_bytes": rss_load, "rss_warmup_peak_bytes": rss_warm,
            "rss_before_load_bytes": rss0, "steps": steps, "warmup_steps": warmup,
            "step_time_s": float(np.mean([r["step_time_s"] for r in history])),
            "metrics_jsonl_mem_peak": records[-1].get("mem_peak") if records else None}


def _metrics_records(out):
    path = Path(out) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def compare(plan_part, measured):
    """Errors of the plan against the tracker, and of the tracker against the process measure."""
    peak = measured["peak_bytes"]
    measured["plan_error_pct"] = round(100.0 * (plan_part["peak_bytes"] - peak) / peak, 2)
    proc = measured.get("process_peak_bytes")
    measured["tracker_vs_process_pct"] = (round(100.0 * (peak - proc) / proc, 2)
                                          if proc else None)
    measured["category_error_pct"] = {
        c: round(100.0 * (plan_part["categories"][c] - v) / v, 2)
        for c, v in measured["categories"].items() if v}
    return measured


def measure(config, steps=2, overrides=(), model=None, batch_size=None, seq_len=None,
            grad_checkpointing=None, warmup=1):
    """Plan `config`, then train `steps` real steps (after `warmup`) on random batches of exactly
    batch × max_seq_len tokens and measure. Returns the plan dict plus "measured"."""
    run = resolve_config(config, overrides)
    inp = plan_inputs(run, (), model, batch_size, seq_len, grad_checkpointing)
    report = plan_from_inputs(inp)
    measured = measure_run(run, inp, steps, warmup, model)
    report["measured"] = compare(report["plan"], measured)
    return report

"""SmolLM2 QLoRA training step: time, tokens/s, memory and model-FLOP utilisation (JSON).

r=16, alpha=32 on q,k,v,o,gate,up,down; AdamW; batch 4 x 256 random tokens, every position in
the loss; gradient checkpointing off and on. Utilisation is the step's useful FLOPs per second
divided by the dense float32 BLAS GFLOP/s measured in the same run on the model's shapes.
"""
import argparse
import json
import statistics
import time

import packlora as pl  # noqa: I001  (first: thread settings before numpy loads OpenBLAS)
import numpy as np
from packlora.tracker import rss_peak
from packlora.training.optim import AdamW, clip_grad_norm

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def step_flops(cfg, b, t, rank):
    """Model FLOPs of one step (recomputation not counted, as utilisation is defined): frozen
    linears forward + input gradient, LoRA forward + gradients, attention, LM head forward +
    input gradient."""
    d, f, h, kv, hd, v = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                          cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size)
    tokens = b * t
    shapes = [(h * hd, d), (kv * hd, d), (kv * hd, d), (d, h * hd), (f, d), (f, d), (d, f)]
    lin = sum(n * k for n, k in shapes)
    lora = sum(rank * (n + k) for n, k in shapes)
    per_layer_fwd = 2 * tokens * (lin + lora) + 2 * 2 * b * h * t * t * hd
    per_layer_bwd = 2 * tokens * lin + 3 * 2 * tokens * lora + 5 * 2 * b * h * t * t * hd
    layers = cfg.num_layers * (per_layer_fwd + per_layer_bwd)
    head = 2 * 2 * tokens * v * d  # forward and input gradient
    return layers + head


def dense_gflops(reps=5):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1024, 576), dtype=np.float32)
    w = rng.standard_normal((1536, 576), dtype=np.float32)
    x @ w.T
    t0 = time.perf_counter()
    for _ in range(reps):
        x @ w.T
    return 2 * 1024 * 576 * 1536 * reps / (time.perf_counter() - t0) / 1e9


def run(checkpointing, batch, seq, steps):
    dev = pl.Device.cpu().autodiff()
    dev.seed(0)
    model = pl.load_model("smollm2-135m-instruct", dev)
    pl.apply_lora(model, pl.LoraConfig(rank=16, alpha=32, targets=TARGETS))
    model.grad_checkpointing = checkpointing
    opt = AdamW(model.trainable(), lr=1e-4)
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, (batch, seq + 1))
    mem = dev.memory
    mem.start_process_measure()
    times = []
    for i in range(steps + 1):
        if i == 1:
            mem.reset_peak()  # the first step compiles kernels; measure the rest
        t0 = time.perf_counter()
        with mem.category("activations"):
            loss = model.target_loss(ids[:, :-1], ids[:, 1:])
            loss.backward()
        clip_grad_norm(opt.params, 1.0)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    snap = mem.snapshot()
    med = statistics.median(times[1:])
    return model, {"checkpointing": checkpointing, "median_step_s": round(med, 3),
                   "tokens_per_s": round(batch * seq / med, 1), "loss": round(loss.item(), 4),
                   "tracked_peak_bytes": snap["tracked_peak"],
                   "process_peak_bytes": snap["process_peak"], "rss_peak_bytes": snap["rss_peak"]}


def one(checkpointing, batch, seq, steps):
    """One configuration in this process, as one JSON line: what bench/vs_pytorch.py reads.
    The peak is the whole process's (VmHWM), loading included, as the peer reports its own."""
    _, row = run(checkpointing, batch, seq, steps)
    row["process_vmhwm_mib"] = round(rss_peak() / 2**20, 1)
    print(json.dumps(row))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--one", choices=["off", "on"], default=None,
                    help="run only checkpointing off/on and print one JSON line")
    a = ap.parse_args()
    if a.one:
        return one(a.one == "on", a.batch, a.seq, a.steps)
    rows = []
    for ckpt in (False, True):
        before = dense_gflops()
        model, row = run(ckpt, a.batch, a.seq, a.steps)
        gflops = max(before, dense_gflops())  # the faster of two reads: a conservative ratio
        flops = step_flops(model.config, a.batch, a.seq, 16)
        row["step_gflop"] = round(flops / 1e9, 1)
        row["dense_blas_gflops"] = round(gflops, 1)
        row["model_flop_utilisation"] = round(flops / row["median_step_s"] / 1e9 / gflops, 3)
        row["peak_le_1GiB"] = row["tracked_peak_bytes"] <= 1 << 30
        rows.append(row)
    print(json.dumps({"bench": "train_step", "model": "smollm2-135m-instruct (GGUF Q4_1)",
                      "batch": a.batch, "seq": a.seq, "lora_rank": 16, "runs": rows,
                      "targets": {"model_flop_utilisation": 0.6, "peak_bytes_ckpt": 1 << 30}},
                     indent=2))


if __name__ == "__main__":
    main()

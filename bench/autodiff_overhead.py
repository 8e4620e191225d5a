"""Forward+backward of a 4-layer MLP: packlora autodiff vs the same math in numpy by hand (JSON)."""
import json
import statistics
import time

import packlora as pl  # noqa: I001  (first: thread settings before numpy loads OpenBLAS)
import numpy as np
from packlora import ops

WIDTH, BATCH, LAYERS, REPS = 1024, 256, 4, 15


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def numpy_step(x, ws, bs):
    acts, pre = [x], []
    h = x
    for w, b in zip(ws, bs):
        z = h @ w + b
        pre.append(z)
        h = z * sigmoid(z)
        acts.append(h)
    loss = (h * h).mean()
    g = 2.0 * h / h.size
    grads = []
    for i in reversed(range(LAYERS)):
        z = pre[i]
        s = sigmoid(z)
        gz = g * s * (1 + z * (1 - s))
        grads.append((acts[i].T @ gz, gz.sum(axis=0)))
        g = gz @ ws[i].T
    return loss, grads


def packlora_step(x, ws, bs):
    h = x
    for w, b in zip(ws, bs):
        h = ops.silu(h @ w + b)
    loss = (h * h).mean()
    loss.backward()
    return loss


def timed(fn, reps=REPS):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    rng = np.random.default_rng(0)
    dev = pl.Device.cpu().autodiff()
    x_np = rng.standard_normal((BATCH, WIDTH)).astype(np.float32)
    ws_np = [(rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
             for _ in range(LAYERS)]
    bs_np = [np.zeros(WIDTH, np.float32) for _ in range(LAYERS)]
    x = pl.Tensor(x_np, dev)
    ws = [pl.Tensor(w, dev).require_grad() for w in ws_np]
    bs = [pl.Tensor(b, dev).require_grad() for b in bs_np]

    def run_pl():
        for p in ws + bs:
            p.grad = None
        packlora_step(x, ws, bs)

    ref_loss, ref_grads = numpy_step(x_np, ws_np, bs_np)
    run_pl()
    err = float(np.abs(ws[0].grad.numpy() - ref_grads[-1][0]).max())
    # interleave the two so machine noise hits both alike
    t_np, t_pl = [], []
    for _ in range(3):
        t_np.append(timed(lambda: numpy_step(x_np, ws_np, bs_np), 5))
        t_pl.append(timed(run_pl, 5))
    t_np, t_pl = statistics.median(t_np), statistics.median(t_pl)
    print(json.dumps({
        "bench": "autodiff_overhead", "width": WIDTH, "batch": BATCH, "layers": LAYERS,
        "numpy_hand_s": round(t_np, 5), "packlora_s": round(t_pl, 5),
        "ratio": round(t_pl / t_np, 3), "target_ratio": 1.15,
        "max_grad_abs_diff": err,
    }, indent=2))


if __name__ == "__main__":
    main()

"""The BLAS floor of a SmolLM2 LoRA training step: its float32 matrix products alone (JSON).

Every product one step of bench/train_step.py makes (r = 16 on the seven projections, batch x
seq tokens, every position a target), with the same shapes, timed one by one as dense float32
BLAS on hot operands: the frozen linears' forward and input gradient, the LoRA products, the
attention's score blocks (ops/attention.py's blocking), the LM head in its 256-row chunks. Nothing
else — no decode of packed weights, no norms, RoPE, SwiGLU, softmax, cross-entropy, optimizer or
Python — so no implementation of that step on this machine's BLAS can be faster than this.
Checkpointing on adds the layers' forward products once more (the recompute), all but the
down projection's (DecoderLayer.recompute).

Usage: python bench/step_floor.py [--batch 4] [--seq 256] [--rank 16]
"""
import argparse
import json
import time

import packlora  # noqa: F401, I001  (first: thread settings before numpy loads OpenBLAS)
import numpy as np
from packlora.models.resolve import resolve_source
from packlora.models.sources import open_source
from packlora.ops.attention import query_blocks

from hostinfo import cpu_name  # bench/hostinfo.py

HEAD_CHUNK = 256  # ops/head_loss.py's default chunk of target rows


def best_s(fn, reps=7):
    """Fastest of `reps` calls after a warm-up (the floor, not a typical time)."""
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def _mat(rng, *shape):
    return rng.standard_normal(shape, dtype=np.float32)


def linear_s(rng, m, n, k, r):
    """(forward, backward) seconds of one LoRA linear W (n, k) on m rows: y = xW' + (xA')B',
    then dx = gW + (gB)A, dB = g'(xA'), dA = (gB)'x."""
    x, w, g = _mat(rng, m, k), _mat(rng, n, k), _mat(rng, m, n)
    a, b, xa, gb = _mat(rng, r, k), _mat(rng, n, r), _mat(rng, m, r), _mat(rng, m, r)
    fwd = best_s(lambda: x @ w.T) + best_s(lambda: x @ a.T) + best_s(lambda: xa @ b.T)
    bwd = (best_s(lambda: g @ w) + best_s(lambda: g @ b) + best_s(lambda: gb @ a)
           + best_s(lambda: g.T @ xa) + best_s(lambda: gb.T @ x))
    return fwd, bwd


def attention_s(rng, cfg, batch, seq):
    """(forward, backward) seconds of one layer's score-block products (causal, grouped heads)."""
    kv, d = cfg.num_kv_heads, cfg.head_dim
    groups = cfg.num_heads // kv
    q = _mat(rng, batch, kv, seq * groups, d)
    k, v = _mat(rng, batch, kv, seq, d), _mat(rng, batch, kv, seq, d)
    kt = np.ascontiguousarray(np.swapaxes(k, -1, -2))
    fwd = bwd = 0.0
    for r0, r1, e in query_blocks(seq, seq, groups):
        qc = np.ascontiguousarray(q[:, :, r0:r1])  # (B, Hkv, rows, D)
        qt = np.ascontiguousarray(np.swapaxes(qc, -1, -2))
        sc = _mat(rng, batch, kv, r1 - r0, e)
        pt = _mat(rng, batch, kv, e, r1 - r0)
        fwd += best_s(lambda: qc @ kt[..., :e]) + best_s(lambda: sc @ v[:, :, :e])
        bwd += (best_s(lambda: k[:, :, :e] @ qt) + best_s(lambda: v[:, :, :e] @ qt)
                + best_s(lambda: kt[..., :e] @ pt) + 2 * best_s(lambda: pt @ qc))
    return fwd, bwd


def head_s(rng, cfg, tokens):
    """Seconds of the LM head's forward and input-gradient products over the targets."""
    w = _mat(rng, cfg.vocab_size, cfg.hidden_size)
    h, z = _mat(rng, HEAD_CHUNK, cfg.hidden_size), _mat(rng, HEAD_CHUNK, cfg.vocab_size)
    per_chunk = best_s(lambda: h @ w.T, 3) + best_s(lambda: z @ w, 3)
    return per_chunk * tokens / HEAD_CHUNK


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rank", type=int, default=16)
    a = ap.parse_args()
    cfg = open_source(resolve_source("smollm2-135m-instruct")).config
    rng = np.random.default_rng(0)
    m, dm, f = a.batch * a.seq, cfg.hidden_size, cfg.intermediate_size
    qo, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = [(qo, dm), (kv, dm), (kv, dm), (dm, qo), (f, dm), (f, dm), (dm, f)]  # down last
    lin = [linear_s(rng, m, n, k, a.rank) for n, k in shapes]
    att = attention_s(rng, cfg, a.batch, a.seq)
    layer_fwd = sum(x[0] for x in lin) + att[0]
    layer_bwd = sum(x[1] for x in lin) + att[1]
    head = head_s(rng, cfg, m)
    off = cfg.num_layers * (layer_fwd + layer_bwd) + head
    on = off + cfg.num_layers * (layer_fwd - lin[-1][0])
    print(json.dumps({
        "bench": "step_floor", "cpu": cpu_name(), "batch": a.batch, "seq": a.seq,
        "lora_rank": a.rank, "layers": cfg.num_layers,
        "layer_fwd_ms": round(layer_fwd * 1e3, 2), "layer_bwd_ms": round(layer_bwd * 1e3, 2),
        "attention_fwd_bwd_ms": [round(x * 1e3, 2) for x in att],
        "head_ms": round(head * 1e3, 1),
        "floor_step_s": {"checkpointing_off": round(off, 3), "checkpointing_on": round(on, 3)},
        "ceiling_tokens_per_s": {"checkpointing_off": round(m / off, 1),
                                 "checkpointing_on": round(m / on, 1)},
    }, indent=2))


if __name__ == "__main__":
    main()

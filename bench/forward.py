"""SmolLM2-135M prefill and KV-cache decode: packed GGUF Q4_1 vs the same model in float32 (JSON).

Phase 1 times both variants, taking turns (tracemalloc off, it slows small allocations), and
reads the memory tracker; phase 2 repeats a short run under tracemalloc as the independent memory
measure.
Usage: python bench/forward.py [--prefill 512] [--decode 128] [--reps 5] [--profile N] [--threads N]
"""
import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import sys
import time
import tracemalloc

if "--threads" in sys.argv[:-1]:  # thread pools are sized when numpy / numba load
    for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ[_var] = sys.argv[sys.argv.index("--threads") + 1]

import packlora  # noqa: F401, I001  (first: thread settings before numpy loads OpenBLAS)
import numpy as np
from packlora import Device
from packlora.autodiff import without_autodiff
from packlora.models import KVCache, load_model
from packlora.nn import Embedding, Linear, PackedLinear
from packlora.tensor import Tensor

MODEL = "smollm2-135m-instruct"
MB = 1 << 20


def densify(model):
    """Replace every packed weight (linears and the embedding table) by a float32 Tensor."""
    mem = model.device.memory
    with mem.category("base_other"):
        for name, mod in list(model.named_modules()):
            if isinstance(mod, PackedLinear):
                w = Tensor(np.asarray(mod.weight.dequantize(), np.float32), model.device)
                model.set_module(name, Linear(w, mod.bias))
        emb = model.model.embed_tokens
        if emb.packed:
            table = Tensor(np.asarray(emb.weight.dequantize(), np.float32), model.device)
            model.model.embed_tokens = Embedding(table)
    gc.collect()
    return model


def run(model, ids, n_decode):
    """(prefill seconds, decode seconds) of one prompt + n_decode greedy tokens."""
    cache = KVCache(model.config, model.device, 1, ids.shape[1] + n_decode)
    with without_autodiff():
        t0 = time.perf_counter()
        logits = model.next_logits(ids, cache)
        t1 = time.perf_counter()
        for _ in range(n_decode):
            nxt = int(np.argmax(logits.numpy()[0]))
            logits = model.next_logits(np.asarray([[nxt]]), cache)
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def measure(models, weights, ids, n_decode, reps):
    """Best-of-reps speeds and tracked bytes (the model's weights + the run's peak above what was
    live before it) of each model. The models take turns, rep by rep, so a slower minute on a
    shared machine hits both alike; both sit on the one CPU device, so its tracker's peak is read
    as a difference around each run."""
    mem = next(iter(models.values())).device.memory
    for model in models.values():
        run(model, ids, 2)  # warm-up: every kernel (tiled prefill, fused decode) loaded
    times = {name: ([], [], []) for name in models}
    for _ in range(reps):
        for name, model in models.items():
            mem.reset_peak()
            live = mem.total
            p, d = run(model, ids, n_decode)
            for lst, v in zip(times[name], (p, d, mem.total_peak - live)):
                lst.append(v)
    out = {}
    for name in models:
        prefill, decode, peak = times[name]
        out[name] = {
            "prefill_tokens_per_s": round(ids.shape[1] / min(prefill), 1),
            "decode_tokens_per_s": round(n_decode / min(decode), 2),
            "prefill_s": [round(x, 3) for x in prefill], "decode_s": [round(x, 3) for x in decode],
            "tracked_weights_mb": round(weights[name] / MB, 1),
            "tracked_run_peak_mb": round((weights[name] + max(peak)) / MB, 1)}
    return out


def tracemalloc_phase(ids, n_decode):
    """Weights and run peak of both variants as tracemalloc sees them (bytes numpy allocated)."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    model = load_model(MODEL, device=Device.cpu())
    out = {}
    for variant in ("packed_q4_1", "float32"):
        if variant == "float32":
            densify(model)
        gc.collect()
        loaded = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        run(model, ids, n_decode)
        peak = tracemalloc.get_traced_memory()[1]
        out[variant] = {"weights_mb": round((loaded - base) / MB, 1),
                        "run_peak_mb": round((peak - base) / MB, 1)}
    tracemalloc.stop()
    return out


def profile_decode(model, ids, steps):
    """Top functions by cumulative time over `steps` decode tokens (cProfile)."""
    cache = KVCache(model.config, model.device, 1, ids.shape[1] + steps + 1)
    with without_autodiff():
        model.next_logits(ids, cache)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            model.next_logits(np.asarray([[1]]), cache)
        prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
    return buf.getvalue()


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile", type=int, default=0, help="cProfile N decode steps per variant")
    ap.add_argument("--threads", type=int, default=None,
                    help="BLAS and Numba threads (default: the libraries' own choice)")
    args = ap.parse_args()
    mem = Device.cpu().memory
    models, weights = {}, {}
    for name in ("packed_q4_1", "float32"):
        before = mem.total
        model = load_model(MODEL, device=Device.cpu())
        models[name] = densify(model) if name == "float32" else model
        gc.collect()
        weights[name] = mem.total - before
    vocab = models["float32"].config.vocab_size
    ids = np.random.default_rng(0).integers(0, vocab, (1, args.prefill))
    import numba
    result = {"model": MODEL, "prefill_tokens": args.prefill, "decode_tokens": args.decode,
              "threads": numba.get_num_threads(), "load_average": os.getloadavg()[0]}
    result.update(measure(models, weights, ids, args.decode, args.reps))
    profiles = {name: profile_decode(model, ids[:, :32], args.profile)
                for name, model in models.items()} if args.profile else {}
    del models
    result["tracemalloc"] = tracemalloc_phase(ids[:, :args.prefill], 8)
    p, f = result["packed_q4_1"], result["float32"]
    tm = result["tracemalloc"]
    def ratio(key):
        return round(p[key] / f[key], 3)

    result["ratios"] = {
        "prefill_speed_packed_over_f32": ratio("prefill_tokens_per_s"),
        "decode_speed_packed_over_f32": ratio("decode_tokens_per_s"),
        "tracked_peak_packed_over_f32": ratio("tracked_run_peak_mb"),
        "tracemalloc_peak_packed_over_f32": round(tm["packed_q4_1"]["run_peak_mb"]
                                                  / tm["float32"]["run_peak_mb"], 3)}
    result["targets"] = {"prefill >= 0.9": result["ratios"]["prefill_speed_packed_over_f32"] >= 0.9,
                         "decode >= 1.2": result["ratios"]["decode_speed_packed_over_f32"] >= 1.2,
                         "peak <= 0.35": result["ratios"]["tracked_peak_packed_over_f32"] <= 0.35}
    print(json.dumps(result, indent=2))
    for name, text in profiles.items():
        print(f"\n# decode profile, {name}\n{text}")


if __name__ == "__main__":
    main()

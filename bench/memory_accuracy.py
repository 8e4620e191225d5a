"""Memory plan accuracy on SmolLM2 QLoRA (CPU): plan vs tracker vs tracemalloc, printed as JSON.

Each case (batch × sequence, checkpointing on/off) trains on random batches of exactly B×T
tokens in its own process. Pass: |plan - tracker| <= 10% and |tracker - process| <= 10%.

    python bench/memory_accuracy.py                    # all six cases (8×512 is slow on CPU)
    python bench/memory_accuracy.py --cases 1x128 4x256 --steps 1 --out results.json
"""
import argparse
import json
import os
import subprocess
import sys
import time

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "smollm2-demo.yaml")
SHAPES = ("1x128", "4x256", "8x512")


def one_case(shape, ckpt, steps, warmup):
    from packlora.memory.measurement import measure
    b, t = (int(v) for v in shape.split("x"))
    t0 = time.perf_counter()
    rep = measure(CONFIG, steps, overrides=[f"train.batch_size={b}", f"data.max_seq_len={t}",
                                             f"train.grad_checkpointing={str(ckpt).lower()}"],
                  warmup=warmup)
    plan, meas = rep["plan"], rep["measured"]
    vs = meas["tracker_vs_process_pct"]
    return {"batch": b, "seq": t, "grad_checkpointing": ckpt,
            "plan_peak_bytes": plan["peak_bytes"], "plan_peak_at": plan["peak_at"],
            "tracker_peak_bytes": meas["peak_bytes"],
            "process_peak_bytes": meas["process_peak_bytes"],
            "rss_peak_bytes": meas["rss_peak_bytes"],
            "plan_error_pct": meas["plan_error_pct"], "tracker_vs_process_pct": vs,
            "plan_categories": plan["categories"], "tracker_categories": meas["categories"],
            "pass_plan": abs(meas["plan_error_pct"]) <= 10.0,
            "pass_tracker": vs is not None and abs(vs) <= 10.0,
            "step_time_s": meas["step_time_s"], "wall_s": round(time.perf_counter() - t0, 1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="*", default=list(SHAPES), help="BxT shapes")
    ap.add_argument("--ckpt", nargs="*", default=["off", "on"], choices=["off", "on"])
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--one", nargs=2, metavar=("BxT", "CKPT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one_case(a.one[0], a.one[1] == "on", a.steps, a.warmup)))
        return
    results = []
    for shape in a.cases:
        for ckpt in a.ckpt:
            cmd = [sys.executable, __file__, "--one", shape, ckpt, "--steps", str(a.steps),
                   "--warmup", str(a.warmup)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                res = {"case": f"{shape} ckpt {ckpt}", "error": proc.stderr[-2000:]}
            else:
                res = json.loads(proc.stdout.strip().splitlines()[-1])
            results.append(res)
            print(json.dumps({k: v for k, v in res.items() if not k.endswith("categories")}),
                  file=sys.stderr, flush=True)
            if a.out:
                with open(a.out, "w") as f:
                    json.dump({"cases": results}, f, indent=2)
    print(json.dumps({"cases": results}, indent=2))


if __name__ == "__main__":
    main()

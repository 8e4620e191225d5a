"""packlora's LoRA training step against PyTorch + PEFT on the same CPU, taking turns.

Both sides train SmolLM2-135M-Instruct (the shipped GGUF) with r = 16, alpha = 32 on the seven
projections, AdamW, random tokens, batch × seq tokens per step. The peer is
`../shared/bench/peer.sh --mode lora`: PyTorch on the float32-dequantized base, all activations
kept. packlora trains on the packed base, once with checkpointing off and once on. Each turn
runs peer, ours (off), ours (on) as fresh processes, so a slow stretch of the machine hits every
side; medians and bests over the turns, the best-vs-best ratios, and each side's whole-process
peak RSS (the peer's ru_maxrss, our VmHWM, loading included) go out as one JSON document. Each
turn also takes the step's BLAS floor (bench/step_floor.py: its matrix products alone), so the
JSON says what share of the fastest possible step ours reaches and the speed target demands.

Usage: python bench/vs_pytorch.py [--turns 3] [--batch 4] [--seq 256] [--steps 4]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from hostinfo import cpu_name  # bench/hostinfo.py

HERE = Path(__file__).resolve().parent
PEER = HERE.parent.parent / "shared" / "bench" / "peer.sh"


def _last_json(proc, who):
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise SystemExit(f"vs_pytorch: {who} printed no JSON (exit {proc.returncode}):\n"
                     f"{proc.stderr[-2000:]}")


def peer_turn(a):
    cmd = ["bash", str(PEER), "--mode", "lora", "--batch", str(a.batch), "--seq", str(a.seq),
           "--steps", str(a.steps), "--warmup", "1"]
    res = _last_json(subprocess.run(cmd, capture_output=True, text=True, check=False), "peer")
    if res.get("status") != "ok":
        raise SystemExit(f"vs_pytorch: peer failed: {res.get('error')}")
    return {"tokens_per_s": res["tokens_per_s"], "peak_rss_mib": res["peak_rss_mib"],
            "step_s": res["step_s_median"]}


def our_turn(a, ckpt):
    cmd = [sys.executable, str(HERE / "train_step.py"), "--one", ckpt, "--batch", str(a.batch),
           "--seq", str(a.seq), "--steps", str(a.steps)]
    env = dict(os.environ, PYTHONPATH=str(HERE))
    res = _last_json(subprocess.run(cmd, capture_output=True, text=True, check=False, env=env),
                     f"packlora (checkpointing {ckpt})")
    return {"tokens_per_s": res["tokens_per_s"], "peak_rss_mib": res["process_vmhwm_mib"],
            "step_s": res["median_step_s"]}


def floor_turn(a):
    """The BLAS floor of the same step (bench/step_floor.py) in this turn's conditions."""
    cmd = [sys.executable, str(HERE / "step_floor.py"), "--batch", str(a.batch), "--seq",
           str(a.seq)]
    res = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    return {ckpt: {"tokens_per_s": res["ceiling_tokens_per_s"][f"checkpointing_{ckpt}"]}
            for ckpt in ("off", "on")}


def summary(runs):
    tps = [r["tokens_per_s"] for r in runs]
    return {"tokens_per_s_median": statistics.median(tps), "tokens_per_s_best": max(tps),
            "peak_rss_mib_max": max(r["peak_rss_mib"] for r in runs), "runs": runs}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per run (after 1 warm-up)")
    a = ap.parse_args(argv)
    sides = {"peer": [], "packlora_ckpt_off": [], "packlora_ckpt_on": []}
    floors = {"off": [], "on": []}
    for turn in range(a.turns):
        for ckpt, run in floor_turn(a).items():
            floors[ckpt].append(run)
        sides["peer"].append(peer_turn(a))
        sides["packlora_ckpt_off"].append(our_turn(a, "off"))
        sides["packlora_ckpt_on"].append(our_turn(a, "on"))
        print(f"turn {turn + 1}/{a.turns}: " + ", ".join(
            f"{k} {v[-1]['tokens_per_s']} tok/s" for k, v in sides.items()), file=sys.stderr)
    out = {k: summary(v) for k, v in sides.items()}
    peer = out["peer"]
    ratios = {}
    targets = {"ckpt_off": {"speed": 1.25, "peak_rss": 0.35},
               "ckpt_on": {"speed": 1.0, "peak_rss": 0.15}}
    for ckpt in ("off", "on"):
        ours = out[f"packlora_ckpt_{ckpt}"]
        floor = statistics.median(r["tokens_per_s"] for r in floors[ckpt])
        out[f"blas_floor_ckpt_{ckpt}"] = {"tokens_per_s_median": floor, "runs": floors[ckpt]}
        target = targets[f"ckpt_{ckpt}"]["speed"] * peer["tokens_per_s_median"]
        ratios[f"ckpt_{ckpt}"] = {
            "ours_of_floor": round(ours["tokens_per_s_median"] / floor, 3),
            "target_of_floor": round(target / floor, 3),
            "speed_best_vs_best": round(ours["tokens_per_s_best"] / peer["tokens_per_s_best"], 3),
            "speed_median_vs_median": round(ours["tokens_per_s_median"]
                                            / peer["tokens_per_s_median"], 3),
            "peak_rss": round(ours["peak_rss_mib_max"] / peer["peak_rss_mib_max"], 3)}
    print(json.dumps({"bench": "vs_pytorch", "cpu": cpu_name(), "cores": os.cpu_count(),
                      "model": "SmolLM2-135M-Instruct (GGUF Q4_1)", "batch": a.batch,
                      "seq": a.seq, "steps_per_run": a.steps, "turns": a.turns, **out,
                      "ratios": ratios, "targets": targets}, indent=1))


if __name__ == "__main__":
    main()

"""packlora's token-by-token decoding against llama.cpp on the same GGUF and threads, in turns.

Both sides load the shipped SmolLM2-135M-Instruct GGUF (Q4_1, embedding Q8_0) or the GGUF
given with --model (an IQ4_XS or Q4_K_M file, say), take the same prompt ids and decode
greedily for a fixed number of new tokens without stopping at EOS; llama.cpp runs through
llama-cpp-python (PyPI) with as many threads as packlora's Numba, in a process of its own with
the user's environment (bench/llama_cpp_decode.py), since packlora's OpenMP settings would
apply to llama.cpp's threads in a shared process. Each turn times llama.cpp, then packlora; new
tokens per second (prompt included in the time: a short prompt, as in chat turns), medians and
bests over the turns, one JSON document. llama.cpp is also given by its own perf counters (its
one-token evaluations alone: no Python, no sampling), the stricter comparison. packlora decodes
as `generate` does by default, with x rounded to 8 bits in the packed products as llama.cpp
does (kernels/activations.py), and in the same turns with float32 activations
(`packlora_float_activations`).

Usage: python bench/decode_vs_llamacpp.py [--turns 3] [--new 128] [--model FILE.gguf]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import packlora as pl  # noqa: I001  (first: thread settings before numpy loads OpenBLAS)
from numba import get_num_threads
from packlora import _env as pl_env
from packlora.generate import generate_ids
from packlora.models.resolve import resolve_source

from hostinfo import cpu_name  # bench/hostinfo.py

HERE = Path(__file__).resolve().parent

MODEL = "smollm2-135m-instruct"
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


class LlamaCpp:
    """llama.cpp decoding in its own process (bench/llama_cpp_decode.py), started with the
    environment as the user has it: none of the settings packlora gives its own process."""

    def __init__(self, path, threads):
        env = {k: v for k, v in os.environ.items() if k not in pl_env.APPLIED}
        self.proc = subprocess.Popen([sys.executable, str(HERE / "llama_cpp_decode.py"),
                                      str(path), str(threads)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)

    def turn(self, ids, new):
        """(seconds, tokens, llama.cpp's own seconds per one-token evaluation)."""
        self.proc.stdin.write(json.dumps({"ids": list(map(int, ids)), "new": new}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"decode_vs_llamacpp: llama.cpp's process ended "
                             f"(exit {self.proc.wait()})")
        res = json.loads(line)
        return res["seconds"], res["tokens"], res["per_token"]

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def packlora_turn(model, ids, new, int8=True):
    t0 = time.perf_counter()
    out = generate_ids(model, ids, max_new_tokens=new, temperature=0.0, int8_activations=int8)
    return time.perf_counter() - t0, out


def _same_before_difference(ref, ours):
    return next((i for i, (x, y) in enumerate(zip(ref, ours)) if x != y), len(ours))


def summary(times, new):
    tps = [new / t for t in times]
    return {"new_tokens_per_s_median": round(statistics.median(tps), 1),
            "new_tokens_per_s_best": round(max(tps), 1),
            "seconds": [round(t, 3) for t in times]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--new", type=int, default=128, help="new tokens per turn")
    ap.add_argument("--model", default=MODEL, help="a .gguf file or a shipped model's name")
    a = ap.parse_args(argv)
    threads = get_num_threads()
    path = resolve_source(a.model)
    if path.suffix.lower() != ".gguf":
        raise SystemExit(f"decode_vs_llamacpp: --model {a.model}: llama.cpp needs a .gguf file")
    llm = LlamaCpp(path, threads)
    model = pl.load_model(str(path))
    ids = model.tokenizer.encode(PROMPT, add_special_tokens=True)
    llm.turn(ids, 8), packlora_turn(model, ids, 8), packlora_turn(model, ids, 8, False)  # warm-up
    times = {"llama_cpp": [], "packlora": [], "packlora_float_activations": []}
    agree, agree_float, eval_s = [], [], []
    for _ in range(a.turns):
        t_ref, ref, per_token = llm.turn(ids, a.new)
        eval_s.append(per_token)
        t_ours, ours = packlora_turn(model, ids, a.new)
        t_float, ours_float = packlora_turn(model, ids, a.new, int8=False)
        times["llama_cpp"].append(t_ref)
        times["packlora"].append(t_ours)
        times["packlora_float_activations"].append(t_float)
        agree.append(_same_before_difference(ref, ours))
        agree_float.append(_same_before_difference(ref, ours_float))
    llm.close()
    out = {k: summary(v, a.new) for k, v in times.items()}
    own = round(1.0 / min(eval_s), 1)
    out["llama_cpp"]["own_eval_tokens_per_s_best"] = own
    best = out["packlora"]["new_tokens_per_s_best"]
    ratio = {"best_vs_best": round(best / out["llama_cpp"]["new_tokens_per_s_best"], 3),
             "median_vs_median": round(out["packlora"]["new_tokens_per_s_median"]
                                       / out["llama_cpp"]["new_tokens_per_s_median"], 3),
             "best_vs_llama_cpp_own_eval": round(best / own, 3),
             "float_activations_median_vs_median": round(
                 out["packlora_float_activations"]["new_tokens_per_s_median"]
                 / out["llama_cpp"]["new_tokens_per_s_median"], 3)}
    print(json.dumps({"bench": "decode_vs_llamacpp", "cpu": cpu_name(), "cores": os.cpu_count(),
                      "threads": threads, "model": str(path.name), "prompt_tokens": len(ids),
                      "new_tokens": a.new, "turns": a.turns, **out, "ratio": ratio,
                      "greedy_tokens_equal_before_first_difference": min(agree),
                      "greedy_tokens_equal_before_first_difference_float": min(agree_float),
                      "target_ratio": 0.6}, indent=1))


if __name__ == "__main__":
    main()

"""packlora's token-by-token decoding against llama.cpp on the same GGUF and threads, in turns.

Both sides load the shipped SmolLM2-135M-Instruct GGUF (Q4_1, embedding Q8_0), take the same
prompt ids and decode greedily for a fixed number of new tokens without stopping at EOS;
llama.cpp runs through llama-cpp-python (PyPI) with as many threads as packlora's Numba. Each
turn times llama.cpp, then packlora; new tokens per second (prompt included in the time: a
short prompt, as in chat turns), medians and bests over the turns, one JSON document. llama.cpp
is also given by its own perf counters (its one-token evaluations alone: no Python, no
sampling), the stricter comparison.

Usage: python bench/decode_vs_llamacpp.py [--turns 3] [--new 128]
"""
import argparse
import json
import os
import statistics
import time

import packlora as pl  # noqa: I001  (first: thread settings before numpy loads OpenBLAS)
import llama_cpp
from llama_cpp import Llama
from numba import get_num_threads
from packlora.generate import generate_ids
from packlora.models.resolve import resolve_source

from hostinfo import cpu_name  # bench/hostinfo.py

MODEL = "smollm2-135m-instruct"
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


def llama_cpp_turn(llm, ids, new):
    """Seconds to decode `new` tokens after `ids` through llama-cpp-python, the tokens, and
    llama.cpp's own time for its one-token evaluations (its perf counters: no Python, no
    sampling, no prompt)."""
    llm.reset()
    llama_cpp.llama_perf_context_reset(llm.ctx)
    out = []
    t0 = time.perf_counter()
    for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        out.append(tok)
        if len(out) == new:
            break
    seconds = time.perf_counter() - t0
    perf = llama_cpp.llama_perf_context(llm.ctx)
    return seconds, out, perf.t_eval_ms / 1e3 / max(perf.n_eval, 1)


def packlora_turn(model, ids, new):
    t0 = time.perf_counter()
    out = generate_ids(model, ids, max_new_tokens=new, temperature=0.0)
    return time.perf_counter() - t0, out


def summary(times, new):
    tps = [new / t for t in times]
    return {"new_tokens_per_s_median": round(statistics.median(tps), 1),
            "new_tokens_per_s_best": round(max(tps), 1),
            "seconds": [round(t, 3) for t in times]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--new", type=int, default=128, help="new tokens per turn")
    a = ap.parse_args(argv)
    threads = get_num_threads()
    path = resolve_source(MODEL)
    llm = Llama(str(path), n_threads=threads, n_threads_batch=threads, n_ctx=512,
                n_batch=512, verbose=False)
    model = pl.load_model(MODEL)
    ids = model.tokenizer.encode(PROMPT, add_special_tokens=True)
    llama_cpp_turn(llm, ids, 8), packlora_turn(model, ids, 8)  # warm-up: compile, page in
    times = {"llama_cpp": [], "packlora": []}
    agree, eval_s = [], []
    for _ in range(a.turns):
        t_ref, ref, per_token = llama_cpp_turn(llm, ids, a.new)
        eval_s.append(per_token)
        t_ours, ours = packlora_turn(model, ids, a.new)
        times["llama_cpp"].append(t_ref)
        times["packlora"].append(t_ours)
        same = next((i for i, (x, y) in enumerate(zip(ref, ours)) if x != y), len(ours))
        agree.append(same)
    out = {k: summary(v, a.new) for k, v in times.items()}
    own = round(1.0 / min(eval_s), 1)
    out["llama_cpp"]["own_eval_tokens_per_s_best"] = own
    best = out["packlora"]["new_tokens_per_s_best"]
    ratio = {"best_vs_best": round(best / out["llama_cpp"]["new_tokens_per_s_best"], 3),
             "median_vs_median": round(out["packlora"]["new_tokens_per_s_median"]
                                       / out["llama_cpp"]["new_tokens_per_s_median"], 3),
             "best_vs_llama_cpp_own_eval": round(best / own, 3)}
    print(json.dumps({"bench": "decode_vs_llamacpp", "cpu": cpu_name(), "cores": os.cpu_count(),
                      "threads": threads, "model": str(path.name), "prompt_tokens": len(ids),
                      "new_tokens": a.new, "turns": a.turns, **out, "ratio": ratio,
                      "greedy_tokens_equal_before_first_difference": min(agree),
                      "target_ratio": 0.6}, indent=1))


if __name__ == "__main__":
    main()

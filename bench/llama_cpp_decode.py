"""llama.cpp's side of bench/decode_vs_llamacpp.py, in a process of its own: packlora's process
settings (src/_env.py: OpenMP's spin and wait policy) would otherwise apply to llama.cpp's OpenMP
threads too. Those settings alone moved its SmolLM2 decoding between 39 and 117 tokens/s here
(its own default: 93); its users run it in their own environment.

Started as `python bench/llama_cpp_decode.py GGUF THREADS`; reads one JSON request per line,
{"ids": [...], "new": N}, decodes greedily and answers one JSON line: the seconds, the tokens,
and llama.cpp's own seconds per one-token evaluation (its perf counters: no Python, no sampling,
no prompt). It never imports packlora.
"""
import json
import sys
import time

import llama_cpp
from llama_cpp import Llama


def decode(llm, ids, new):
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
    return {"seconds": seconds, "tokens": out,
            "per_token": perf.t_eval_ms / 1e3 / max(perf.n_eval, 1)}


def main():
    path, threads = sys.argv[1], int(sys.argv[2])
    llm = Llama(path, n_threads=threads, n_threads_batch=threads, n_ctx=512, n_batch=512,
                verbose=False)
    for line in sys.stdin:
        req = json.loads(line)
        print(json.dumps(decode(llm, req["ids"], req["new"])), flush=True)


if __name__ == "__main__":
    main()

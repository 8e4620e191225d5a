"""What the CUDA kernels compile to, without a GPU: registers, stack (local memory) and spills
per thread and shared memory per block from ptxas, and PTX instructions (all; fma.rn.f32; loads
from global and from shared memory: reads per multiply-add; atomics, all and on floats), per
kernel and format, as JSON; and, as a measure of decoding cost, the straight-line PTX of one
run of 8 values decoded by `decode_run` (any run) and by `decode_group` (a run inside one scale
group: the hot loops).

A GPU is lent to this project only now and then; between runs these are the numbers a kernel
change can be judged by (a kernel whose registers or local memory grow runs fewer warps or
waits on memory). Each kernel is compiled as a GPU would compile it: Numba-CUDA to PTX for the
target (sm_90, the H200, by default), then ptxas.

Needs Numba-CUDA and the CUDA toolkit's libnvvm and ptxas (CUDA_HOME), no driver or device:
  python -m venv /tmp/cuda-static && /tmp/cuda-static/bin/pip install . numba-cuda \
      "nvidia-cuda-nvrtc==13.*"
  CUDA_HOME=/usr/local/cuda /tmp/cuda-static/bin/python bench/cuda_static.py [--cc 9.0]
      [--formats nf4+dq,q4_k,q8_0,q4_0,q6_k | all] [--kernels gemv_fwd,...]
"""
import argparse
import functools
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numba.cuda.dispatcher as cuda_dispatcher
from numba import cuda, float32, types

from packlora.kernels.cuda import gemv, rows, scatter
from packlora.kernels.cuda.decode import decode_group, decode_run
from packlora.kernels.cuda.gemm import gemm_kernel
from packlora.kernels.cuda.ops import LARGE_M_TILE, SMALL_M_CANDIDATES, SMALL_M_TILE
from packlora.kernels.format_ids import FORMAT_IDS
from packlora.quant import REGISTRY

FORMATS = ("nf4+dq", "q4_k", "q8_0", "q4_0", "q6_k")
RUN = gemv.FWD_SEG  # values per run in the decode probes
_RUN_SHAPE = (1, RUN)
_F32_2D = types.Array(types.float32, 2, "C")
_F32_3D = types.Array(types.float32, 3, "C")  # the parts of a reduction split over blocks
_INT = types.int64
_COUNTS = types.Array(types.int32, 1, "C")  # a counter an output tile (parts.py)
# kdim, bs, q, q16, absmax, amq, amcode, amscale, amoff, codebook (launch.weight_args)
_WEIGHT = (_INT, _INT, types.Array(types.uint8, 1, "C"), types.Array(types.float16, 1, "C"),
           *(types.Array(t, 1, "C") for t in (types.float32, types.uint8, types.float32,
                                              types.float32, types.float32, types.float32)))
_TILE_ARGS = (_F32_2D, _F32_3D, _F32_2D, _COUNTS, _INT, _INT, _INT, _INT)  # a, c parts, out,
# counts, fold, bwd, span, grp
_GEMV_BWD_ARGS = (_F32_2D, _F32_3D, _F32_2D, _COUNTS, _INT, _INT)  # dy, parts, dx, counts,
# fold, chunk
# kernel name -> (build(fmt, dq), the arguments before the weight's); _16: the GEMV for
# up to 16 rows; _rows2: the backward decoding two rows of W at a time; the other tile_*: the
# small-M tiles the GPU check times against SMALL_M_TILE
KERNELS = {
    "gemv_fwd": (gemv.gemv_fwd, (_F32_2D, _F32_2D)),
    "gemv_bwd": (functools.partial(gemv.gemv_bwd, wrows=gemv.BWD_ROWS), _GEMV_BWD_ARGS),
    "gemv_fwd_16": (functools.partial(gemv.gemv_fwd, rows=gemv.MAX_M), (_F32_2D, _F32_2D)),
    "gemv_bwd_16": (functools.partial(gemv.gemv_bwd, rows=gemv.MAX_M, wrows=gemv.BWD_ROWS),
                    _GEMV_BWD_ARGS),
    "gemv_bwd_rows2": (functools.partial(gemv.gemv_bwd, wrows=2), _GEMV_BWD_ARGS),
    "tile_small_m": (gemm_kernel(SMALL_M_TILE), _TILE_ARGS),
    "tile_large_m": (gemm_kernel(LARGE_M_TILE), _TILE_ARGS),
    **{name: (gemm_kernel(tile), _TILE_ARGS) for name, tile in SMALL_M_CANDIDATES.items()},
    "gather_rows": (rows._gather_kernel, (types.Array(types.int64, 1, "C"), _F32_2D, _INT)),
}


@functools.cache
def _probe(decode, fmt, dq):
    """A kernel that decodes one run of RUN values of W into registers and stores them: its
    PTX is straight-line code, about what one run costs inside the hot loops."""
    @cuda.jit
    def probe(out, n, kdim, bs, q, q16, absmax, amq, amcode, amscale, amoff, cb):
        w = cuda.local.array(_RUN_SHAPE, float32)
        k = cuda.threadIdx.x * RUN
        decode(w, 0, 0, 0, 1, RUN, n, k, kdim, fmt, bs, dq, q, q16, absmax, amq, amcode,
               amscale, amoff, cb)
        for t in range(RUN):
            out[0, k + t] = w[0, t]
    return probe


KERNELS["decode_run"] = (functools.partial(_probe, decode_run), (_F32_2D, _INT))
KERNELS["decode_group"] = (functools.partial(_probe, decode_group), (_F32_2D, _INT))
# kernels that take no packed weight: compiled once, not per format
_I64_1D = types.Array(types.int64, 1, "C")
PLAIN_KERNELS = {
    "scatter_rows": (scatter._run_sums, (_F32_2D, _F32_2D, _I64_1D, _I64_1D, _I64_1D, _INT)),
}


class _Target:
    """What Numba-CUDA asks of "the current device" when it compiles a device function: only
    its compute capability, here the target's (no driver is needed for that)."""

    def __init__(self, cc):
        self.compute_capability = cc


def _ptxas(ptx, cc):
    """ptxas -v's resource line for one kernel: registers, stack, spills, shared bytes."""
    with tempfile.TemporaryDirectory() as d:
        src = Path(d, "k.ptx")
        src.write_text(ptx)
        res = subprocess.run(["ptxas", f"-arch=sm_{cc[0]}{cc[1]}", "-O3", "-v", str(src), "-o",
                              str(Path(d, "k.cubin"))], capture_output=True, text=True,
                             check=True)
    text = res.stderr

    def num(pattern):
        m = re.search(pattern, text)
        return int(m.group(1)) if m else 0
    return {"registers": num(r"Used (\d+) registers"), "stack_bytes": num(r"(\d+) bytes stack"),
            "spill_stores": num(r"(\d+) bytes spill stores"),
            "spill_loads": num(r"(\d+) bytes spill loads"), "smem_bytes": num(r"(\d+) bytes smem")}


# atom.* / red.* on floats (predicated or not): float atomic adds land in an order that varies
# between runs, so a kernel with them gives results that differ in their last bits (integer
# counters, as parts.py keeps, do not)
_FLOAT_ATOMIC = re.compile(r"(^|\s)(atom|red)\.[\w.]*\.f(16|32|64)\b")
_ATOMIC = re.compile(r"(^|\s)(atom|red)\.")


def kernel_stats(kernel, sig, cc):
    """ptxas resources and PTX size of one kernel (a dispatcher, argument types), compiled with
    its launch bounds."""
    t0 = time.perf_counter()
    ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=cc,
                              launch_bounds=kernel.targetoptions.get("launch_bounds"))
    compile_s = time.perf_counter() - t0
    body = [ln for ln in (raw.strip() for raw in ptx.splitlines())
            if ln and ln.endswith(";") and not ln.startswith((".", "//"))]
    def count(*prefixes):
        return sum(1 for ln in body if ln.startswith(prefixes))
    return {**_ptxas(ptx, cc), "ptx_instructions": len(body),
            "ptx_local_accesses": count("ld.local", "st.local"),
            "ptx_fma": count("fma.rn.f32"), "ptx_global_loads": count("ld.global"),
            "ptx_shared_loads": count("ld.shared"),
            "ptx_atomics": sum(1 for ln in body if _ATOMIC.search(ln)),
            "ptx_float_atomics": sum(1 for ln in body if _FLOAT_ATOMIC.search(ln)),
            "compile_s": round(compile_s, 2)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cc", default="9.0", help="compute capability to compile for")
    ap.add_argument("--formats", default=",".join(FORMATS),
                    help="formats, nf4+dq for double-quantized; all: every format")
    ap.add_argument("--kernels", default=",".join([*KERNELS, *PLAIN_KERNELS]))
    ap.add_argument("--shard", default="0/1", help="I/N: only formats I, I + N, ... (and the "
                    "kernels that take no format where I is 0), for N processes run at once")
    args = ap.parse_args()
    shard, shards = (int(p) for p in args.shard.split("/"))
    if shutil.which("ptxas") is None:
        sys.exit("cuda_static: ptxas not found: put a CUDA toolkit's bin on PATH")
    formats = args.formats.split(",")
    if formats == ["all"]:
        formats = [f for name in FORMAT_IDS for f in
                   ((name, name + "+dq") if REGISTRY[name].double_quant else (name,))]
    formats = formats[shard::shards]
    cc = tuple(int(p) for p in args.cc.split("."))
    cuda_dispatcher.get_current_device = lambda: _Target(cc)
    out = {"cc": args.cc, "numba_cuda": _version("numba-cuda"), "kernels": {}}
    knames = args.kernels.split(",")
    for kname in (k for k in knames if k in PLAIN_KERNELS and shard == 0):
        kernel, sig = PLAIN_KERNELS[kname]
        out["kernels"][kname] = kernel_stats(kernel, sig, cc)
        print(kname, out["kernels"][kname], file=sys.stderr)
    for fmt in formats:
        name, dq = fmt.removesuffix("+dq"), int(fmt.endswith("+dq"))
        for kname in (k for k in knames if k not in PLAIN_KERNELS):
            build, head = KERNELS[kname]
            kernel = build(FORMAT_IDS[name], dq)
            out["kernels"][f"{kname}/{fmt}"] = kernel_stats(kernel, head + _WEIGHT, cc)
            print(kname, fmt, out["kernels"][f"{kname}/{fmt}"], file=sys.stderr)
    print(json.dumps(out, indent=1))


def _version(dist):
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()

"""CUDA packed-linear kernels in Numba's CUDA simulator (subprocesses), on small shapes; the
launches they plan: test_cuda_launch.py; on a real GPU: test_kernels_cuda_gpu.py."""
import functools
import json
import sys

import numpy as np
import pytest
from at_once import workers
from cudasim_run import run_claimed, simulator_results
from gguf_blocks import random_packed

VARIANTS = [("nf4", False), ("nf4", True), ("fp4", False), ("fp4", True), ("int8", False),
            ("q4_0", False), ("q4_1", False), ("q8_0", False), ("q5_0", False), ("q5_1", False),
            ("f16", False), ("bf16", False)]
SHAPES = [(1, 33, 96), (7, 64, 32), (9, 1, 96)]  # (M, N, K)
# ggml super-blocks of 256 and IQ4's blocks (random bytes with small fp16 scales: not quantized
# from float here)
RANDOM_BLOCKS = ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs"]
KQUANT_SHAPES = [(3, 9, 512), (1, 5, 256)]
# nf4/fp4/int8 only: blocks straddle rows, a tail block; odd numel (pad nibble), block 32; at
# M = 3 a K the forward GEMV's runs do not divide (the tile kernel) and the backward's do.
FLAT_SHAPES = [((7, 33, 100), 64), ((5, 9, 99), 32), ((3, 7, 100), 64)]
# (fmt, dq, shape, block, tile args or a name in ops.SMALL_M_CANDIDATES): other tile shapes (32
# threads each), and the small-M candidates bench/kernels_cuda.py times (64 and 128 threads)
TILE_CASES = [("nf4", True, (17, 20, 100), 64, (16, 16, 16, 4, 2, 4)),
              ("q4_1", False, (9, 40, 64), 32, (8, 32, 32, 4, 8, 8)),
              ("q4_k", False, (13, 70, 512), None, "tile_4x4_64"),
              ("nf4", True, (16, 130, 192), None, "tile_4x4_128")]
# The tiles a GPU launches (kernels/cuda/ops.py), 256 threads each, on small ragged shapes; K
# long enough that the reduction is split across blocks (parts summed). M <= GEMV_MAX_M without
# a tile (the other cases of M <= 4) runs the GEMV kernels (gemv.py). Checked against numpy in
# their FOLD_CASES run (the simulator's slowest cases: run once, not twice).
PRODUCTION_CASES = [("nf4", True, (5, 70, 192), "SMALL_M_TILE"),
                    ("q4_k", False, (3, 66, 256), "SMALL_M_TILE"),
                    ("q8_0", False, (20, 65, 160), "LARGE_M_TILE")]
# The split products, their parts added in the kernel and after it: the production tiles, and
# the GEMV backward with 40 and 64 parts (several batches of the adder's reads, a ragged last)
FOLD_CASES = [*PRODUCTION_CASES, ("q4_0", False, (3, 40, 256), None),
              ("nf4", True, (1, 64, 512), None)]


def _cases():
    """case id -> (fmt, dq, (M, N, K), block_size or None, tile args or None)."""
    cases = {}
    for fmt, dq in VARIANTS:
        name = fmt + ("_dq" if dq else "")
        for shape in SHAPES:
            cases[f"{name}-{'x'.join(map(str, shape))}"] = (fmt, dq, shape, None, None)
        if fmt in ("nf4", "fp4", "int8"):
            for shape, bs in FLAT_SHAPES:
                cases[f"{name}-{'x'.join(map(str, shape))}-bs{bs}"] = (fmt, dq, shape, bs, None)
    for fmt in RANDOM_BLOCKS:
        for shape in KQUANT_SHAPES:
            cases[f"{fmt}-{'x'.join(map(str, shape))}"] = (fmt, False, shape, None, None)
    for fmt, dq, shape, bs, tile in TILE_CASES:
        label = tile if isinstance(tile, str) else f"tile{tile[:3]}"
        cases[f"{fmt}{'_dq' if dq else ''}-{'x'.join(map(str, shape))}-{label}"] = (
            fmt, dq, shape, bs, tile)
    return cases


CASES = _cases()


def _fold_key(fmt, shape):
    return f"fold_bits/{fmt}-{'x'.join(map(str, shape))}"


# ---------------------------------------------------------------- simulator side (subprocess)
def _rel_err(got, ref):
    return float(np.abs(got - ref).max() / max(float(np.abs(ref).max()), 1e-30))


def _errors(y, dx, x, dy, dense):
    """The forward's and backward's errors against numpy's products with the decoded W."""
    return {"fwd": _rel_err(y, x @ dense.T), "bwd": _rel_err(dx, dy @ dense),
            "shapes": [list(y.shape), list(dx.shape)], "ref_max": float(np.abs(dense).max())}


def _sim_case(ops, Tile, quantize, rng, case):
    fmt, dq, (m, n, k), bs, tile = case
    if fmt in RANDOM_BLOCKS:
        w = random_packed(fmt, n, k, rng)
    else:
        w = quantize(rng.standard_normal((n, k)).astype(np.float32), fmt, block_size=bs,
                     double_quant=dq)
    dense = w.dequantize()                                              # (N, K)
    x = rng.standard_normal((m, k)).astype(np.float32)                  # (M, K)
    dy = rng.standard_normal((m, n)).astype(np.float32)                 # (M, N)
    if isinstance(tile, str):  # a production tile or a candidate, by name
        tile = ops.SMALL_M_CANDIDATES.get(tile) or getattr(ops, tile)
    elif tile:
        tile = Tile(*tile)
    return _errors(ops.linear_fwd(x, w, tile=tile), ops.linear_bwd(dy, w, tile=tile), x, dy,
                   dense)


def _sim_fp16_scales(ops, quantize, rng):
    """q8_0 with hand-set fp16 scales: subnormal, negative, zero, max, 1.0."""
    w = quantize(rng.standard_normal((5, 64)).astype(np.float32), "q8_0")
    blocks = w.buffers["blocks"]                                        # (5, 2 * 34)
    scales = np.array([2.0 ** -20, -0.3, 0.0, 65504.0, 1.0], dtype=np.float16)
    blocks[:, 0:2] = scales.view(np.uint8).reshape(5, 2)
    blocks[:, 34:36] = scales[::-1].copy().view(np.uint8).reshape(5, 2)
    dense = w.dequantize()
    x = rng.standard_normal((3, 64)).astype(np.float32)
    dy = rng.standard_normal((3, 5)).astype(np.float32)
    return {"fwd": _rel_err(ops.linear_fwd(x, w), x @ dense.T),
            "bwd": _rel_err(ops.linear_bwd(dy, w), dy @ dense),
            "subnormal_ok": bool(dense[0, 0] != 0 or w.buffers["blocks"][0, 2] == 0)}


def _sim_api(ops, quantize, rng):
    """out=, M=0, and the error messages."""
    w = quantize(rng.standard_normal((9, 32)).astype(np.float32), "nf4")
    x = rng.standard_normal((2, 32)).astype(np.float32)
    out = np.full((2, 9), np.nan, dtype=np.float32)
    res = {"out_is_out": ops.linear_fwd(x, w, out=out) is out,
           "out_err": _rel_err(out, x @ w.dequantize().T),
           "empty": list(ops.linear_fwd(np.zeros((0, 32), np.float32), w).shape)}
    for key, call in [("bad_width", lambda: ops.linear_fwd(x[:, :31].copy(), w)),
                      ("bad_dtype", lambda: ops.linear_bwd(np.zeros((2, 9)), w)),
                      ("bad_out", lambda: ops.linear_fwd(x, w, out=np.zeros((9, 2), np.float32)))]:
        try:
            call()
            res[key] = "no error"
        except ValueError as e:
            res[key] = str(e)
    return res


def _sim_gather(quantize, rng):
    """Row gather (embedding lookups) for every format, rows repeated and out of order."""
    from packlora.kernels.cuda.rows import gather_rows
    errs = {}
    for fmt, dq in VARIANTS:
        x = rng.standard_normal((9, 96)).astype(np.float32)
        x[0] *= {"f16": 1e-6, "bf16": 1e-39}.get(fmt, 1.0)  # subnormal 16-bit floats
        x[3, :7] = [0.0, -0.0, 1e4, -3e4, 1.0, -1.0, 0.5]
        w = quantize(x, fmt, double_quant=dq)
        rows = np.array([7, 0, 7, 3], dtype=np.int64)
        out = gather_rows(w, rows, np.empty((4, 96), np.float32))
        errs[fmt + ("_dq" if dq else "")] = _rel_err(out, w.dequantize()[rows])
    w = quantize(rng.standard_normal((5, 99)).astype(np.float32), "nf4", block_size=32)
    rows = np.array([4, 1], dtype=np.int64)  # a row of 99: value by value, not in runs
    errs["nf4-k99"] = _rel_err(gather_rows(w, rows, np.empty((2, 99), np.float32)),
                               w.dequantize()[rows])
    w = quantize(rng.standard_normal((3, 8192)).astype(np.float32), "q8_0")
    rows = np.array([2, 0], dtype=np.int64)  # rows of two blocks each (the grid's y)
    errs["q8_0-k8192"] = _rel_err(gather_rows(w, rows, np.empty((2, 8192), np.float32)),
                                  w.dequantize()[rows])
    for fmt in RANDOM_BLOCKS:  # against gguf-checked numpy decoders (kquants.py, iquants.py)
        w = random_packed(fmt, 9, 512, rng)
        rows = np.array([8, 0, 8, 5], dtype=np.int64)
        out = gather_rows(w, rows, np.empty((4, 512), np.float32))
        errs[fmt] = _rel_err(out, w.dequantize()[rows])
    return errs


def _sim_patched(ops, Tile, quantize, rng, patches, cases):
    """_sim_case for each (fmt, dq, (M, N, K)) with ops' attributes set as `patches` says
    meanwhile."""
    saved = {name: getattr(ops, name) for name in patches}
    for name, value in patches.items():
        setattr(ops, name, value)
    try:
        return {f"{fmt}{'_dq' if dq else ''}-{'x'.join(map(str, shape))}":
                _sim_case(ops, Tile, quantize, rng, (fmt, dq, shape, None, None))
                for fmt, dq, shape in cases}
    finally:
        for name, value in saved.items():
            setattr(ops, name, value)


def _sim_weight_args(ops, quantize, rng):
    """A weight's kernel arguments are made once; replacing a buffer makes them again."""
    from packlora.kernels.cuda.launch import weight_args
    w = quantize(rng.standard_normal((6, 64)).astype(np.float32), "q8_0")
    other = quantize(rng.standard_normal((6, 64)).astype(np.float32), "q8_0")
    x = rng.standard_normal((2, 64)).astype(np.float32)
    first = weight_args(w, np)
    before = _rel_err(ops.linear_fwd(x, w), x @ w.dequantize().T)
    kept = weight_args(w, np) is first
    w.buffers["blocks"] = other.buffers["blocks"]
    return {"kept": kept, "remade": weight_args(w, np) is not first, "before": before,
            "after": _rel_err(ops.linear_fwd(x, w), x @ other.dequantize().T)}


def _sim_fold_case(ops, quantize, rng, case):
    """A split product with the kernel adding its parts (SUM_PARTS_IN_KERNEL) and with numpy
    adding them after the launch: whether the bits are the same (both add the parts in order),
    in how many launches the kernel added them, and the first's errors (_errors)."""
    fmt, dq, (m, n, k), tile = case
    folds, plain = [], ops.launch

    def spy(build, grid, block, args, w, result=1):
        if len(args) > 4:  # the tile's and the GEMV backward's (the GEMV forward does not split)
            folds.append(args[4])
        plain(build, grid, block, args, w, result)
    w = random_packed(fmt, n, k, rng) if fmt in RANDOM_BLOCKS else quantize(
        rng.standard_normal((n, k)).astype(np.float32), fmt, double_quant=dq)
    x = rng.standard_normal((m, k)).astype(np.float32)                   # (M, K)
    dy = rng.standard_normal((m, n)).astype(np.float32)                  # (M, N)
    tile = getattr(ops, tile) if tile else None
    got, ops.launch = [], spy
    try:
        for ops.SUM_PARTS_IN_KERNEL in (True, False):
            got.append((ops.linear_fwd(x, w, tile=tile), ops.linear_bwd(dy, w, tile=tile)))
    finally:
        ops.launch, ops.SUM_PARTS_IN_KERNEL = plain, True
    return {"same": all(np.array_equal(a, b) for a, b in zip(*got)), "folded": sum(folds),
            **_errors(*got[0], x, dy, w.dequantize())}


def _sim_wrows_bits(ops, quantize, rng):
    """The GEMV backward decoding two rows of W at a time (gemv.BWD_ROWS = 2) against one: the
    same bits (the same multiply-adds in the same order), with chunks of W's rows (a scratch
    cap of `nparts` parts) odd, so that a last row goes alone, and even."""
    cases = [("q4_k", False, (1, 37, 256), 3), ("nf4", True, (3, 29, 128), 2),
             ("q8_0", False, (2, 40, 64), 5)]
    out, saved = {}, ops.gemv.BWD_ROWS
    try:
        for fmt, dq, (m, n, k), nparts in cases:
            w = random_packed(fmt, n, k, rng) if fmt in RANDOM_BLOCKS else quantize(
                rng.standard_normal((n, k)).astype(np.float32), fmt, double_quant=dq)
            dy = rng.standard_normal((m, n)).astype(np.float32)          # (M, N)
            got = []
            for ops.gemv.BWD_ROWS in (1, 2):
                got.append(ops.linear_bwd(dy, w, cap_elems=nparts * m * k))
            out[f"{fmt}-{m}x{n}x{k}"] = {"same": bool(np.array_equal(*got)),
                                         "err": _rel_err(got[1], dy @ w.dequantize())}
    finally:
        ops.gemv.BWD_ROWS = saved
    return out


def _simulator_main(claims):
    # Threads switch every 0.1 ms, so that a missing barrier in a kernel shows. The simulator's
    # own races, on shared arrays and on device functions' module swap (cudasim_shared.py), are
    # closed first.
    sys.setswitchinterval(1e-4)
    from cudasim_shared import lock_shared_arrays, swap_modules_per_launch
    lock_shared_arrays()
    swap_modules_per_launch()
    from numba import config
    from packlora.kernels.cuda import ops
    from packlora.kernels.cuda.gemm import Tile
    from packlora.quant import quantize
    assert config.ENABLE_CUDASIM, "run with NUMBA_ENABLE_CUDASIM=1"
    print(json.dumps(run_claimed(_sim_jobs(ops, Tile, quantize), claims)))


def _sim_jobs(ops, Tile, quantize):
    """{key: function of a generator}: every simulator case, the longest first (each of the
    processes sharing them takes the next unclaimed one)."""
    jobs = {_fold_key(fmt, shape):
            functools.partial(_sim_fold_case, ops, quantize, case=(fmt, dq, shape, tile))
            for fmt, dq, shape, tile in FOLD_CASES}
    # the GEMV at every row bound (GEMV_MAX_M raised to gemv.MAX_M), M up to 16; N not a
    # multiple of a warp's rows of W, K not of a block's chunk of x
    every_bound = {"GEMV_MAX_M": ops.gemv.MAX_M}
    jobs["gemv_rows"] = functools.partial(
        _sim_patched, ops, Tile, quantize, patches=every_bound, cases=[
            ("q4_0", False, (16, 12, 256)), ("nf4", True, (9, 12, 256)),
            ("q6_k", False, (4, 12, 256)), ("q8_0", False, (5, 12, 256)),
            ("nf4", False, (12, 13, 192)), ("q8_0", False, (3, 7, 288))])
    # the GEMV with the GPU's threads a block (eight warps; rows of W past N idle)
    jobs["gemv_gpu_threads"] = functools.partial(
        _sim_patched, ops, Tile, quantize,
        patches={**every_bound, "SIM_GEMV_THREADS": ops.gemv.THREADS},
        cases=[("q4_k", False, (3, 20, 256)), ("nf4", True, (2, 9, 128)),
               ("q8_0", False, (12, 21, 160))])
    jobs["gather"] = functools.partial(_sim_gather, quantize)
    for cid, case in reversed(CASES.items()):  # the tiles' cases, the longest, are last there
        jobs[cid] = functools.partial(_sim_case, ops, Tile, quantize, case=case)
    for name, fn in (("fp16_scales", _sim_fp16_scales), ("api", _sim_api),
                     ("weight_args", _sim_weight_args), ("wrows_bits", _sim_wrows_bits)):
        jobs[name] = functools.partial(fn, ops, quantize)
    return jobs


# ---------------------------------------------------------------- pytest side
@pytest.fixture(scope="module")
def sim():
    """Every simulator case, run once, the cases shared among processes run at once."""
    return simulator_results(__file__, timeout=300, processes=workers())


def _check_case(res, shape):
    m, n, k = shape
    assert res["shapes"] == [[m, n], [m, k]]
    assert res["ref_max"] > 0
    assert res["fwd"] < 2e-5, f"fwd rel err {res['fwd']}"
    assert res["bwd"] < 2e-5, f"bwd rel err {res['bwd']}"


@pytest.mark.parametrize("case_id", list(CASES))
def test_simulator_matches_reference(sim, case_id):
    _check_case(sim[case_id], CASES[case_id][2])


@pytest.mark.parametrize("fmt, dq, shape, tile", PRODUCTION_CASES)
def test_simulator_production_tiles_match_reference(sim, fmt, dq, shape, tile):
    _check_case(sim[_fold_key(fmt, shape)], shape)


def test_simulator_fp16_scale_decoding(sim):
    res = sim["fp16_scales"]
    assert res["subnormal_ok"]
    assert res["fwd"] < 2e-5 and res["bwd"] < 2e-5, res


def test_simulator_gather_rows(sim):
    assert len(sim["gather"]) == len(VARIANTS) + len(RANDOM_BLOCKS) + 2
    for name, err in sim["gather"].items():
        assert err == 0.0, (name, err)


def test_simulator_api_and_errors(sim):
    res = sim["api"]
    assert res["out_is_out"] and res["out_err"] < 2e-5
    assert res["empty"] == [0, 9]
    assert "x must be (M, 32)" in res["bad_width"]
    assert "dy must be float32" in res["bad_dtype"]
    assert "out must be float32 (2, 9)" in res["bad_out"]


def test_simulator_parts_added_in_the_kernel_give_the_same_bits(sim):
    res = {key: sim[key] for key in sim if key.startswith("fold_bits/")}
    assert len(res) == len(FOLD_CASES)
    assert sum(r["folded"] for r in res.values()) >= len(res), "the kernels did not add their parts"
    assert all(r["same"] for r in res.values()), res


def test_simulator_gemv_backward_two_rows_of_w_at_a_time_give_the_same_bits(sim):
    assert len(sim["wrows_bits"]) == 3
    for case, res in sim["wrows_bits"].items():
        assert res["same"] and res["err"] < 2e-5, (case, res)


def test_simulator_weight_args_follow_buffers(sim):
    res = sim["weight_args"]
    assert res["kept"] and res["remade"], res
    assert res["before"] < 2e-5 and res["after"] < 2e-5, res


def test_simulator_gemv_every_row_bound(sim):
    assert len(sim["gemv_rows"]) == 6
    for case, res in sim["gemv_rows"].items():
        assert res["fwd"] < 2e-5 and res["bwd"] < 2e-5, (case, res)


def test_simulator_gemv_with_the_gpus_threads(sim):
    assert len(sim["gemv_gpu_threads"]) == 3
    for case, res in sim["gemv_gpu_threads"].items():
        assert res["fwd"] < 2e-5 and res["bwd"] < 2e-5, (case, res)


if __name__ == "__main__":
    _simulator_main(sys.argv[1])

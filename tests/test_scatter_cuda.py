"""The GPU's scatter-add (kernels/cuda/scatter.py) in Numba's CUDA simulator (a subprocess),
against numpy's add.at bit for bit: rows repeated and out of order, negative rows, one-column
and ragged widths, an embedding's 2-D ids, advanced and boolean indices, and out-of-range rows
refused."""
import json

import numpy as np
import pytest
from cudasim_run import simulator_results

# (rows of out, width, indices): repeats in any order, a negative index, a width that is not a
# multiple of the 256 threads of a block, one column, and no indices at all
ROW_CASES = {
    "repeats": (7, 5, [3, 0, 3, 6, 3, 0, 1]),
    "negative": (6, 33, [-1, 5, 2, -6, 0, 2]),
    "ragged_width": (4, 300, [1, 1, 3, 1]),
    "one_column": (9, 1, [8, 0, 8, 8, 4, 0, 2, 2, 2, 2]),
    "all_the_same": (3, 17, [2] * 40),
    "none": (5, 4, []),
}


def _sim_rows(scatter, rng):
    out = {}
    for name, (size, width, idx) in ROW_CASES.items():
        idx = np.array(idx, dtype=np.int64)
        g = (rng.standard_normal((idx.size, width)) * 10.0 ** rng.integers(-3, 4, (idx.size, 1))
             ).astype(np.float32)
        base = rng.standard_normal((size, width)).astype(np.float32)  # not zero: adds onto it
        want, got = base.copy(), base.copy()
        np.add.at(want, idx, g)
        scatter.scatter_add(np, got, idx, g)
        out[name] = bool(np.array_equal(got.view(np.uint32), want.view(np.uint32)))
    return out


def _sim_at(scatter, rng):
    a = np.zeros((4, 5, 6), np.float32)
    index = (np.array([[1, 3], [1, 1]]), slice(None), np.array([[0, 5], [0, 0]]))
    g = rng.standard_normal(a[index].shape).astype(np.float32)           # (2, 2, 5)
    want, got = a.copy(), a.copy()
    np.add.at(want, index, g)
    scatter.scatter_add(np, got, index, g)
    mask = rng.random(30) < 0.5                                          # a boolean index
    v, w = np.zeros(30, np.float32), np.zeros(30, np.float32)
    gm = rng.standard_normal(int(mask.sum())).astype(np.float32)
    np.add.at(v, mask, gm)
    scatter.scatter_add(np, w, mask, gm)
    e = np.zeros((6, 4), np.float32)                                     # an embedding's (V, D)
    ids = np.array([[5, 0, 5], [2, 5, 0]])                               # (B, T)
    ge = rng.standard_normal((2, 3, 4)).astype(np.float32)               # (B, T, D)
    want_e, got_e = e.copy(), e.copy()
    np.add.at(want_e, ids, ge)
    scatter.scatter_add(np, got_e, ids, ge)
    return {"advanced": bool(np.array_equal(got, want)), "mask": bool(np.array_equal(v, w)),
            "ids_2d": bool(np.array_equal(got_e.view(np.uint32), want_e.view(np.uint32)))}


def _sim_refused(scatter):
    try:
        scatter.scatter_add(np, np.zeros((3, 2), np.float32), np.array([0, 3]),
                            np.ones((2, 2), np.float32))
    except IndexError as exc:
        return str(exc)
    return "no error"


def _simulator_main():
    from numba import config
    from packlora.kernels.cuda import scatter
    assert config.ENABLE_CUDASIM, "run with NUMBA_ENABLE_CUDASIM=1"
    rng = np.random.default_rng(0)
    print(json.dumps({"rows": _sim_rows(scatter, rng), "at": _sim_at(scatter, rng),
                      "refused": _sim_refused(scatter)}))


@pytest.fixture(scope="module")
def sim():
    return simulator_results(__file__, timeout=300)


@pytest.mark.parametrize("case", sorted(ROW_CASES))
def test_simulator_scatter_rows_add_as_numpy_does(sim, case):
    assert sim["rows"][case], f"{case}: not the bits of numpy's add.at"


def test_simulator_scatter_at_advanced_and_boolean_indices(sim):
    assert sim["at"] == {"advanced": True, "mask": True, "ids_2d": True}


def test_simulator_scatter_refuses_rows_past_the_output(sim):
    assert "out of range [-3, 3)" in sim["refused"]


if __name__ == "__main__":
    _simulator_main()

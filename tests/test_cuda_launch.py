"""The launches the CUDA kernels plan, checked without a GPU and without launching: grids
within CUDA's limits, the split reductions' parts within the scratch cap, decode runs that share
a scale group. The kernels themselves: test_kernels_cuda.py (simulator) and
test_kernels_cuda_gpu.py (GPU)."""
import numpy as np
import pytest
from packlora.errors import DeviceError
from packlora.kernels.cuda import launch, ops, rows
from packlora.kernels.cuda.decode import grouped
from packlora.quant import PackedWeight


def test_runs_share_a_scale_group_only_where_they_fit():
    assert grouped(8, 256, 512) and grouped(4, 32, 4096) and grouped(16, 64, 128)
    assert not grouped(32, 256, 512)  # longer than the 16-value groups of Q2_K, Q3_K, Q6_K
    assert not grouped(8, 36, 4096)   # a flat block size the run does not divide
    assert not grouped(8, 64, 100)    # rows the run does not divide


def _grids(monkeypatch):
    """The grids the GPU launchers ask for (production tiles and threads), nothing launched:
    each passes launch.check_grid, as every launch does."""
    grids = []

    def record(build, grid, block, args, w, result=1):
        launch.check_grid(grid)
        grids.append(grid)
    monkeypatch.setattr(ops, "launch", record)
    monkeypatch.setattr(rows, "launch", record)
    monkeypatch.setattr(ops, "_add_parts", lambda parts, c: None)  # nothing launched to add
    return grids


@pytest.mark.parametrize("n,k", [(128256, 4096), (4096, 11008)])
@pytest.mark.parametrize("m", [1, 4, 16, 300])
def test_gpu_launch_grids_stay_within_cudas_limits(monkeypatch, n, k, m):
    grids = _grids(monkeypatch)
    w = PackedWeight.from_gguf("Q4_0", (n, k), np.zeros((n, k // 32 * 18), np.uint8))  # untouched
    ops.linear_fwd(np.zeros((m, k), np.float32), w)
    ops.linear_bwd(np.zeros((m, n), np.float32), w)
    assert len(grids) == 2


@pytest.mark.parametrize("n,k", [(128256, 4096), (4096, 11008)])
@pytest.mark.parametrize("m", [1, 4, 16])
def test_gpu_split_reductions_take_a_few_mib(n, k, m):
    """The partial sums of the small-M products whose reduction is split across blocks: at
    most 8 MiB at a 7B's and a large vocabulary's shapes (a GPU Device's scratch: 64 MiB)."""
    for bwd in (False, True):
        assert 4 * ops.parts_elems(m, n, k, 32, bwd) <= 8 << 20, (bwd, m, n, k)
    assert ops.parts_elems(m, n, k, 32, True) > 0  # the backward splits at these shapes


@pytest.mark.parametrize("n,k", [(700, 1024), (128256, 4096), (4096, 11008)])
@pytest.mark.parametrize("m", [1, 4, 16])
def test_gpu_split_reductions_keep_to_the_scratch_cap(monkeypatch, n, k, m):
    """A Device's scratch cap (scratch_mib) bounds the parts too: a small cap splits the
    reduction fewer times, and the plan (parts_elems) asks what the launch takes."""
    _grids(monkeypatch)
    monkeypatch.setattr(ops, "is_cupy", lambda a: True)  # the parts go to the scratch, as on a GPU
    cap, asked = (1 << 20) // 4, []
    def scratch(nelem):
        asked.append(nelem)
        return np.empty(nelem, np.float32)
    w = PackedWeight.from_gguf("Q4_0", (n, k), np.zeros((n, k // 32 * 18), np.uint8))  # untouched
    ops.linear_fwd(np.zeros((m, k), np.float32), w, scratch=scratch, cap_elems=cap)
    ops.linear_bwd(np.zeros((m, n), np.float32), w, scratch=scratch, cap_elems=cap)
    planned = [ops.parts_elems(m, n, k, 32, bwd, cap) for bwd in (False, True)]
    assert asked == [e for e in planned if e]
    assert max(asked, default=0) <= cap
    if cap // (m * k) >= 2:  # room for two parts of dx: the backward still splits
        assert planned[1] > 0


def test_gpu_embedding_lookup_of_many_tokens_fits_the_grid(monkeypatch):
    """A batch of 16 x 4,096 tokens looks up 65,536 rows: more than a grid's y allows."""
    grids = _grids(monkeypatch)
    w = PackedWeight.from_gguf("Q8_0", (50, 256), np.zeros((50, 8 * 34), np.uint8))
    ids = np.arange(16 * 4096, dtype=np.int64) % 50
    rows.gather_rows(w, ids, np.empty((ids.size, 256), np.float32))
    assert grids == [(16 * 4096, 1)]


def test_a_grid_past_cudas_limits_is_refused():
    launch.check_grid((2**31 - 1, 65535, 65535))
    for grid in [(1, 65536), (1, 1, 70000), (2**31,)]:
        with pytest.raises(DeviceError, match="CUDA allows at most"):
            launch.launch(None, grid, 32, [None, None], None)

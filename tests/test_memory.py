"""The memory tracker counts known allocations exactly and agrees with tracemalloc."""
import gc
import tracemalloc

import numpy as np
import packlora as pl
import pytest


def test_known_sizes_by_category():
    dev = pl.Device.cpu()
    mem = dev.memory
    gc.collect()
    base_act, base_grads = mem.current["activations"], mem.current["grads"]
    mem.reset_peak()
    with mem.category("activations"):
        a = pl.zeros((1000, 250), dev)  # 1,000,000 bytes
        v = a.data[10:20]  # a view is not counted again
        mem.track(v)
    with mem.category("grads"):
        g = pl.zeros((500,), dev, dtype=np.float64)  # 4,000 bytes
    assert mem.current["activations"] - base_act == 1_000_000
    assert mem.current["grads"] - base_grads == 4_000
    del a, v
    gc.collect()
    assert mem.current["activations"] == base_act
    assert mem.peak["activations"] - base_act == 1_000_000
    del g
    snap = mem.snapshot()
    assert set(snap["categories"]) >= {"base_packed", "dense_scratch", "activations", "kv_cache"}
    with pytest.raises(ValueError, match="unknown memory category"):
        with mem.category("nope"):
            pass


def test_independent_measure_agrees():
    dev = pl.Device.cpu()
    mem = dev.memory
    was = tracemalloc.is_tracing()
    mem.start_process_measure()  # tracemalloc: this test's to stop
    try:
        gc.collect()
        mem.reset_peak()
        t0, p0 = mem.total, mem.process_measure()[0]
        with mem.category("workspace"):
            xs = [pl.zeros((1 << 18,), dev) for _ in range(8)]  # 8 MiB
        tracked = mem.total_peak - t0
        proc = mem.process_measure()[1] - p0
        del xs
    finally:
        mem.stop_process_measure()
        if not was:
            tracemalloc.stop()
    assert tracked == 8 << 20
    assert abs(proc - tracked) / tracked < 0.05, (proc, tracked)

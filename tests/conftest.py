"""packlora is imported before the test modules import numpy: its thread settings reach OpenBLAS
as they do for the CLI and the benchmarks (src/_env.py). Each test leaves tracemalloc as it
found it: left tracing, it slows every allocation of every later test (a GGUF header read took
5x as long)."""
import tracemalloc

import packlora  # noqa: F401
import pytest


@pytest.fixture(autouse=True)
def _tracemalloc_left_as_found():
    was = tracemalloc.is_tracing()
    yield
    if tracemalloc.is_tracing() and not was:
        tracemalloc.stop()
        pytest.fail("the test left tracemalloc tracing (stop what it starts)")

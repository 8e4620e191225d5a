"""packlora is imported before the test modules import numpy: its thread settings reach OpenBLAS
as they do for the CLI and the benchmarks (src/_env.py)."""
import packlora  # noqa: F401

"""packlora.memory: the memory plan from a config alone, measured runs, and the report.

The tracker itself is `packlora.tracker` (it sits below the device, which owns one); it is
re-exported here so users find every memory name in one place.
"""
from ..tracker import CATEGORIES, MemoryTracker
from .measurement import measure
from .planner import plan

__all__ = ["CATEGORIES", "MemoryTracker", "measure", "plan"]

"""Moved to :mod:`harness.record.memory`; this name stays importable for existing code (see README, Layout)."""
from harness.record.memory import measure_memory  # noqa: F401

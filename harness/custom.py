"""Moved to :mod:`harness.record.custom`; this name stays importable for existing code (see README, Layout)."""
from harness.record.custom import CustomRun  # noqa: F401

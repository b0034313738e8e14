"""Moved to :mod:`harness.targets.drive`; this name stays importable for existing code (see README, Layout)."""
from harness.targets.drive import diagnose_target  # noqa: F401

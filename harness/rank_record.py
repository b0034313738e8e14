"""Moved to :mod:`harness.parallel_dims`; this name stays importable for existing code (see README, Layout)."""
from harness.parallel_dims import RankLayout  # noqa: F401

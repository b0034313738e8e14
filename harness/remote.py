"""Moved to :mod:`harness.launch.remote`; this name stays importable for existing code (see README, Layout)."""
from harness.launch.remote import RankRunner, RanksFailed, RanksHung  # noqa: F401

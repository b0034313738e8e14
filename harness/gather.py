"""Moved to :mod:`harness.record.gather`; this name stays importable for existing code (see README, Layout)."""
from harness.record.gather import annotate_shard, gather_state, rename_parameters  # noqa: F401

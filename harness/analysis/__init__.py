"""Comparing a run with the reference and naming the cause: comparison, tolerances, the diagnosis engine."""

"""The run settings: one default each, read by every front end (the pytest plugin, ``python -m
harness``, the search, :class:`~harness.launch.remote.RankRunner`, the rank pool). Torch-free.

A run's deadline is a backstop, not how hangs are found: a run whose running ranks all make no
progress for the stall window is named hung then (``--dist-stall-window`` / ``--stall-window`` /
a target's STALL_WINDOW). The deadline only caps a run that keeps computing; it covers the
reference's training and the calibration replays of a diagnosis as well as a test body, so one
value serves both.
"""

from __future__ import annotations

__all__ = [
    "BACKENDS",
    "COMPARISON_MODES",
    "DEVICES",
    "FAILURE_GRACE_S",
    "RUN_TIMEOUT_S",
    "STALL_WINDOW_S",
    "START_METHODS",
    "STARTUP_TIMEOUT_S",
    "TOLERANCE_MODES",
]

# Seconds a run (a test body, a diagnosis, a search example) may take before it is stopped and
# reported with every rank's stack and collectives.
RUN_TIMEOUT_S = 300.0
# Seconds for ranks to start and join their process group. Generous: on a loaded 2-core CI
# machine, forking 4 ranks that import torch has taken over 40 s.
STARTUP_TIMEOUT_S = 90.0
# Seconds in which no running rank uses CPU before the run counts as hung (0: deadline only).
STALL_WINDOW_S = 10.0
# Seconds the other ranks get to finish once one rank has failed, before they are reported as
# aborted and killed.
FAILURE_GRACE_S = 3.0

# "auto": nccl on CUDA, gloo on CPU; one GPU per rank when CUDA has at least N GPUs, else CPU.
BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")
# forkserver: ranks forked from one process that imported torch once; spawn: fresh interpreters.
START_METHODS = ("forkserver", "spawn")
# "auto": calibrated from the reference's own noise; "default": fixed per-dtype tolerances.
TOLERANCE_MODES = ("auto", "default", "calibrated")
# "stepwise": every step checked from the parallel run's own state (reference.replay), the
# default; "trajectory": the whole parallel trajectory against the reference's.
COMPARISON_MODES = ("stepwise", "trajectory")

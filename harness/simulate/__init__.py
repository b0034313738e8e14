"""Simulated ranks: N ranks of a DTensor strategy in one process (:mod:`harness.simulate.run`),
and the layout check of any (dp, tp, pp) mesh (:mod:`harness.simulate.layout`). A simulated
run is diagnosed by :func:`harness.pipeline.diagnose_simulated`, like any other."""

from harness.simulate.run import SimulatedRanks, simulate_strategy
from harness.simulate.world import SimulatedWorld, SimulationError

__all__ = ["SimulatedRanks", "SimulatedWorld", "SimulationError", "simulate_strategy"]

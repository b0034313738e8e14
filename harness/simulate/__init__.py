"""Simulated ranks: N ranks of a DTensor strategy in one process (:mod:`harness.simulate.run`),
and the layout check of any (dp, tp, pp) mesh (:mod:`harness.simulate.layout`)."""

from harness.simulate.run import SimulatedRanks, diagnose_simulated, simulate_strategy, simulate_target
from harness.simulate.world import SimulatedWorld, SimulationError

__all__ = ["SimulatedRanks", "SimulatedWorld", "SimulationError", "diagnose_simulated", "simulate_strategy", "simulate_target"]

"""Search parallel configurations with Hypothesis, so bugs that appear only in some of them are
found and shrunk to the smallest configuration that shows them.

Many parallel bugs need a particular configuration: a dataset size that does not divide the
replicas (``DistributedSampler`` pads by repeating samples), one micro-batch, a batch of one
per replica, more pipeline stages than micro-batches. A fixed grid misses them; this module
generates *valid* configurations for a strategy from what the strategy declares it needs,
runs each one on the warm rank pool and compares it with the single-device reference::

    from harness.search import assert_matches_reference_for_all

    def test_ddp_matches_for_all_configs(rank_runner, reference_cache):
        assert_matches_reference_for_all("ddp", rank_runner, max_world=2, max_examples=8, cache=reference_cache)

Pieces:

* :class:`ParallelConfig`: world size and named mesh dims (``pp, dp, tp``), global batch,
  micro-batches, dataset size, steps, the tiny transformer's sizes, dtype, optimizer and the
  strategy's own options. :func:`validate` names every constraint a config fails
  ("tp-divides-dim: hidden size 30 is not divisible by tp=4"); :func:`case_for` is the case
  it trains.
* :class:`StrategySpec` and the registry (:func:`register_strategy`, :func:`get_spec`): which
  mesh dims a strategy uses and what it needs (tp divides heads / hidden size / MLP width,
  pp divides the layers, at least pp micro-batches, ...).
* Hypothesis strategies :func:`parallel_configs` (valid configs, built to satisfy the
  constraints rather than filtered, so they shrink well) and :func:`invalid_configs` (configs
  that break one named constraint, for testing error messages).
* :func:`check_config` / :func:`assert_config_matches` (one example: one ``RankRunner.run``
  call on the warm pool), :func:`assert_matches_reference_for_all` (the one-line property) and
  :func:`given_configs` (a ``@given`` with the harness's settings for custom checks). A
  mismatch raises :class:`ConfigMismatch` whose message shows the config and its diagnosis
  codes (a crash or hang: :class:`ConfigCrashed`); Hypothesis shrinks to the smallest failing
  config, and its database and ``--hypothesis-seed`` work as usual.

Hypothesis runs in the calling (pytest) process, which only generates configs and reads the
results; cases, strategies and the reference are built on the ranks.

The package, one job per module (everything public is re-exported here, so
``from harness.search import X`` works for all of it):

* :mod:`harness.search.config`: :class:`ParallelConfig` (values only), :class:`Violation` /
  :class:`InvalidConfigError`;
* :mod:`harness.search.constraints`: :class:`Constraint`, the built-in constraints and
  :func:`constraints_for`;
* :mod:`harness.search.registry`: :class:`StrategySpec`, the registry of strategies and
  optimizer names, :func:`validate` / :func:`violations`;
* :mod:`harness.search.builtins`: the bundled strategies (their ``build_*`` factories) and
  optimizers registered, :func:`case_for` (the one module here that names ``cases``);
* :mod:`harness.search.generate`: the Hypothesis strategies :func:`parallel_configs` and
  :func:`invalid_configs`;
* :mod:`harness.search.property`: examples on the warm pool (:func:`run_example`,
  :func:`check_config`, :func:`warm_up`, ...) and the property itself
  (:func:`assert_matches_reference_for_all`, :func:`given_configs`).
"""

from __future__ import annotations

from harness.search import builtins as builtins  # registers the bundled strategies and optimizers
from harness.search.builtins import build_ddp as build_ddp
from harness.search.builtins import build_ddp_tp as build_ddp_tp
from harness.search.builtins import build_fsdp as build_fsdp
from harness.search.builtins import build_fsdp_tp as build_fsdp_tp
from harness.search.builtins import build_pipeline as build_pipeline
from harness.search.builtins import build_tp as build_tp
from harness.search.builtins import case_for
from harness.search.config import DTYPES, InvalidConfigError, ParallelConfig, Violation
from harness.search.config import INT_FIELDS as INT_FIELDS
from harness.search.config import MAX_SEQ_LEN as MAX_SEQ_LEN
from harness.search.constraints import COMMON_CONSTRAINTS as COMMON_CONSTRAINTS
from harness.search.constraints import MICRO_CONSTRAINT as MICRO_CONSTRAINT
from harness.search.constraints import PP_CONSTRAINTS as PP_CONSTRAINTS
from harness.search.constraints import TP_CONSTRAINTS as TP_CONSTRAINTS
from harness.search.constraints import CheckFn as CheckFn
from harness.search.constraints import Constraint, constraints_for
from harness.search.constraints import ViolateFn as ViolateFn
from harness.search.constraints import check as check
from harness.search.constraints import covers_stages as covers_stages
from harness.search.generate import InvalidConfig, invalid_configs, parallel_configs
from harness.search.property import (
    EXAMPLE_DEADLINE,
    ConfigCrashed,
    ConfigFailure,
    ConfigMismatch,
    ExampleOutcome,
    SearchReport,
    assert_config_matches,
    assert_matches_reference_for_all,
    check_config,
    example_deadline,
    given_configs,
    search_settings,
    smallest_config,
    warm_up,
)
from harness.search.property import RANK_TIMEOUT_S as RANK_TIMEOUT_S
from harness.search.property import noop as noop
from harness.search.property import run_example as run_example
from harness.search.registry import (
    StrategySpec,
    available_strategies,
    get_spec,
    optimizer_names,
    register_optimizers,
    register_strategy,
    validate,
    violations,
)

# The documented API (``from harness.search import *``); the constraint tables, MAX_SEQ_LEN,
# RANK_TIMEOUT_S, the build_* factories and run_example / noop are importable from here too.
__all__ = [
    "DTYPES",
    "EXAMPLE_DEADLINE",
    "ConfigCrashed",
    "ConfigFailure",
    "ConfigMismatch",
    "Constraint",
    "ExampleOutcome",
    "InvalidConfig",
    "InvalidConfigError",
    "ParallelConfig",
    "SearchReport",
    "StrategySpec",
    "Violation",
    "assert_config_matches",
    "assert_matches_reference_for_all",
    "available_strategies",
    "case_for",
    "check_config",
    "constraints_for",
    "example_deadline",
    "get_spec",
    "given_configs",
    "optimizer_names",
    "invalid_configs",
    "parallel_configs",
    "register_optimizers",
    "register_strategy",
    "search_settings",
    "smallest_config",
    "validate",
    "violations",
    "warm_up",
]

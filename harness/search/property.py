"""The property "for every config the strategy matches the reference", run on the warm rank
pool: :func:`run_example` (what each rank runs), :func:`check_config` /
:func:`assert_config_matches` (one example, one ``RankRunner.run`` call),
:func:`warm_up`, :func:`search_settings`, :func:`assert_matches_reference_for_all` (the
one-line property, returning a :class:`SearchReport`) and :func:`given_configs`. A mismatch
raises :class:`ConfigMismatch`, a crash or hang :class:`ConfigCrashed`.

Hypothesis runs in the calling (pytest) process, which only generates configs and reads the
results; cases, strategies and the reference are built on the ranks (:func:`run_example` and
:func:`noop` are sent there by module path, ``harness.search.property``)."""

from __future__ import annotations

import hashlib
import inspect
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from hypothesis import HealthCheck, Phase, event, given, note, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.strategies import SearchStrategy

from harness.parallel_dims import ParallelConfigError
from harness.settings import RUN_TIMEOUT_S
from harness.search.builtins import case_for
from harness.search.config import ParallelConfig
from harness.search.constraints import covers_stages
from harness.search.generate import _factorizations, _worlds, parallel_configs
from harness.search.registry import StrategySpec, get_spec, validate

if TYPE_CHECKING:  # pragma: no cover - typing only
    from harness.codes import Diagnosis
    from harness.launch.remote import RankRunner
    from harness.run import RunResult
    from harness.strategy import DistContextLike, Strategy

__all__ = [
    "EXAMPLE_DEADLINE",
    "RANK_TIMEOUT_S",
    "ConfigCrashed",
    "ConfigFailure",
    "ConfigMismatch",
    "ExampleOutcome",
    "SearchReport",
    "assert_config_matches",
    "assert_matches_reference_for_all",
    "check_config",
    "example_deadline",
    "given_configs",
    "noop",
    "run_example",
    "search_settings",
    "smallest_config",
    "warm_up",
]

# Measured on 2 CPU cores with warm pools: 0.2-1.3 s per example of the smallest models in
# float64, 1-5 s for generated float32/bf16 configs with calibrated tolerances (up to ~12 s for
# 4 ranks on 2 cores). The deadline leaves room for that on a loaded CI machine while still
# flagging a pathologically slow config. A rank that hangs is stopped by the RankRunner
# timeout, which is longer, with every rank's stack and last collectives in the report.
EXAMPLE_DEADLINE = timedelta(seconds=30)
RANK_TIMEOUT_S = RUN_TIMEOUT_S  # the run settings' deadline, also importable from harness.search


def example_deadline(max_world: int) -> timedelta:
    """:data:`EXAMPLE_DEADLINE`, stretched when the ranks outnumber the CPU cores (4 ranks on 2
    cores: a 4-stage pipeline example measured up to 24 s there)."""
    cores = os.cpu_count() or 1
    return EXAMPLE_DEADLINE * max(1, -(-max_world // cores))


# -- running examples on the warm pool ---------------------------------------------------------


def run_example(
    ctx: DistContextLike,
    factory: Callable[[ParallelConfig], Strategy],
    config: ParallelConfig,
    cache: str | None = None,
    workdir: str | None = None,
    tolerance: Any = "auto",
) -> RunResult | None:
    """On each rank: build the case and the strategy from ``config`` and run it against the
    reference. Returns the :class:`RunResult` on rank 0 (None elsewhere)."""
    from harness.run import run_strategy

    if ctx.world_size != config.world_size:
        raise ParallelConfigError(f"config needs {config.world_size} ranks ({config.describe()}), running on {ctx.world_size}")
    strategy = factory(config)
    result = run_strategy(case_for(config), strategy, ctx, workdir=workdir, cache=cache, tolerance=tolerance)
    return result if ctx.rank == 0 else None


def noop(ctx: DistContextLike) -> int:
    """Used by :func:`warm_up` to start a pool."""
    return ctx.world_size


@dataclass
class ExampleOutcome:
    """One config's run: the comparison, its diagnosis and how long the example took."""

    config: ParallelConfig
    result: RunResult
    diagnoses: list[Diagnosis]
    diagnose_note: str
    seconds: float

    @property
    def passed(self) -> bool:
        return self.result.passed

    @property
    def codes(self) -> list[str]:
        return [d.code for d in self.diagnoses]

    def report(self) -> str:
        """The config, its diagnosis codes (or the first divergence) and the comparison."""
        verdict = "matches the reference" if self.passed else "does NOT match the reference"
        lines = [f"{self.config.strategy} {verdict} for", f"  config: {self.config.describe()}", f"  {self.config!r}"]
        if not self.passed:
            if self.diagnoses:
                lines.append("  diagnosis: " + ", ".join(self.codes))
                lines += [f"    {d.code}: {d.summary}" for d in self.diagnoses]
            else:
                div = self.result.comparison.first_divergence
                lines.append(f"  diagnosis: none ({self.diagnose_note})")
                if div is not None:
                    lines.append(f"  {div.line()}")
        lines += ["  " + line for line in self.result.summary().splitlines()]
        return "\n".join(lines)


class ConfigFailure(AssertionError):
    """A generated (or given) config on which the strategy failed; ``config`` is the config and
    ``search_report`` (set by :func:`assert_matches_reference_for_all`) what the search ran."""

    config: ParallelConfig
    search_report: SearchReport | None = None


class ConfigMismatch(ConfigFailure):
    """A strategy did not match the reference for ``config``; the message is the full report
    (config, diagnosis codes, comparison)."""

    def __init__(self, outcome: ExampleOutcome):
        super().__init__(outcome.report())
        self.outcome = outcome
        self.config = outcome.config
        self.codes = outcome.codes


class ConfigCrashed(ConfigFailure):
    """A rank raised, died or hung on ``config``; the message is the config and the launcher's
    per-rank report (the failing rank's traceback, or every rank's stack on a hang)."""

    def __init__(self, config: ParallelConfig, report: str, *, hung: bool):
        what = "hung (timed out)" if hung else "crashed"
        super().__init__(f"{config.strategy} {what} for\n  config: {config.describe()}\n  {config!r}\n{report}")
        self.config = config
        self.report = report
        self.hung = hung
        self.codes: list[str] = []


def _diagnose(result: RunResult) -> tuple[list[Diagnosis], str]:
    """The diagnosis engine's codes for ``result``, or none with the reason when the engine
    fails (the report then shows the first divergence)."""
    from harness.analysis.diagnose import diagnose_result

    try:
        return list(diagnose_result(result)), "diagnosed"
    except Exception as exc:  # noqa: BLE001 - a broken engine must not hide the mismatch
        return [], f"the diagnosis engine failed: {type(exc).__name__}: {exc}"


def _factory_of(strategy: str | StrategySpec) -> tuple[StrategySpec, Callable[[ParallelConfig], Strategy]]:
    spec = get_spec(strategy)
    return spec, spec.factory


def check_config(
    runner: RankRunner,
    strategy: str | StrategySpec,
    config: ParallelConfig,
    *,
    cache: str | os.PathLike[str] | None = None,
    workdir: str | os.PathLike[str] | None = None,
    tolerance: Any = "calibrated",
    timeout: float = RANK_TIMEOUT_S,
    max_world: int | None = None,
) -> ExampleOutcome:
    """Validate ``config`` for ``strategy`` (clear error naming the failing constraint), run it
    on ``config.world_size`` warm ranks and diagnose the comparison. One ``runner.run`` call.
    ``tolerance`` as :func:`harness.run.run_strategy`; calibrated by default, see
    :func:`assert_matches_reference_for_all`. Raises ``RanksFailed`` / ``RanksHung`` when a rank
    fails, dies or hangs."""
    spec, factory = _factory_of(strategy)
    if config.strategy != spec.name:
        config = config.replace(strategy=spec.name)
    validate(config, spec, max_world=max_world)
    own_workdir = workdir is None  # a passing example's records are removed, a failing one's kept
    workdir = tempfile.mkdtemp(prefix=f"harness-search-{spec.name}-") if own_workdir else workdir
    start = time.perf_counter()
    values = runner.run(
        run_example,
        nproc=config.world_size,
        kwargs={
            "factory": factory, "config": config, "cache": None if cache is None else str(cache),
            "workdir": str(workdir), "tolerance": tolerance,
        },
        timeout=timeout,
    ).values
    seconds = time.perf_counter() - start
    result = values[0]
    diagnoses, why = _diagnose(result) if not result.passed else ([], "passed")
    if own_workdir and result.passed:
        shutil.rmtree(workdir, ignore_errors=True)
    return ExampleOutcome(config, result, diagnoses, why, seconds)


def assert_config_matches(
    runner: RankRunner,
    strategy: str | StrategySpec,
    config: ParallelConfig,
    **kwargs: Any,
) -> ExampleOutcome:
    """:func:`check_config`, raising :class:`ConfigMismatch` (config + diagnosis codes) on a mismatch."""
    outcome = check_config(runner, strategy, config, **kwargs)
    if not outcome.passed:
        raise ConfigMismatch(outcome)
    return outcome


def smallest_config(strategy: str | StrategySpec, world_size: int) -> ParallelConfig:
    """The simplest valid config of ``strategy`` on ``world_size`` ranks (what shrinking heads for)."""
    spec = get_spec(strategy)
    choices = _factorizations(world_size, spec)
    if not choices:
        raise ValueError(f"{spec.name!r} cannot run on {world_size} ranks (dims {', '.join(spec.dims)}, minimum degrees {dict(spec.min_degree) or 'none'})")
    g = choices[0]
    dp, tp, pp = (g.get(d, 1) for d in ("dp", "tp", "pp"))
    options = tuple((k, v[0]) for k, v in sorted(spec.options.items()))
    micro = pp if covers_stages(spec, options) else 1
    batch = dp * micro
    return ParallelConfig(
        strategy=spec.name, dp=dp, tp=tp, pp=pp, global_batch_size=batch, micro_batches=micro, num_samples=batch,
        steps=1, seq_len=1, dim=tp * -(-4 // tp), heads=tp, hidden=tp, layers=pp, dtype=spec.dtypes[0],
        optimizer=spec.allowed_optimizers[0], options=options,
    )


def warm_up(
    runner: RankRunner,
    strategy: str | StrategySpec,
    worlds: Iterable[int],
    *,
    cache: str | os.PathLike[str] | None = None,
    timeout: float = RANK_TIMEOUT_S,
) -> dict[int, float]:
    """Start the warm pool of every world size and run the strategy's smallest config there
    once, so pool start-up and first-use imports (DDP pulls in torch._dynamo: seconds per
    rank) never count against an example's deadline. A smallest config that fails or
    mismatches is left for the search to find. Returns seconds per world size."""
    from harness.launch.remote import RanksFailed

    spec = get_spec(strategy)
    took = {}
    for world in sorted(set(worlds)):
        start = time.perf_counter()
        runner.run(noop, nproc=world, timeout=timeout)
        try:
            runner.run(
                run_example, nproc=world, timeout=timeout,
                kwargs={"factory": spec.factory, "config": smallest_config(spec, world),
                        "cache": None if cache is None else str(cache), "tolerance": "default"},
            )
        except RanksFailed:
            pass
        took[world] = time.perf_counter() - start
    return took


def search_settings(**overrides: Any) -> settings:
    """Hypothesis settings for multi-rank examples: the profile's values (database, seed,
    verbosity) with a per-example deadline that fits a warm multi-rank run
    (:data:`EXAMPLE_DEADLINE`), a small default ``max_examples`` and the too-slow health check
    off (each example is a real multi-rank training), and no explain phase (it reruns variants of
    the shrunk example to say which fields vary freely: many more multi-rank runs). ``overrides`` win."""
    base = {
        "deadline": EXAMPLE_DEADLINE,
        "max_examples": 10,
        "suppress_health_check": [HealthCheck.too_slow],
        # the explain phase reruns many variants of the shrunk example: minutes of ranks
        "phases": tuple(p for p in Phase if p is not Phase.explain),
    }
    base.update(overrides)
    return settings(**base)


@dataclass
class SearchReport:
    """What a passing search ran: how many examples, per world size, and the time per example."""

    strategy: str
    examples: int = 0
    seconds: list[float] = field(default_factory=list)
    worlds: dict[int, int] = field(default_factory=dict)
    warm_up_s: dict[int, float] = field(default_factory=dict)
    configs: list[ParallelConfig] = field(default_factory=list)

    @property
    def mean_seconds(self) -> float:
        return sum(self.seconds) / len(self.seconds) if self.seconds else 0.0

    def summary(self) -> str:
        per_world = ", ".join(f"world {w}: {n}" for w, n in sorted(self.worlds.items()))
        return (
            f"{self.strategy}: {self.examples} examples ({per_world}), "
            f"{self.mean_seconds * 1000:.0f} ms per example on the warm pool "
            f"(min {min(self.seconds, default=0) * 1000:.0f}, max {max(self.seconds, default=0) * 1000:.0f})"
        )


def _database_digest(key: str, spec: StrategySpec, config_kwargs: Mapping[str, Any]) -> bytes:
    text = repr((key, spec.name, getattr(spec.factory, "__module__", ""), getattr(spec.factory, "__qualname__", ""),
                 sorted((k, repr(v)) for k, v in config_kwargs.items())))
    return hashlib.sha256(text.encode()).digest()


def assert_matches_reference_for_all(
    strategy: str | StrategySpec,
    runner: RankRunner,
    *,
    max_world: int,
    max_examples: int | None = None,
    cache: str | os.PathLike[str] | None = None,
    workdir: str | os.PathLike[str] | None = None,
    tolerance: Any = "calibrated",
    hypothesis_settings: Mapping[str, Any] | None = None,
    key: str | None = None,
    configs: SearchStrategy[ParallelConfig] | None = None,
    warm: bool = True,
    seed: int | None = None,
    **space: Any,
) -> SearchReport:
    """The one-line property: for every generated config, ``strategy`` matches the reference.

    Each Hypothesis example is one :func:`check_config` call on ``runner``'s warm pools
    (started beforehand by :func:`warm_up`, so start-up is outside the deadline). On a failure
    Hypothesis shrinks to the smallest failing config and raises :class:`ConfigMismatch` (a
    crash or hang: :class:`ConfigCrashed`) whose message is that config, its diagnosis codes
    (the first divergence if the engine names none) and the comparison; its ``search_report``
    says how many examples ran and how long each took.

    ``tolerance`` defaults to ``"calibrated"``: generated configs reach gradients that are sums
    of cancelling terms, where the fixed per-dtype float32 defaults flag the correct DDP and TP
    (the noise of another accumulation order is what calibration measures). ``space`` fixes
    fields as :func:`parallel_configs` does; ``configs`` replaces the generator.
    ``hypothesis_settings`` (keyword arguments of ``hypothesis.settings``: database,
    derandomize, phases, ...) go over :func:`search_settings` with :func:`example_deadline`.
    The database key is derived from ``key`` (default: the running pytest test's id), the
    strategy and the space, so a failure replays from Hypothesis's database on the next run;
    ``--hypothesis-seed`` applies as for any ``@given`` test, and ``seed`` fixes the search like
    ``@hypothesis.seed`` (which, like ``derandomize``, turns the database off). ``warm=False``
    skips :func:`warm_up`. Returns a :class:`SearchReport`."""
    from harness.launch.remote import RanksFailed, RanksHung

    spec = get_spec(strategy)
    space_kwargs = {k: v for k, v in space.items()}
    configs = configs if configs is not None else parallel_configs(spec, max_world=max_world, **space_kwargs)
    min_world = space_kwargs.get("min_world", 1)
    report = SearchReport(strategy=spec.name)
    worlds = [w for w in _worlds(spec, min_world, max_world, space_kwargs.get("min_degree"))
              if not isinstance(space_kwargs.get("world_size"), int) or w == space_kwargs["world_size"]]
    if warm:
        report.warm_up_s = warm_up(runner, spec, worlds, cache=cache)
    own_workdir = workdir is None
    base = tempfile.mkdtemp(prefix=f"harness-search-{spec.name}-") if own_workdir else str(workdir)

    def example(config: ParallelConfig) -> None:
        note(f"config: {config.describe()}")
        event(f"world {config.world_size} [{' x '.join(f'{n}={s}' for n, s in config.mesh.items())}]")
        event("dataset divides the replicas" if config.num_samples % config.dp == 0 else "dataset does not divide the replicas")
        report.examples += 1
        report.worlds[config.world_size] = report.worlds.get(config.world_size, 0) + 1
        report.configs.append(config)
        start = time.perf_counter()
        try:
            outcome = check_config(runner, spec, config, cache=cache, workdir=base, tolerance=tolerance, max_world=max_world)
        except RanksFailed as exc:
            report.seconds.append(time.perf_counter() - start)
            raise ConfigCrashed(config, exc.report, hung=isinstance(exc, RanksHung)) from None
        report.seconds.append(outcome.seconds)
        if not outcome.passed:
            raise ConfigMismatch(outcome)

    digest_key = key or os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0] or "harness.search"
    example._hypothesis_internal_add_digest = _database_digest(digest_key, spec, space_kwargs)  # type: ignore[attr-defined]
    example.__qualname__ = f"assert_matches_reference_for_all[{spec.name}]"
    overrides = {"deadline": example_deadline(max_world), **dict(hypothesis_settings or {})}
    if max_examples is not None:
        overrides["max_examples"] = max_examples
    test = search_settings(**overrides)(given(configs)(example))
    if seed is not None:  # @hypothesis.seed: a fixed search (Hypothesis then turns the database off)
        test = hypothesis_seed(seed)(test)
    try:
        test()
    except ConfigFailure as exc:
        exc.search_report = report  # records stay in the workdir: the report's paths point at them
        raise
    except Exception as group:  # an ExceptionGroup: several distinct failures (report_multiple_bugs)
        for exc in getattr(group, "exceptions", ()):
            if isinstance(exc, ConfigFailure):
                exc.search_report = report
        raise
    if own_workdir:
        shutil.rmtree(base, ignore_errors=True)
    return report


def given_configs(
    strategy: str | StrategySpec,
    *,
    max_world: int,
    argname: str = "config",
    hypothesis_settings: Mapping[str, Any] | None = None,
    **space: Any,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``@given(config=parallel_configs(...))`` with :func:`search_settings`, for a test that
    runs its own check per config (pytest fixtures such as ``rank_runner`` still arrive, and
    the test is an ordinary Hypothesis test: database, ``--hypothesis-seed``, statistics)::

        @given_configs("ddp", max_world=2, hypothesis_settings={"max_examples": 5})
        def test_custom(rank_runner, config):
            assert_config_matches(rank_runner, "ddp", config)

    Settings go in ``hypothesis_settings`` (Hypothesis refuses a second ``@settings``)."""
    configs = parallel_configs(strategy, max_world=max_world, **space)
    chosen = search_settings(**{"deadline": example_deadline(max_world), **dict(hypothesis_settings or {})})

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        if argname not in inspect.signature(fn).parameters:
            raise TypeError(f"given_configs: {fn.__qualname__} has no parameter {argname!r} to receive the config")
        return chosen(given(**{argname: configs})(fn))

    return decorate

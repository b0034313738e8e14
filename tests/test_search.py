"""Config search with Hypothesis (harness.search): valid and invalid configs, clear errors for
hand-written ones, and the property "for every config the strategy matches the reference" run
on the warm rank pool - passing for the correct strategies, and finding and shrinking a bug that
shows only when the dataset size does not divide the replicas."""

from __future__ import annotations

import pytest
from hypothesis import Phase, event, find, given, settings
from hypothesis import strategies as st
from hypothesis.database import InMemoryExampleDatabase

from cases.bugs import config_dependent_sampler as remainder
from cases.strategies.ddp import DDPStrategy
from harness import search
from harness.codes import CODES
from harness.parallel_dims import ParallelConfigError
from harness.search import (
    ConfigMismatch,
    InvalidConfigError,
    ParallelConfig,
    StrategySpec,
    assert_matches_reference_for_all,
    invalid_configs,
    parallel_configs,
)

# Requirements shaped like a dp x tp strategy and a dp x pp pipeline, for the generator and
# validation tests that run no ranks (so they do not depend on the TP / pipeline modules).
TP_SHAPED = StrategySpec("tp-shaped", search.build_ddp, dims=("dp", "tp"))
HYBRID_SHAPED = StrategySpec("hybrid-shaped", search.build_ddp, dims=("dp", "tp"), min_degree={"dp": 2, "tp": 2})
PP_SHAPED = StrategySpec("pp-shaped", search.build_ddp, dims=("pp", "dp"), min_degree={"pp": 2}, pp_layers="divisible")
SHAPES = [search.get_spec("ddp"), TP_SHAPED, HYBRID_SHAPED, PP_SHAPED]

BUGGY = search.get_spec("ddp").derive(remainder.RemainderDroppingSamplerDDP.name, remainder.make_strategy)
# The bug's search space: the model and numerics fixed small (float64: default tolerances are
# far above its noise), the data layout free: world size, micro-batches, batch, dataset.
BUG_SPACE = dict(
    dtype="float64", optimizer="sgd", heads=1, hidden=1, layers=1, seq_len=1,
    max_micro_batches=2, max_micro_batch_size=2, steps=1,
)


# What the first bf16 + AdamW search on the correct DDP found: at AdamW's first step each
# parameter moves by +-lr, and a gradient element within bf16 noise of 0 flipped sign in the
# 3-rank all-reduce, landing attn.o.weight[3, 2] 2 lr from the reference. harness.analysis.compare now
# accepts exactly that (adaptive_sign_noise); this config keeps it honest on real ranks.
BF16_ADAMW_SIGN_FLIP = ParallelConfig(
    strategy="ddp", dp=3, global_batch_size=18, micro_batches=2, num_samples=20, steps=1, seq_len=3,
    dim=4, heads=1, hidden=2, layers=1, dtype="bfloat16", optimizer="adamw",
)


SHRUNK = ParallelConfig(
    strategy=BUGGY.name, dp=2, global_batch_size=2, micro_batches=1, num_samples=3, steps=1,
    seq_len=1, dim=4, heads=1, hidden=1, layers=1, dtype="float64", optimizer="sgd",
)


# -- hand-written configs: clear errors ------------------------------------------------------


def test_a_hidden_size_that_tp_does_not_divide_is_named() -> None:
    config = ParallelConfig("tp-shaped", dp=1, tp=4, dim=30, heads=4, hidden=8, global_batch_size=2, num_samples=2)
    with pytest.raises(InvalidConfigError) as info:
        search.validate(config, TP_SHAPED)
    assert isinstance(info.value, ParallelConfigError)
    assert "hidden size 30 is not divisible by tp=4" in str(info.value)
    assert "tp-divides-dim" in info.value.constraints
    assert "strategy 'tp-shaped'" in str(info.value)


@pytest.mark.parametrize(
    "changes, constraint, message",
    [
        (dict(heads=6, dim=12, tp=4), "tp-divides-heads", "head count 6 is not divisible by tp=4"),
        (dict(hidden=30, tp=4, heads=4, dim=8), "tp-divides-hidden", "MLP width 30 is not divisible by tp=4"),
        (dict(dim=10, heads=4), "heads-divide-dim", "hidden size 10 is not divisible by heads=4"),
        (dict(dp=2, micro_batches=2, global_batch_size=6, num_samples=6), "batch-divides",
         "global batch 6 is not divisible by dp x micro-batches = 2 x 2 = 4"),
        (dict(global_batch_size=4, num_samples=3), "dataset-holds-a-batch", "dataset size 3 is smaller than one global batch"),
        (dict(seq_len=20), "seq-len-fits", "sequence length 20 exceeds the model's max_seq_len 16"),
        (dict(pp=2), "dims-used", "'tp-shaped' parallelizes along dp, tp only; pp=2 is not allowed"),
        (dict(dtype="int8"), "dtype", "dtype 'int8' is not allowed for 'tp-shaped' (allowed: float32, bfloat16, float64)"),
        (dict(optimizer="lamb"), "optimizer", "optimizer 'lamb' is not allowed"),
        (dict(steps=0), "positive-ints", "steps=0: each must be a positive int"),
        (dict(options=(("schedule", "1f1b"),)), "strategy-options", "option 'schedule' is not an option of 'tp-shaped'"),
    ],
)
def test_each_broken_constraint_is_named_with_what_is_allowed(changes, constraint, message) -> None:
    config = ParallelConfig("tp-shaped", global_batch_size=2, num_samples=2, dim=8, heads=2, hidden=8).replace(**changes)
    with pytest.raises(InvalidConfigError) as info:
        search.validate(config, TP_SHAPED)
    assert constraint in info.value.constraints, str(info.value)
    assert message in str(info.value)


def test_pipeline_constraints_are_named() -> None:
    config = ParallelConfig("pp-shaped", pp=2, layers=3, micro_batches=1, global_batch_size=1, num_samples=1)
    with pytest.raises(InvalidConfigError) as info:
        search.validate(config, PP_SHAPED)
    assert info.value.constraints == ["pp-layers", "micro-batches-cover-stages"]
    assert "layer count 3 is not divisible by pp=2" in str(info.value)
    assert "micro-batches 1 < pp=2" in str(info.value)


def test_world_sizes_above_the_limit_and_unknown_strategies_are_refused() -> None:
    with pytest.raises(InvalidConfigError, match=r"world size 4 .* exceeds the 2 ranks this search allows"):
        search.validate(ParallelConfig("ddp", dp=4, global_batch_size=4, num_samples=4), max_world=2)
    with pytest.raises(InvalidConfigError, match="strategy 'nope' is not registered; known: .*ddp"):
        search.validate(ParallelConfig("nope"))
    with pytest.raises(InvalidConfigError, match="hybrid-shaped' needs dp >= 2, got dp=1"):
        search.validate(ParallelConfig("hybrid-shaped", dp=1, tp=2, heads=2, dim=4, hidden=2), HYBRID_SHAPED)


def test_bad_search_arguments_say_what_is_allowed() -> None:
    with pytest.raises(TypeError, match=r"unknown field\(s\) \['hidden_size'\]; allowed: .*hidden"):
        parallel_configs("ddp", max_world=2, hidden_size=4)
    with pytest.raises(ValueError, match="'hybrid-shaped' cannot run on 1..3 ranks: it needs dp >= 2, tp >= 2"):
        parallel_configs(HYBRID_SHAPED, max_world=3)
    with pytest.raises(KeyError, match="no strategy 'nope' in the search registry"):
        parallel_configs("nope", max_world=2)
    with pytest.raises(ValueError, match="dims \\('dp', 'ep'\\) must be a non-empty subset"):
        StrategySpec("moe", search.build_ddp, dims=("dp", "ep"))


# -- generated configs (no ranks) ------------------------------------------------------------


@pytest.mark.parametrize("spec", SHAPES, ids=lambda s: s.name)
@settings(max_examples=60, deadline=None)
@given(data=st.data(), max_world=st.integers(1, 6))
def test_generated_configs_are_valid_and_within_the_world_limit(spec: StrategySpec, data, max_world: int) -> None:
    if spec.min_world > max_world:
        with pytest.raises(ValueError, match="cannot run on"):
            parallel_configs(spec, max_world=max_world)
        return
    config = data.draw(parallel_configs(spec, max_world=max_world))
    event(f"world {config.world_size}, dataset {'divides' if config.num_samples % config.dp == 0 else 'does not divide'} dp")
    assert search.validate(config, spec, max_world=max_world) is config
    assert config.world_size <= max_world
    assert config.dp * config.tp * config.pp == config.world_size
    assert config.heads % config.tp == 0 and config.dim % config.tp == 0 and config.hidden % config.tp == 0
    assert config.layers >= config.pp and config.global_batch_size % (config.dp * config.micro_batches) == 0
    if spec is PP_SHAPED:
        assert config.layers % config.pp == 0 and config.micro_batches >= config.pp
    assert all(getattr(config, d) >= spec.min_degree.get(d, 1) for d in spec.dims)


@pytest.mark.parametrize("spec", SHAPES, ids=lambda s: s.name)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_invalid_configs_fail_validation_naming_their_constraint(spec: StrategySpec, data) -> None:
    bad = data.draw(invalid_configs(spec, max_world=4))
    event(bad.constraint)
    with pytest.raises(InvalidConfigError) as info:
        search.validate(bad.config, spec, max_world=4)
    assert bad.constraint in info.value.constraints, str(info.value)
    assert all(v.message and v.message in str(info.value) for v in info.value.violations)


BREAKABLE = [
    (spec, c.name)
    for spec in (TP_SHAPED, PP_SHAPED, HYBRID_SHAPED)
    for c in search.constraints_for(spec, max_world=4)
    if c.breakable is None or c.breakable(spec)
]


@pytest.mark.parametrize("spec, constraint", BREAKABLE, ids=[f"{s.name}-{c}" for s, c in BREAKABLE])
def test_every_constraint_of_a_strategy_can_be_broken_and_is_named(spec: StrategySpec, constraint: str) -> None:
    @settings(max_examples=5, deadline=None, database=None, phases=(Phase.generate,))
    @given(invalid_configs(spec, max_world=4, constraints=[constraint]))
    def check(bad) -> None:
        assert bad.constraint == constraint
        with pytest.raises(InvalidConfigError) as info:
            search.validate(bad.config, spec, max_world=4)
        assert constraint in info.value.constraints, str(info.value)

    check()


def test_the_generator_shrinks_toward_the_smallest_uneven_dataset() -> None:
    # Without ranks: the smallest config whose dataset does not divide the replicas is the one
    # the sampler bug below must shrink to (2 ranks, a batch of 2, 3 samples).
    smallest = find(
        parallel_configs("ddp", max_world=4),
        lambda c: c.num_samples % c.dp != 0,
        settings=settings(database=None, max_examples=500),
    )
    assert (smallest.dp, smallest.global_batch_size, smallest.micro_batches, smallest.num_samples) == (2, 2, 1, 3)
    assert (smallest.steps, smallest.dim, smallest.layers, smallest.seq_len, smallest.dtype) == (1, 4, 1, 1, "float32")


def test_fixed_fields_and_strategies_are_honoured() -> None:
    @settings(max_examples=40, deadline=None, database=None)
    @given(parallel_configs("ddp", max_world=4, dtype="float64", world_size=2, steps=st.integers(2, 3)))
    def check(config: ParallelConfig) -> None:
        assert config.dtype == "float64" and config.world_size == 2 and config.steps in (2, 3)

    check()


def test_the_registry_holds_ddp_and_what_else_imports() -> None:
    names = search.available_strategies()
    assert "ddp" in names
    with pytest.raises(ValueError, match="already registered"):
        search.register_strategy(search.get_spec("ddp").derive("ddp", search.build_fsdp))


def test_the_package_reexports_each_modules_public_names() -> None:
    from harness.search import config, generate, registry
    from harness.search import property as prop

    for module in (config, registry, generate, prop):
        for name in module.__all__:
            assert getattr(search, name) is getattr(module, name), f"harness.search.{name}"
    assert all(hasattr(search, name) for name in search.__all__)
    # what the ranks receive is pickled by module path: these must be importable by name there
    for fn in (search.run_example, search.noop, *(search.get_spec(n).factory for n in search.available_strategies())):
        assert "<locals>" not in fn.__qualname__ and fn.__module__.startswith("harness.search."), fn


# -- on the warm rank pool -------------------------------------------------------------------


def test_ddp_matches_the_reference_for_every_generated_config_on_the_warm_pool(rank_runner, reference_cache) -> None:
    search.warm_up(rank_runner, "ddp", [1, 2], cache=reference_cache)
    started = rank_runner.manager.started
    report = assert_matches_reference_for_all(
        "ddp", rank_runner, max_world=2, max_examples=3, cache=reference_cache, warm=False,
    )
    assert report.examples == 3 and set(report.worlds) <= {1, 2}
    assert rank_runner.manager.started == started  # no ranks spawned per example
    assert all(s < search.example_deadline(2).total_seconds() for s in report.seconds)
    print(report.summary())


def test_a_config_dependent_sampler_bug_is_found_shrunk_and_replayed(rank_runner, reference_cache, tmp_path) -> None:
    assert remainder.EXPECTED_CODE in CODES
    db = InMemoryExampleDatabase()
    kwargs = dict(max_world=2, cache=reference_cache, workdir=tmp_path, tolerance="default", **BUG_SPACE)
    with pytest.raises(ConfigMismatch) as info:  # an ordinary random search; found within a few examples
        assert_matches_reference_for_all(BUGGY, rank_runner, max_examples=40, hypothesis_settings={"database": db}, **kwargs)
    mismatch = info.value
    assert mismatch.config == SHRUNK  # 2 ranks, one micro-batch of one per replica, 3 samples, 1 step
    assert str(tmp_path) in str(mismatch)  # the report points at the kept records
    assert remainder.EXPECTED_CODE in mismatch.codes
    text = str(mismatch)
    assert SHRUNK.describe() in text and f"diagnosis: {', '.join(mismatch.codes)}" in text
    assert "dataset 3 samples" in text and "[dp=2]" in text
    report = mismatch.search_report
    assert report is not None and report.worlds.get(1, 0) >= 1  # world 1 was tried (and passed)
    print(report.summary())

    # Hypothesis's database kept the shrunk example: the reuse phase alone (no generation, no
    # shrinking) fails on it again.
    assert any(db.data.values()), "Hypothesis saved no failing example"
    with pytest.raises(ConfigMismatch) as again:
        assert_matches_reference_for_all(
            BUGGY, rank_runner, warm=False, hypothesis_settings={"database": db, "phases": (Phase.reuse,)}, **kwargs,
        )
    assert again.value.config == SHRUNK
    assert again.value.search_report.examples <= 2  # the replayed example (and its final reproduction)


class ShortSequencesOnlyDDP(DDPStrategy):
    """DDP around a (pretend) fused kernel that only handles sequences shorter than 3 tokens."""

    name = "ddp-short-sequences-only"

    def setup(self, case, ctx):
        length = case.dataset[0].input.shape[0]
        if length >= 3:
            raise ValueError(f"fused attention kernel supports sequences < 3 tokens, got {length}")
        return super().setup(case, ctx)


def short_sequences_only(config: ParallelConfig) -> ShortSequencesOnlyDDP:
    return ShortSequencesOnlyDDP()


def test_a_crash_is_shrunk_and_reported_with_its_config(rank_runner, reference_cache, tmp_path) -> None:
    spec = search.get_spec("ddp").derive(ShortSequencesOnlyDDP.name, short_sequences_only)
    with pytest.raises(search.ConfigCrashed) as info:
        assert_matches_reference_for_all(
            spec, rank_runner, max_world=2, min_world=2, max_examples=10, cache=reference_cache, workdir=tmp_path, tolerance="default",
            dtype="float64", optimizer="sgd", steps=1, layers=1, heads=1, hidden=1, micro_batches=1, num_samples=2,
            max_micro_batch_size=1, hypothesis_settings={"database": None, "derandomize": True},
        )
    crash = info.value
    assert crash.config.seq_len == 3 and not crash.hung  # the shortest sequence that fails
    assert crash.config.describe() in str(crash) and "fused attention kernel supports sequences < 3 tokens" in str(crash)
    assert "ValueError" in crash.report


SEEDED = """
from hypothesis import seed
from harness.search import given_configs

SETTINGS = {"max_examples": 6, "database": None}

@given_configs("ddp", max_world=4, hypothesis_settings=SETTINGS)
def test_global_seed(config):
    print("GLOBAL", config)

@seed(8)
@given_configs("ddp", max_world=4, hypothesis_settings=SETTINGS)
def test_own_seed(config):
    print("OWN", config)
"""


@pytest.mark.slow  # 13 s: two pytest subprocesses with Hypothesis
def test_hypothesis_seed_reproduces_the_configs_in_a_new_process(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_seeded=SEEDED)
    runs = [pytester.runpytest_subprocess("-s", "-q", "-p", "no:cacheprovider", "--hypothesis-seed=7") for _ in range(2)]

    def configs(result: pytest.RunResult, tag: str) -> list[str]:
        return [line.split(" ", 1)[1] for line in result.outlines if line.startswith(tag + " ")]

    for result in runs:
        result.assert_outcomes(passed=2)
    first, again = (configs(r, "GLOBAL") for r in runs)
    assert len(first) >= 6 and first == again  # the same configs, in the same order
    assert configs(runs[0], "OWN") != first  # and it is the seed that decides them


def test_the_bf16_adamw_sign_flip_the_search_found_now_passes(rank_runner, reference_cache) -> None:
    outcome = search.check_config(rank_runner, "ddp", BF16_ADAMW_SIGN_FLIP, cache=reference_cache, max_world=3)
    comparison = outcome.result.comparison
    assert outcome.passed, comparison.summary()
    # The flip still happens along the trajectory (where the AdamW sign-noise rule accepts it)...
    assert comparison.trajectory["excused"] > 0, "the flip is no longer exercised"
    # ...but the stepwise check needs no such rule: each update is checked from the run's own
    # gradients, so the optimizer cannot amplify their rounding noise.
    assert comparison.mode == "stepwise" and not any(t.excused for t in comparison.tensors)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp", "fsdp", "pipeline", "tp", "ddp-tp", "fsdp-tp"])
def test_a_larger_search_finds_nothing_in_the_correct_strategies(rank_runner, reference_cache, name: str) -> None:
    if name not in search.available_strategies():
        pytest.skip(f"{name} does not import here")
    report = assert_matches_reference_for_all(name, rank_runner, max_world=4, max_examples=15, cache=reference_cache)
    print(report.summary())

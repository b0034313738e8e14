"""Run a function on N warm ranks from an ordinary process and get its return values back.

The pytest plugin runs test bodies on the warm pool; this is the same machinery for code that
drives ranks itself: the ``diagnose`` CLI and the Hypothesis search (one example, one call,
no spawn). ``fn`` must be a module-level function importable by name; it receives the rank's
:class:`~harness.context.DistContext` as ``ctx`` plus ``kwargs`` (picklable), and may return
picklable data::

    with RankRunner() as runner:
        values = runner.run(my_module.check, nproc=2, kwargs={"case": case}).values
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from harness import settings
from harness.launch.devices import resolve
from harness.launch.pool import PoolConfig, PoolKey, PoolManager, PoolStartError, RunOutcome
from harness.launch.protocol import TestTask

__all__ = ["RankRunner", "RanksFailed", "RanksHung", "RemoteResult"]


class RanksFailed(RuntimeError):
    """A rank raised or died; ``report`` is the launcher's per-rank failure report."""

    def __init__(self, report: str, outcome: RunOutcome):
        super().__init__(report)
        self.report = report
        self.outcome = outcome


class RanksHung(RanksFailed):
    """The ranks did not finish within the timeout (the report has stacks and collectives)."""


@dataclass
class RemoteResult:
    values: dict[int, Any] = field(default_factory=dict)  # rank -> return value
    outcome: RunOutcome | None = None
    stdout: dict[int, str] = field(default_factory=dict)


def _importable(fn: Callable[..., Any]) -> tuple[str, str]:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", "")
    if not module or "<locals>" in qualname or module == "__main__":
        raise TypeError(
            f"{fn!r} cannot run on ranks: pass a module-level function of an importable module "
            f"(got module {module!r}, qualname {qualname!r})"
        )
    mod = sys.modules.get(module)
    return module, getattr(mod, "__file__", "") or ""


class RankRunner:
    """Owns (or borrows) a :class:`PoolManager`; pools stay warm between calls."""

    def __init__(
        self,
        manager: PoolManager | None = None,
        *,
        backend: str = "auto",
        device: str = "auto",
        stall_window: float | None = None,
        failure_grace: float | None = None,
    ):
        """``stall_window``: seconds without progress on every running rank before a call counts
        as hung (default :class:`~harness.launch.pool.PoolConfig`'s 10 s; 0: only the deadline);
        ``failure_grace``: how long the other ranks may take once one failed (default 3 s)."""
        self._own = manager is None
        overrides = {k: v for k, v in (("stall_window", stall_window), ("failure_grace", failure_grace)) if v is not None}
        self.manager = manager or PoolManager(PoolConfig(**overrides))
        self.backend = backend
        self.device = device

    def key(self, nproc: int) -> PoolKey:
        backend, device = resolve(self.backend, self.device, nproc)
        return PoolKey(nproc, backend, device)

    def run(
        self,
        fn: Callable[..., Any],
        *,
        nproc: int,
        kwargs: Mapping[str, Any] | None = None,
        timeout: float = settings.RUN_TIMEOUT_S,
        seed: int = 0,
        stall_window: float | None = None,
    ) -> RemoteResult:
        """Collective call of ``fn(ctx=..., **kwargs)`` on ``nproc`` ranks. Raises
        :class:`RanksHung` on a timeout or a stall and :class:`RanksFailed` when a rank fails or
        dies. ``stall_window`` overrides the runner's for this call (0: only the deadline)."""
        from harness.launch.failure_text import format_failure

        module, path = _importable(fn)
        task = TestTask(
            nodeid=f"{module}:{fn.__qualname__}",
            module_name=module,
            module_file=path,
            qualname=fn.__qualname__,
            kwargs_pickle=pickle.dumps(dict(kwargs or {})),
            ctx_argnames=("ctx",),
            sys_path=list(sys.path),
            cwd=os.getcwd(),
            seed=seed,
            plain_import=True,
        )
        try:
            outcome = self.manager.run(self.key(nproc), task, timeout, stall_window)
        except PoolStartError as exc:
            raise RanksFailed(f"could not start {nproc} ranks: {exc}", RunOutcome(nproc)) from exc
        if outcome.timed_out:
            raise RanksHung(format_failure(outcome), outcome)
        if outcome.failed:
            raise RanksFailed(format_failure(outcome), outcome)
        return RemoteResult(
            values={r: pickle.loads(res.value_pickle) if res.value_pickle else None for r, res in outcome.results.items()},
            outcome=outcome,
            stdout={r: res.stdout for r, res in outcome.results.items()},
        )

    def fresh(self) -> "RankRunner":
        """A runner of the same configuration with pools of its own: ranks that never ran
        anything before (the determinism gate's runs), forked from this runner's fork server.
        Close it when done."""
        manager = PoolManager(
            self.manager.config, max_pools=1, start_method=self.manager.start_method,
            fork_server_of=self.manager,
        )
        runner = RankRunner(manager, backend=self.backend, device=self.device)
        runner._own = True
        return runner

    def close(self) -> None:
        if self._own:
            self.manager.close()

    def __enter__(self) -> "RankRunner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

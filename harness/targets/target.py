"""What ``python -m harness diagnose TARGET`` runs: resolving TARGET to a case and a strategy
(or a custom training loop).

TARGET is one of

- a bundled name: a module of ``cases/bugs/`` (``grad-double-averaged`` or
  ``double_averaged_ddp``) or a correct strategy of ``cases/targets.py`` (``ddp``, ``fsdp``...);
- ``path/to/file.py``: a file that defines the target at module level (below);
- ``path/to/file.py:NAME``: the same, with NAME picking the strategy, the custom training
  function or a :class:`Target` among several in the file.

A target file defines::

    CASE = transformer_case()          # a reference.Case, or a function returning one
    STRATEGY = MyStrategy()            # a harness.strategy.Strategy (instance, class or factory)
    NPROC = 2                          # optional: the world size it needs
    TIMEOUT = 30                       # optional: the deadline in seconds (a run still going is stopped)
    STALL_WINDOW = 3                   # optional: seconds without progress on every rank that count as hung
    REPEAT = 2                         # optional: run it this many times on fresh ranks, compared bitwise
    RESUME_AT = 2                      # optional: save a checkpoint before step 2, resume it on fresh ranks
    RESUME_INTO = "tp"                 # optional (with RESUME_AT): resume into this target (RESUME_NPROC ranks)
    EXPECTED_CODE = "grad-scaled"      # optional: what its diagnosis must name (cases/bugs)

or, for a custom training loop (see :mod:`harness.record.custom`)::

    CASE = ...
    def train(ctx, run):               # run: harness.record.custom.CustomRun
        ...
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from reference.case import Case

__all__ = ["Target", "TargetError", "load_target", "target_from_module"]


class TargetError(ValueError):
    """TARGET cannot be resolved or does not define what a target needs."""


@dataclass
class Target:
    """A resolved target. Exactly one of ``strategy`` / ``train`` / ``layout`` is set
    (``layout``: a :class:`harness.simulate.layout.LayoutPlan`, checked on simulated ranks)."""

    name: str
    case: Case
    strategy: Any = None
    train: Callable[..., Any] | None = None
    nproc: int | None = None
    timeout: float | None = None  # the run's deadline in seconds (TIMEOUT in the file)
    # Seconds in which no running rank makes progress that name the run hung (STALL_WINDOW).
    stall_window: float | None = None
    repeat: int | None = None  # runs on fresh ranks compared bitwise (REPEAT; harness.analysis.determinism)
    # The resume check (RESUME_AT, RESUME_INTO, RESUME_NPROC; harness.analysis.resume).
    resume_at: int | None = None
    resume_into: str | None = None
    resume_nproc: int | None = None
    # A custom loop's own checkpoint code, (save, load): the file's save(ctx, run, path) and
    # load(ctx, run, path); None: the harness saves the watched objects (harness.record.checkpoint).
    checkpoint_glue: tuple[Callable[..., Any], Callable[..., Any]] | None = None
    expected_code: str | None = None
    source: str = ""  # the module file it came from
    description: str = ""
    layout: Any = None


def _package_module_name(path: Path) -> tuple[str, str] | None:
    """(sys.path root, dotted module name) of a file inside a package (its folder has an
    ``__init__.py``), or None for a plain script."""
    path = path.resolve()
    parts = [path.stem]
    folder = path.parent
    while (folder / "__init__.py").is_file():
        parts.insert(0, folder.name)
        folder = folder.parent
    if len(parts) == 1 or not all(p.isidentifier() for p in parts):
        return None
    return str(folder), ".".join(parts)


def _load_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise TargetError(f"target file {str(path)!r} does not exist")
    if path.suffix != ".py":
        raise TargetError(f"target file {str(path)!r} is not a .py file")
    package = _package_module_name(path)
    if package is not None:
        # A file inside a package (cases/bugs/summed_grads.py) is imported as part of it, so
        # its relative imports resolve.
        root, dotted = package
        if root not in sys.path:
            sys.path.insert(0, root)
        try:
            return importlib.import_module(dotted)
        except Exception as exc:
            raise TargetError(f"importing target file {str(path)!r} as {dotted} failed: {type(exc).__name__}: {exc}") from exc
    name = "harness_target_" + path.stem.replace("-", "_")
    resolved = str(path.resolve())
    existing = sys.modules.get(name)
    if existing is not None and getattr(existing, "__file__", None) == resolved:
        return existing
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise TargetError(f"cannot import {str(path)!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    parent = str(path.resolve().parent)
    if parent not in sys.path:
        sys.path.insert(0, parent)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise TargetError(f"importing target file {str(path)!r} failed: {type(exc).__name__}: {exc}") from exc
    return module


def _value(obj: Any) -> Any:
    """An instance from an instance, a class or a zero-argument factory."""
    if inspect.isclass(obj):
        return obj()
    if callable(obj) and not hasattr(obj, "setup") and not isinstance(obj, Case):
        try:
            sig = inspect.signature(obj)
        except (TypeError, ValueError):
            return obj
        if all(p.default is not inspect.Parameter.empty for p in sig.parameters.values()):
            return obj()
    return obj


def is_train_fn(obj: Any) -> bool:
    """A custom loop: a function taking ``(ctx, run)`` (any names) as its first two positional
    parameters, every further parameter with a default (``train(ctx, run, bug=False)``)."""
    if not inspect.isfunction(obj):
        return False
    params = list(inspect.signature(obj).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2 or any(p.default is not p.empty for p in positional[:2]):
        return False
    rest = [p for p in params if p not in positional[:2]]
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in rest)


def _signature_text(obj: Any) -> str:
    try:
        return f"{obj.__name__}{inspect.signature(obj)}"
    except (TypeError, ValueError, AttributeError):
        return repr(obj)


def _checkpoint_glue(module: ModuleType, where: str) -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """A custom loop file's ``save(ctx, run, path)`` and ``load(ctx, run, path)``: functions
    defined in the file itself (a ``save`` imported from torch or pickle is not glue), both or
    neither."""
    found = {}
    for name in ("save", "load"):
        fn = getattr(module, name, None)
        if inspect.isfunction(fn) and fn.__module__ == module.__name__:
            params = [p for p in inspect.signature(fn).parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            if len(params) < 3 or any(p.default is not p.empty for p in params[:3]):
                raise TargetError(f"{where}: {_signature_text(fn)} is not checkpoint glue: it takes (ctx, run, path), "
                                  "path being the folder the loop's checkpoint lives in")
            found[name] = fn
    if not found:
        return None
    if len(found) == 1:
        have, lacking = next(iter(found)), ({"save", "load"} - set(found)).pop()
        raise TargetError(f"{where} defines {have}(ctx, run, path) but not {lacking}(ctx, run, path): a custom loop's own "
                          "checkpoint code needs both (or neither: the harness then saves the watched objects)")
    return found["save"], found["load"]


def target_from_module(module: ModuleType, name: str | None = None, *, label: str | None = None) -> Target:
    where = label or getattr(module, "__file__", module.__name__)
    if name is not None:
        if not hasattr(module, name):
            public = [n for n in vars(module) if not n.startswith("_")]
            raise TargetError(f"{where} has no attribute {name!r}; it defines: {', '.join(sorted(public))}")
        chosen = getattr(module, name)
        if isinstance(chosen, Target):
            return chosen
    else:
        chosen = None
    if not hasattr(module, "CASE"):
        raise TargetError(f"{where} does not define CASE (a reference.Case or a function returning one)")
    case = _value(module.CASE)
    if not isinstance(case, Case):
        raise TargetError(f"{where}: CASE must be a reference.Case or return one, got {type(case).__name__}")
    train = strategy = None
    if chosen is not None:
        if is_train_fn(chosen):
            train = chosen
        else:
            strategy = _value(chosen)
            if inspect.isfunction(strategy) or not hasattr(strategy, "setup"):
                raise TargetError(
                    f"{where}:{name} is {_signature_text(chosen)}: a target is a Strategy (an instance, a class, or a "
                    "function of no required arguments returning one) or a custom loop train(ctx, run, ...) whose "
                    "parameters after (ctx, run) all have defaults"
                )
    elif hasattr(module, "STRATEGY"):
        strategy = _value(module.STRATEGY)
    elif is_train_fn(getattr(module, "train", None)):
        train = module.train
    elif callable(getattr(module, "train", None)):
        raise TargetError(
            f"{where}: train is {_signature_text(module.train)}; a custom loop takes (ctx, run) first and gives every "
            "other parameter a default, e.g. train(ctx, run, bug=False)"
        )
    else:
        raise TargetError(f"{where} defines neither STRATEGY (a harness.strategy.Strategy) nor train(ctx, run) (a custom loop)")
    if strategy is not None and not all(hasattr(strategy, m) for m in ("name", "setup", "local_batches", "forward_backward", "optimizer_step")):
        raise TargetError(f"{where}: the strategy {strategy!r} is not a harness.strategy.Strategy (subclass harness.strategy.StrategyBase)")
    nproc = getattr(module, "NPROC", None)
    if nproc is not None and (isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1):
        raise TargetError(f"{where}: NPROC must be a positive int, got {nproc!r}")
    timeout = getattr(module, "TIMEOUT", None)
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not (timeout > 0 and math.isfinite(timeout))):
        raise TargetError(f"{where}: TIMEOUT must be a finite number of seconds > 0, got {timeout!r}")
    stall_window = getattr(module, "STALL_WINDOW", None)
    if stall_window is not None and (isinstance(stall_window, bool) or not isinstance(stall_window, (int, float))
                                     or not (stall_window > 0 and math.isfinite(stall_window))):
        raise TargetError(f"{where}: STALL_WINDOW must be a finite number of seconds > 0, got {stall_window!r}")
    repeat = getattr(module, "REPEAT", None)
    if repeat is not None and (isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1):
        raise TargetError(f"{where}: REPEAT must be an int >= 1 (the runs compared bitwise), got {repeat!r}")
    resume = {key: getattr(module, key, None) for key in ("RESUME_AT", "RESUME_NPROC")}
    for key, value in resume.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise TargetError(f"{where}: {key} must be an int >= 1, got {value!r}")
    if resume["RESUME_NPROC"] is not None:
        from harness.launch.pool import check_world_size

        try:  # refused here, not after the saving run
            check_world_size(resume["RESUME_NPROC"])
        except ValueError as exc:
            raise TargetError(f"{where}: RESUME_NPROC: {exc}") from None
    resume_into = getattr(module, "RESUME_INTO", None)
    if resume_into is not None and not isinstance(resume_into, str):
        raise TargetError(f"{where}: RESUME_INTO must be a target name or path (a str), got {resume_into!r}")
    glue = _checkpoint_glue(module, where) if train is not None else None
    doc = (module.__doc__ or "").strip().splitlines()
    return Target(
        name=label or Path(getattr(module, "__file__", module.__name__)).stem + (f":{name}" if name else ""),
        case=case,
        strategy=strategy,
        train=train,
        nproc=nproc,
        timeout=float(timeout) if timeout is not None else None,
        stall_window=float(stall_window) if stall_window is not None else None,
        repeat=repeat,
        resume_at=resume["RESUME_AT"],
        resume_into=resume_into,
        resume_nproc=resume["RESUME_NPROC"],
        checkpoint_glue=glue,
        expected_code=getattr(module, "EXPECTED_CODE", None),
        source=getattr(module, "__file__", "") or "",
        description=doc[0] if doc else "",
    )


def load_target(spec: str, bundled: Mapping[str, str] | None = None) -> Target:
    """Resolve TARGET (see the module docstring); raises :class:`TargetError` with the
    allowed forms and bundled names when it cannot. ``bundled`` maps bundled names to
    ``module`` or ``module:NAME`` (a factory in the module's ``TARGETS``); the front ends pass
    :func:`harness.targets.bundled.bundled_targets` (this module never names the examples)."""
    spec = spec.strip()
    if not spec:
        raise TargetError("empty TARGET")
    file_part, _, name = spec.partition(":") if ".py" in spec else (spec, "", "")
    if file_part.endswith(".py") or os.sep in file_part:
        module = _load_file(Path(file_part))
        return target_from_module(module, name or None)
    bundled = dict(bundled or {})
    if spec not in bundled:
        raise TargetError(
            f"unknown target {spec!r}: give path/to/file.py, path/to/file.py:NAME or a bundled name "
            f"({', '.join(sorted(bundled)) or 'none found'})"
        )
    module_name, _, attr = bundled[spec].partition(":")
    module = importlib.import_module(module_name)
    if attr:
        factory = getattr(module, "TARGETS")[attr]
        target = factory()
        target.name = spec
        return target
    return target_from_module(module, label=spec)

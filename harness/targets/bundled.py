"""The bundled targets: every module of ``cases/bugs`` (by module name, and by its code when
only one module has it) and the correct strategies of ``cases/targets.py``. The one module
of ``harness.targets`` that names the examples (``harness.targets.target`` never does, so
``cases`` can build targets with it)."""

from __future__ import annotations

from cases.bugs import catalogue
from cases.targets import DEMO_CORRECT, TARGETS
from harness.targets import target as _target
from harness.targets.target import Target

__all__ = ["DEMO_CORRECT", "bug_codes", "bundled_targets", "demo_targets", "load_target"]


def bug_codes() -> dict[str, str]:
    """Bug module name (``double_averaged_ddp``) -> the code its diagnosis must name."""
    return {m.rsplit(".", 1)[-1]: code for m, code in catalogue().items()}


def demo_targets() -> list[tuple[str, str | None]]:
    """The demo's targets: (bundled name, expected code or None for a correct strategy), bug
    cases first."""
    return [*bug_codes().items(), *((name, None) for name in DEMO_CORRECT)]


def bundled_targets() -> dict[str, str]:
    """Bundled target name -> importable module: every ``cases/bugs`` module (by module name
    and by its EXPECTED_CODE when unique) and the correct strategies of ``cases.targets``."""
    out: dict[str, str] = {}
    by_code: dict[str, list[str]] = {}
    for module_name, code in catalogue().items():
        short = module_name.rsplit(".", 1)[-1]
        out[short] = module_name
        by_code.setdefault(code, []).append(module_name)
    for code, modules in by_code.items():
        if len(modules) == 1 and code not in out:
            out[code] = modules[0]
    for name in TARGETS:
        out.setdefault(name, f"cases.targets:{name}")
    return out


def load_target(spec: str) -> Target:
    """A file, ``file.py:NAME``, an importable module or a bundled name, as a :class:`Target`
    (:func:`harness.targets.target.load_target` with the bundled names)."""
    return _target.load_target(spec, bundled_targets())

"""Known-bug strategies: one small, readable module per diagnosis code.

Each module states what its bug is and which real-world bug class it stands for, and declares
``EXPECTED_CODE``: diagnosing it (``python -m harness diagnose <module name>``) must name that
code. The catalogue is discovered from the files, so adding a module adds a case.
"""

from __future__ import annotations

import importlib
import pkgutil

__all__ = ["catalogue"]


def catalogue() -> dict[str, str]:
    """Module name -> EXPECTED_CODE for every bug module, sorted by module name."""
    out: dict[str, str] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        name = f"{__name__}.{info.name}"
        module = importlib.import_module(name)
        code = getattr(module, "EXPECTED_CODE", None)
        if code is None:
            raise AttributeError(f"{name} does not declare EXPECTED_CODE (one of harness.codes.CODES)")
        out[name] = code
    return out

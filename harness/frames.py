"""Which frames are the user's: the harness's own files, the libraries under the user's code
(torch, the standard library, pytest), and the first frame outside them - the call site a
report names. Torch-free: the launcher and the plugin use it before any rank starts."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from typing import Any

__all__ = ["HARNESS_DIR", "call_site", "is_harness_file", "is_library_frame", "user_frame"]

# The package's own directory: frames under it are the harness's, never the user's call site.
HARNESS_DIR = os.path.dirname(os.path.abspath(__file__))


def is_harness_file(filename: str) -> bool:
    """Whether ``filename`` is one of the harness's own source files."""
    return os.path.abspath(filename).startswith(HARNESS_DIR + os.sep)


_STDLIB_DIR = os.path.dirname(os.__file__)


@functools.lru_cache(maxsize=1)
def _torch_dir() -> str:
    """torch's package directory, found without importing torch (the plugin stays cheap)."""
    spec = importlib.util.find_spec("torch")
    origin = spec.origin if spec is not None and spec.origin else ""
    return os.path.dirname(os.path.abspath(origin)) if origin else os.sep + "nonexistent-torch"


def _in_site_packages(path: str) -> bool:
    """Installed third-party code (a model library such as transformers) is the user's model,
    not the standard library it sits beside."""
    return f"{os.sep}site-packages{os.sep}" in path or f"{os.sep}dist-packages{os.sep}" in path


def is_library_frame(filename: str) -> bool:
    """True for frames of torch, the harness's own launcher or the standard library."""
    path = os.path.abspath(filename) if filename and not filename.startswith("<") else filename
    if not path or path.startswith("<"):
        return True
    return (
        path.startswith(_torch_dir() + os.sep)
        or is_harness_file(path)
        or (path.startswith(_STDLIB_DIR + os.sep) and not _in_site_packages(path))
        or f"{os.sep}_pytest{os.sep}" in path
        or f"{os.sep}pluggy{os.sep}" in path
    )


# code object -> whether it is library code; a frame walk per collective call must stay cheap.
_LIBRARY_CODE: dict[Any, bool] = {}


def _is_library(code: Any) -> bool:
    known = _LIBRARY_CODE.get(code)
    if known is None:
        known = _LIBRARY_CODE[code] = is_library_frame(code.co_filename)
    return known


def user_frame(frame: Any) -> Any:
    """``frame`` or the innermost frame above it outside torch, the harness and the stdlib
    (``frame`` itself when every frame is library code)."""
    innermost = frame
    while frame is not None and _is_library(frame.f_code):
        frame = frame.f_back
    return innermost if frame is None else frame


def call_site(depth: int = 1) -> str:
    """``file:line in fn`` of the innermost frame outside torch, the harness and the stdlib."""
    frame = user_frame(sys._getframe(depth))
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"

"""A rank's traceback as pytest prints it, whatever its depth (pytest >= 8 made traceback
entries immutable: a deep traceback once fell back to Python's own format)."""

from __future__ import annotations


def _three(n: int) -> None:
    if n == 0:
        raise ValueError("deep")
    _three(n - 1)


def test_a_deep_traceback_is_pytest_style_with_the_middle_short() -> None:
    from harness.launch.worker import _pytest_longrepr

    try:
        _three(3)
    except ValueError as exc:
        text = _pytest_longrepr(exc, _three)
    assert "Traceback (most recent call last)" not in text
    assert "raise ValueError(\"deep\")" in text and "E           ValueError: deep" in text
    assert text.count(": in _three") >= 2, text  # the middle entries, short style


def test_an_internal_failure_is_ours_only_for_pythons_own_exception_raised_in_the_harness() -> None:
    """An AttributeError raised in harness code is ours; the harness's own error classes (a
    message to a person) and anything raised in the user's code stay the user's to read."""
    import os

    from harness.frames import HARNESS_DIR
    from harness.launch.failure_text import is_internal_failure

    ours = (os.path.join(HARNESS_DIR, "pipeline.py"), "195", "_train_custom")
    user = ("/home/me/loop.py", "12", "train")
    assert is_internal_failure("AttributeError", [user, ours])
    assert not is_internal_failure("RecorderError", [user, ours])
    assert not is_internal_failure("AttributeError", [ours, user])
    assert not is_internal_failure("AttributeError", [])

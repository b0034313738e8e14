"""Repo-level pytest configuration for the project's own tests.

The harness plugin itself comes from the package's ``pytest11`` entry point
(``pip install -e .``); pytester is used to run the plugin on small test files in fresh
pytest processes.
"""

pytest_plugins = ["pytester"]

import pytest


@pytest.fixture(scope="session")
def reference_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One reference cache for the whole session (a path, so it travels to ranks): each case's
    single-device reference is trained once, not once per test. Under xdist each worker has
    its own; the cache publishes records atomically either way."""
    return str(tmp_path_factory.getbasetemp() / "reference-cache")

"""Repo-level pytest configuration for the project's own tests.

The harness plugin itself comes from the package's ``pytest11`` entry point
(``pip install -e .``); pytester is used to run the plugin on small test files in fresh
pytest processes.
"""

pytest_plugins = ["pytester"]

"""parallel-harness: does your parallel training compute what one device computes?

Pipeline: case -> reference record -> rank records -> gather -> compare -> diagnose -> report.
The pytest plugin (``harness.pytest_plugin``) runs ``@pytest.mark.distributed`` tests on real
ranks. Importing this package does not import torch.
"""

import os

__version__ = "0.1.0"

# The package's own directory: frames under it are the harness's, never the user's call site.
HARNESS_DIR = os.path.dirname(os.path.abspath(__file__))


def is_harness_file(filename: str) -> bool:
    """Whether ``filename`` is one of the harness's own source files."""
    return os.path.abspath(filename).startswith(HARNESS_DIR + os.sep)

"""parallel-harness: does your parallel training compute what one device computes?

Pipeline: case -> reference record -> rank records -> gather -> compare -> diagnose -> report.
The pytest plugin (``harness.pytest_plugin``) runs ``@pytest.mark.distributed`` tests on real
ranks. Importing this package does not import torch.
"""

__version__ = "0.1.0"

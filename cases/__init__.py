"""Cases: small models, data with sample ids, and strategies to check against the reference."""

from .catalog import OPTIMIZERS, mlp_case

__all__ = ["OPTIMIZERS", "mlp_case"]

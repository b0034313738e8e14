"""Cases: small models, data with sample ids, and strategies to check against the reference."""

from .catalog import OPTIMIZERS, lm_loss, mlp_case, transformer_case

__all__ = ["OPTIMIZERS", "lm_loss", "mlp_case", "transformer_case"]

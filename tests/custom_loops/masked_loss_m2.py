"""The masked loss normalised per micro-batch (2 micro-batch(es) per step, no loss_normaliser):
the correct loop divides each replica's masked sum by the micro-batch's global count; the bug
by its own (cases/masked_loss_example.py holds the loops)."""
from cases.catalog import masked_lm_case
from cases.masked_loss_example import local_normalisation as train, per_micro_batch_normalisation as correct  # noqa: F401

CASE = masked_lm_case(micro_batches=2)
NPROC = 2

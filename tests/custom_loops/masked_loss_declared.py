"""The masked loss with per-replica normalisation *declared* (``per_replica=("loss",)``): each
replica's own masked mean is the contract, so the locally normalised loop passes; a scale bug
under the declaration is still named."""
from cases.catalog import masked_lm_case
from cases.masked_loss_example import local_normalisation as train, unweighted_accumulation  # noqa: F401

CASE = masked_lm_case(micro_batches=2, per_replica=("loss",))
NPROC = 2

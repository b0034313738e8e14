"""The single-device reference: the case a user hands over, the trainer, and the record format.

Data flows one way: ``Case`` -> :func:`train_reference` -> :class:`Record` on disk. The parallel
side (``harness``) writes the same record format, so the two can be compared step by step.
"""

from .cache import cache_dir, cached_reference, case_fingerprint
from .case import Batch, Case, CaseError, Sample, SampleDataset, check_dataset, collate
from .record import KINDS, Record, RecordError, RecordWriter, StepRecord, TensorInfo
from .schedule import global_batch_indices, micro_batch_indices, replica_micro_batch_indices
from .trainer import NonFiniteReferenceError, ReferenceVariant, train_reference

__all__ = [
    "KINDS",
    "Batch",
    "Case",
    "CaseError",
    "NonFiniteReferenceError",
    "Record",
    "RecordError",
    "RecordWriter",
    "ReferenceVariant",
    "Sample",
    "SampleDataset",
    "StepRecord",
    "TensorInfo",
    "cache_dir",
    "cached_reference",
    "case_fingerprint",
    "check_dataset",
    "collate",
    "global_batch_indices",
    "micro_batch_indices",
    "replica_micro_batch_indices",
    "train_reference",
]

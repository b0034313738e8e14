"""A GPipe pipeline whose accumulated micro-batch gradients are never divided by the number of
micro-batches.

Real-world class: a pipeline schedule that sums the gradients of m micro-batches of a *mean*
loss (``scale_grads=False``, or a hand-written schedule) without the 1/m a single big batch
would have: every gradient is m times too large, while the logged loss looks right.
"""

from __future__ import annotations

from cases.catalog import transformer_case
from cases.strategies.pipeline import PipelineStrategy

EXPECTED_CODE = "pp-loss-scaling"
NPROC = 2
CASE = transformer_case(micro_batches=4)


class UnscaledGPipe(PipelineStrategy):
    name = "gpipe-unscaled"

    def build_schedule(self, stage, n_microbatches, loss_fn):
        from torch.distributed.pipelining import ScheduleGPipe

        # BUG: the schedule sums 4 micro-batch gradients of a mean loss and never divides
        return ScheduleGPipe(stage, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


def STRATEGY():
    return UnscaledGPipe("gpipe")

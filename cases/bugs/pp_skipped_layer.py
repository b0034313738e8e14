"""A pipeline whose hand-written stage split loses a transformer block.

Real-world class: an off-by-one in the layer ranges of a manual stage split
(``layers[start:end]`` with ``end`` exclusive on one side and inclusive on the other): the
model still runs - one block short - and trains to a worse loss without any error.
"""

from __future__ import annotations

from cases.catalog import transformer_case
from cases.strategies.pipeline import PipelineStrategy

EXPECTED_CODE = "pp-stage-coverage"
NPROC = 2
CASE = transformer_case(micro_batches=2)


class LayerSkippingPipeline(PipelineStrategy):
    name = "gpipe-skipped-layer"

    def stage_layers(self, num_layers, stage, num_stages):
        per = num_layers // num_stages
        start, end = stage * per, (stage + 1) * per
        return list(range(start, end - 1 if stage == 0 else end))  # BUG: stage 0 stops a block early


def STRATEGY():
    return LayerSkippingPipeline("gpipe")

"""A custom loop over a Hugging Face model: DDP around a tiny ``LlamaForCausalLM``, batches that
are dicts (``input_ids``, ``attention_mask``, ``labels``) from a plain ``torch.utils.data.Dataset``
with an ``"id"`` per item, and the loss the model computes itself (``outputs.loss``).

Run it: ``python -m harness diagnose cases/hf_custom_example.py`` (needs ``transformers``).
The lines marked ``# harness`` are all the glue.
"""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel

from cases.hf import hf_case
from harness.parallel_dims import RankLayout

CASE = hf_case("llama", model_loss=True)  # harness: model, dict data with ids, optimizer; loss_fn=None
NPROC = 2


def train(ctx, run):
    model = DistributedDataParallel(CASE.build_model(ctx.device))
    optimizer = CASE.build_optimizer(model.parameters())
    run.watch(model, optimizer, RankLayout.data_parallel(ctx.rank, ctx.world_size))  # harness
    for step in range(run.start, run.steps):  # harness: run.start > 0 when resumed (--resume-at)
        for batch in run.batches(step):  # this replica's shard, as DistributedSampler gives it
            loss = model(**batch.inputs).loss  # the model's own loss from its labels
            (loss * run.loss_weight(batch)).backward()
            run.loss(step, loss, batch.ids)  # harness
        run.before_step(step)  # harness
        optimizer.step()
        run.after_step(step)  # harness
        optimizer.zero_grad()

"""Pipeline parallelism with ``torch.distributed.pipelining``, alone or composed with data and
tensor parallelism (dp x pp, dp x tp x pp).

Stages are built torchtitan-style: every rank builds the full :class:`TinyTransformer` with
``case.build_model`` (same weights everywhere) and deletes what its stage does not own, so the
parameter names stay the reference's. Stage ``s`` of ``pp`` owns layers
``[s * L/pp, (s+1) * L/pp)``; the embedding (and positional table) lives on the first stage,
the final norm and the head on the last.

Loss and gradient scaling, as ``torch/distributed/pipelining/schedules.py`` does it: the
schedule splits the replica's batch into ``n_microbatches`` chunks along dim 0, computes
``loss_fn(output, target)`` (the case's *mean* loss) per micro-batch on the last stage and runs
backward on each one unscaled, so gradients accumulate the *sum* of the micro-batch gradients;
after the last backward ``perform_reduce_grad`` -> ``_PipelineStageBase.scale_grads`` divides
every gradient by ``n_microbatches`` (``scale_grads=True``). With equal micro-batches that is the
gradient of the replica's mean loss, i.e. the harness's ``case.loss_weight(n, dp) = 1/m``
weighting. Data parallelism (FSDP2 or DDP over the dp group) then averages over the replicas,
which gives the gradient of the mean loss over the global batch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import nn

from harness.parallel_dims import ParallelConfigError, ParallelDims
from harness.strategy import DistContextLike, RankSetup, StrategyBase
from reference.case import Batch, Case, CaseError

from ..models import TinyTransformer

__all__ = ["DP_MODES", "SCHEDULES", "PipelineStrategy", "balanced_stage_layers", "pipeline_stage_model"]

SCHEDULES = ("gpipe", "1f1b")
DP_MODES = ("fsdp", "ddp")


def balanced_stage_layers(num_layers: int, stage: int, num_stages: int) -> list[int]:
    """Layer indices of ``stage``: ``num_layers // num_stages`` consecutive layers each."""
    if num_stages < 1 or not 0 <= stage < num_stages:
        raise ParallelConfigError(f"stage {stage} is outside 0..{num_stages - 1}")
    if num_layers % num_stages:
        raise ParallelConfigError(f"layer count {num_layers} is not divisible by pp={num_stages}")
    per = num_layers // num_stages
    return list(range(stage * per, (stage + 1) * per))


def pipeline_stage_model(
    model: TinyTransformer, stage: int, num_stages: int, layers: Sequence[int] | None = None
) -> TinyTransformer:
    """Cut ``model`` (in place) down to pipeline stage ``stage`` of ``num_stages``: keep the
    blocks in ``layers`` (default: :func:`balanced_stage_layers`), the embedding only on the
    first stage and norm + head only on the last. Parameter names stay the full model's."""
    if not isinstance(model, TinyTransformer):
        raise TypeError(
            f"pipeline stages are cut from a cases.models.TinyTransformer (layers in an "
            f"nn.ModuleDict, optional embed/head); got {type(model).__name__}"
        )
    num_layers = len(model.layers)
    keep = set(balanced_stage_layers(num_layers, stage, num_stages) if layers is None else layers)
    unknown = sorted(i for i in keep if str(i) not in model.layers)
    if unknown:
        raise ParallelConfigError(f"stage {stage}: layers {unknown} do not exist (the model has {num_layers})")
    for key in list(model.layers.keys()):
        if int(key) not in keep:
            del model.layers[key]
    if stage != 0:
        model.embed = None
        model.pos = None
    if stage != num_stages - 1:
        model.norm = None
        model.head = None
    return model


def _stage_io_examples(
    full_model: TinyTransformer,
    stage: int,
    num_stages: int,
    stage_layers: Callable[[int, int, int], list[int]],
    example_input: torch.Tensor,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Example input and output of ``stage`` for ``PipelineStage``'s *static* metadata.

    Shapes come from running copies of stages ``0..stage`` of the (not yet parallelized) full
    model on the meta device: no compute, no RNG draw. Without static metadata
    ``PipelineStage`` infers it at the first ``step`` by running a real forward and an
    ``autograd.grad`` on each stage, which would draw dropout masks the reference never drew
    and run the DDP wrapper's forward outside the schedule."""
    num_layers = len(full_model.layers)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        meta_full = copy.deepcopy(full_model).to("meta")
        x = example_input.to("meta")
        for s in range(stage + 1):
            inp = x
            part = pipeline_stage_model(copy.deepcopy(meta_full), s, num_stages, stage_layers(num_layers, s, num_stages))
            x = part(inp)
    # Token ids into the first stage take no gradient; activations between stages do.
    example_in = torch.empty(inp.shape, dtype=inp.dtype, device=device).requires_grad_(inp.is_floating_point())
    example_out = torch.empty(x.shape, dtype=x.dtype, device=device).requires_grad_(True)
    return example_in, example_out


class PipelineStrategy(StrategyBase):
    """Pipeline parallelism over ``pp`` stages (one per pp rank) with a GPipe or 1F1B schedule.

    ``pp`` defaults to ``world_size // tp``; whatever is left of the world after ``tp * pp`` is
    data parallelism over replicas of the whole pipeline (``ParallelDims.for_world``). The case's
    ``micro_batches`` is the number of pipeline micro-batches per step; 1F1B needs at least
    ``pp`` of them. ``dp_mode`` picks how each stage's gradients are synchronized over its dp
    group when dp > 1: ``"fsdp"`` (FSDP2 ``fully_shard`` on the dp submesh, the only choice
    that composes with tensor parallelism) or ``"ddp"`` (``DistributedDataParallel`` with the
    dp process group).
    """

    def __init__(
        self,
        schedule: Literal["gpipe", "1f1b"] = "gpipe",
        *,
        pp: int | None = None,
        tp: int = 1,
        dp_mode: Literal["fsdp", "ddp"] = "fsdp",
    ):
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {schedule!r}; allowed: {', '.join(SCHEDULES)}")
        if dp_mode not in DP_MODES:
            raise ValueError(f"unknown dp_mode {dp_mode!r}; allowed: {', '.join(DP_MODES)}")
        for label, value in (("pp", pp), ("tp", tp)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ParallelConfigError(f"{label} must be a positive int, got {value!r}")
        if tp > 1 and dp_mode == "ddp":
            raise ParallelConfigError(
                "dp_mode='ddp' cannot be combined with tp > 1: DistributedDataParallel does not "
                "handle the DTensor parameters tensor parallelism creates; use dp_mode='fsdp'"
            )
        self.schedule = schedule
        self.pp = pp
        self.tp = tp
        self.dp_mode = dp_mode
        self.name = f"pipeline-{schedule}" + (f"-pp{pp}" if pp else "") + (f"-tp{tp}" if tp > 1 else "") + (
            f"-{dp_mode}" if dp_mode != "fsdp" else ""
        )

    def __repr__(self) -> str:
        return f"PipelineStrategy({self.schedule!r}, pp={self.pp}, tp={self.tp}, dp_mode={self.dp_mode!r})"

    # -- hooks a variant may override ---------------------------------------------------------

    def stage_layers(self, num_layers: int, stage: int, num_stages: int) -> list[int]:
        """The block indices stage ``stage`` owns (balanced by default)."""
        return balanced_stage_layers(num_layers, stage, num_stages)

    def build_schedule(
        self, stage: Any, n_microbatches: int, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ) -> Any:
        """The ``torch.distributed.pipelining`` schedule. ``scale_grads=True`` divides the
        accumulated gradients by ``n_microbatches`` because ``loss_fn`` is a mean per micro-batch."""
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        cls = ScheduleGPipe if self.schedule == "gpipe" else Schedule1F1B
        return cls(stage, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)

    # -- strategy ----------------------------------------------------------------------------

    def dims(self, world_size: int) -> ParallelDims:
        """The mesh degrees for ``world_size`` ranks (dp is what tp * pp leave)."""
        pp = self.pp if self.pp is not None else world_size // self.tp
        dims = ParallelDims.for_world(world_size, tp=self.tp, pp=max(pp, 1))
        if dims.pp < 2:
            raise ParallelConfigError(
                f"{self.name}: pipeline parallelism needs pp >= 2 stages, got pp={dims.pp} on "
                f"{world_size} ranks with tp={self.tp}"
            )
        return dims

    def check_case(self, case: Case, dims: ParallelDims) -> None:
        """Raise :class:`ParallelConfigError` for a case this pipeline cannot run."""
        if case.grad_clip is not None:
            raise CaseError(
                f"{self.name}: case {case.name!r} sets grad_clip={case.grad_clip}, but each stage holds only part "
                "of the gradients and this strategy does not reduce their norm across stages; clip in a custom loop"
            )
        if case.loss_fn is None or case.loss_reduction != "mean":
            raise CaseError(
                f"{self.name}: a pipeline computes the loss on its last stage with the case's loss_fn "
                f"as a mean per micro-batch; case {case.name!r} has loss_fn={case.loss_fn!r}, "
                f"loss_reduction={case.loss_reduction!r}"
            )
        sample = case.dataset[0]
        if not isinstance(getattr(sample, "input", None), torch.Tensor):
            raise CaseError(f"{self.name}: pipeline stages pass one tensor; case {case.name!r} has inputs of type "
                            f"{type(getattr(sample, 'input', sample)).__name__}")
        where = f"{self.name} on {dims}, case {case.name!r}"
        m = case.micro_batches
        if self.schedule == "1f1b" and m < dims.pp:
            raise ParallelConfigError(
                f"{where}: the 1F1B schedule needs micro_batches >= pp stages, got "
                f"micro_batches={m} < pp={dims.pp}; use transformer_case(micro_batches={dims.pp}) "
                "or more, or schedule='gpipe'"
            )
        if case.global_batch_size % (dims.dp * m):
            raise ParallelConfigError(
                f"{where}: global_batch_size {case.global_batch_size} is not divisible by "
                f"dp x micro_batches = {dims.dp} x {m}"
            )

    def setup(self, case: Case, ctx: DistContextLike) -> RankSetup:
        from torch.distributed.pipelining import PipelineStage

        dims = self.dims(ctx.world_size)
        self.check_case(case, dims)
        mesh = dims.build_mesh(ctx.device.type)
        coords = dims.coords(ctx.rank)
        stage_index, num_stages = coords["pp"], dims.pp

        model = case.build_model(ctx.device)
        if not isinstance(model, TinyTransformer):
            raise TypeError(
                f"{self.name}: case {case.name!r} builds a {type(model).__name__}; pipeline stages "
                "are cut from a cases.models.TinyTransformer"
            )
        dims.check_model(model.config)
        num_layers = len(model.layers)
        layers = self.stage_layers(num_layers, stage_index, num_stages)

        # Static stage metadata (see _stage_io_examples) for one per-replica micro-batch.
        micro = case.global_batch_size // (dims.dp * case.micro_batches)
        sample = case.dataset[0].input
        example = torch.zeros((micro, *sample.shape), dtype=case.dtype if sample.is_floating_point() else sample.dtype)
        input_args, output_args = _stage_io_examples(model, stage_index, num_stages, self.stage_layers, example, ctx.device)
        stage_model = pipeline_stage_model(model, stage_index, num_stages, layers)

        if dims.tp > 1:
            from .tp import apply_tensor_parallel

            stage_model = apply_tensor_parallel(stage_model, mesh["tp"])
        submodule: nn.Module = stage_model
        if dims.dp > 1:
            submodule = self._data_parallel(stage_model, mesh, ctx.device)

        stage = PipelineStage(
            submodule,
            stage_index,
            num_stages,
            ctx.device,
            input_args=input_args,
            output_args=output_args,
            group=mesh.get_group("pp"),
        )
        schedule = self.build_schedule(stage, case.micro_batches, case.loss_fn)
        layout = dims.layout(ctx.rank, stages=(stage_index,), num_stages=num_stages)
        return RankSetup(
            model=[submodule],
            optimizer=case.build_optimizer(submodule.parameters()),
            layout=layout,
            device=ctx.device,
            state={"stage": stage, "schedule": schedule, "mesh": mesh, "dims": dims, "layers": layers},
        )

    def _data_parallel(self, stage_model: nn.Module, mesh: Any, device: torch.device) -> nn.Module:
        """Synchronize a stage's gradients over its dp group.

        Both wrappers are ones ``PipelineStage`` knows how to drive: it runs every micro-batch's
        forward/backward with gradient sync off (DDP ``no_sync`` / FSDP2
        ``set_requires_gradient_sync(False)``) and syncs once per step: DDP's reducer all-reduces
        (averaging) during the last micro-batch's backward, FSDP2's reduce-scatter (averaging)
        runs in ``perform_reduce_grad`` just before ``scale_grads``. FSDP2 is the default
        because it also composes with tensor parallelism (its dp mesh and TP's tp mesh are
        submeshes of one world mesh), which DDP does not."""
        if self.dp_mode == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [device.index] if device.type == "cuda" else None
            return DistributedDataParallel(stage_model, device_ids=device_ids, process_group=mesh.get_group("dp"))
        from torch.distributed.fsdp import fully_shard

        dp_mesh = mesh["dp"]
        # Keep the unsharded parameters between the micro-batches' forwards and backwards
        # (torchtitan does the same under pipelining): one all-gather per step, not per chunk.
        for block in stage_model.layers.values():
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)
        fully_shard(stage_model, mesh=dp_mesh, reshard_after_forward=False)
        return stage_model

    def forward_backward(self, case: Case, setup: RankSetup, micro_batches: list[Batch]) -> list[torch.Tensor | None]:
        stage = setup.state["stage"]
        schedule = setup.state["schedule"]
        if len(micro_batches) != case.micro_batches:
            raise ValueError(
                f"{self.name}: got {len(micro_batches)} micro-batches, the schedule was built for "
                f"{case.micro_batches} (case.micro_batches)"
            )
        sizes = {len(b) for b in micro_batches}
        if len(sizes) != 1:
            raise ValueError(f"{self.name}: micro-batches must be equal for the pipeline's split, got sizes {sorted(sizes)}")
        # schedule.step splits the concatenated replica batch with torch.tensor_split along
        # dim 0 into n_microbatches equal chunks: exactly the micro-batches given here.
        args = (torch.cat([b.inputs for b in micro_batches]),) if stage.is_first else ()
        target = torch.cat([b.targets for b in micro_batches]) if stage.is_last else None
        losses: list[torch.Tensor] = []
        schedule.step(*args, target=target, losses=losses if stage.is_last else None, return_outputs=False)
        if not setup.layout.holds_loss:  # earlier stages, and tp ranks > 0 of the last stage
            return [None] * len(micro_batches)
        return [loss.detach() for loss in losses]

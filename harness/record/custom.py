"""Glue for custom parallel training loops: a few calls and the harness diagnoses your code.

A target file with your own loop defines ``CASE`` and ``train(ctx, run)``; the harness calls
``train`` on every rank with a :class:`CustomRun`. The lines marked ``# harness`` are all the
glue there is (see ``cases/custom_example.py`` for a complete file)::

    CASE = mlp_case()

    def train(ctx, run):
        model = CASE.build_model(ctx.device)                      # same weights on every rank
        opt = CASE.build_optimizer(model.parameters())
        run.watch(model, opt, RankLayout.data_parallel(ctx.rank, ctx.world_size))  # harness
        for step in range(run.steps):
            for batch in run.batches(step):                       # or your loader + batch ids
                loss = CASE.forward_loss(model, batch)
                (loss * run.loss_weight(batch)).backward()
                run.loss(step, loss, batch.ids)                   # harness
            my_gradient_sync(model)
            run.before_step(step)                                 # harness
            opt.step()
            run.after_step(step)                                  # harness
            opt.zero_grad()

Hand-sharded tensors (a plain tensor holding this rank's slice) are declared once with
``run.shard(param, dim=0, group=tp_group)`` (no group: the layout's "tp" group) so the harness
can gather them to full shape.

Framework loops (DeepSpeed, Fabric, accelerate) hand ``watch`` what the framework returns and
pass ``hook_step=True``: the harness records at the framework's own optimizer step, and the
loop uses :attr:`CustomRun.step` and :attr:`CustomRun.done` (README, "Framework loops";
:mod:`harness.record.frameworks`).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from reference.case import Batch, Case, collate, map_tensors
from reference.schedule import batch_weight, replica_micro_batch_indices

from harness.record.gather import annotate_shard, rename_parameters, set_layout_group

RECORDING_MARK = "harness.recording"  # the profiler annotation of the harness's own recording in a profiled loop
from harness.parallel_dims import RankLayout
from harness.record.recorder import RankRecorder, RecorderError

__all__ = ["CustomRun", "LoopEndedEarly"]


class LoopEndedEarly(RuntimeError):
    """A custom loop returned on a rank before it recorded every step of the case."""


class CustomRun:
    """The harness's side of a custom loop on one rank (all hooks are collective except
    :meth:`loss`, :meth:`batches` and :meth:`shard`)."""

    def __init__(
        self, case: Case, ctx: Any, record_path: str | os.PathLike[str] | None, *, dst: int = 0, tracer: Any = None,
        digests: bool = False, checkpoint: Any = None, checkpoint_glue: tuple[Any, Any] | None = None,
        probe_step: int = 0,
    ):
        # A harness.record.checkpoint.CheckpointPlan: save after step at-1, or resume from it;
        # checkpoint_glue: the target file's (save, load), else the harness's own save.
        self.checkpoint = checkpoint
        self.checkpoint_glue = checkpoint_glue
        self.optimizer: Any = None
        self.lr_scheduler: Any = None
        self.objects: dict[str, Any] = {}
        self.digests = digests  # RankRecorder's: each rank's local state bitwise, for --repeat
        self.tracer = tracer  # a harness.tracing.Tracer: samples, groups and collectives of the loop
        self._traced_step: int | None = None
        self.case = case
        self.ctx = ctx
        self.record_path = record_path
        self.dst = dst
        self.recorder: RankRecorder | None = None
        self.layout: RankLayout | None = None
        self.model: Any = None
        self.probe: Any = None  # harness.record.probe.ActivationProbe once watch() was called
        self.probe_step = probe_step  # the step whose first forward the probe keeps
        self._hooked_steps = 0  # optimizer steps seen by watch(hook_step=True)
        self._hook_step = False
        self.steps_done = 0  # steps recorded to the end (after_step calls)
        self._epoch_before_step: Any = None  # the watched scheduler's last_epoch at before_step
        # Set by a profiled run (harness.tracing.profiler.profile_loop): called at the end of
        # each after_step, where one step ends and the next begins; the harness's own recording
        # is then annotated "harness.recording", so the profile leaves it out.
        self.on_step_end: Callable[[int], None] | None = None

    @property
    def steps(self) -> int:
        return self.case.steps

    @property
    def start(self) -> int:
        """The first step this loop trains: 0, or the step a resumed run continues at (its
        checkpoint was loaded in :meth:`watch`). Loop over ``range(run.start, run.steps)``."""
        plan = self.checkpoint
        return plan.at if plan is not None and plan.resume else 0

    @property
    def step(self) -> int:
        """The step being trained now: the number of optimizer steps :meth:`watch`'s
        ``hook_step=True`` has seen (for loops that do not count their own)."""
        return self._hooked_steps

    @property
    def done(self) -> bool:
        """True once ``hook_step`` saw :attr:`steps` optimizer steps: stop the loop there."""
        return self._hooked_steps >= self.case.steps

    def watch(
        self,
        model: nn.Module | Sequence[nn.Module] | Any,
        optimizer: torch.optim.Optimizer | Any = None,
        layout: RankLayout | None = None,
        *,
        names: Mapping[str, str] | Callable[[str], str] | None = None,
        hook_step: bool = False,
        lr_scheduler: Any = None,
        objects: Mapping[str, Any] | None = None,
    ) -> None:
        """Collective: record ``model``/``optimizer`` from now on. ``layout`` says which
        data-parallel replica / pipeline stage / mesh coordinate this rank is (default: plain
        data parallelism over every rank). ``names``: where your parameter names differ from
        the reference model's, a mapping ``{"up_w": "up.weight"}`` or a function of the name
        (:func:`harness.record.gather.rename_parameters`).

        Framework objects are taken as the framework returns them: a wrapped module (DDP,
        Fabric, accelerate, compile, checkpoint wrappers), a wrapped optimizer, or a DeepSpeed
        engine alone (its ZeRO partitions read through DeepSpeed's own accessors).
        ``hook_step=True``: the harness records at the framework's own optimizer step (torch's
        step hooks; DeepSpeed's ZeRO step), so the loop calls neither :meth:`before_step` nor
        :meth:`after_step`; it passes :attr:`step` to :meth:`loss` and stops at :attr:`done`.

        For the resume check (``--resume-at K``): ``lr_scheduler`` (stepped by the loop before
        :meth:`after_step`, as the reference steps it right after the optimizer) is saved and restored with the
        model and optimizer (and compared by the load gate); ``objects`` (``{"loader": loader}``)
        are what a target's own ``save(ctx, run, path)`` / ``load(ctx, run, path)`` reach as
        ``run.objects``. A resumed run loads its checkpoint here, at the end of ``watch``: the
        loop then trains ``range(run.start, run.steps)``."""
        if self.recorder is not None:
            raise RecorderError("run.watch() was called twice; call it once, after building the model and optimizer")
        from harness.record.frameworks import hook_step as install_step_hooks
        from harness.record.frameworks import watched_objects

        handed = model
        model, optimizer, reader = watched_objects(model, optimizer)
        if optimizer is None:
            raise RecorderError("run.watch(model, optimizer, layout): give the optimizer (or a DeepSpeed engine, which holds it)")
        if names is not None:
            for module in [model] if isinstance(model, nn.Module) else list(model):
                rename_parameters(module, names)
        self.layout = layout or RankLayout.data_parallel(self.ctx.rank, self.ctx.world_size)
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.objects = dict(objects or {})
        # The activation probe, as for bundled strategies: module outputs of the first forward
        # (tp-partial-sum, dropout masks), collected after the run.
        from harness.record.probe import ActivationProbe

        self.probe = ActivationProbe(at_step=self.probe_step)
        self.probe.attach([model] if isinstance(model, nn.Module) else list(model))
        # The training RNG starts where the reference's does: from the case seed, after the
        # model was built (building it drew the initial weights from the same generator).
        torch.manual_seed(self.case.seed)
        if self.tracer is not None:
            self.tracer.describe(layout=self.layout, model=model)
            self.tracer.log_random_ops(True)  # until the first before_step: the rng-desync check
        with self._harness_phase():
            self.recorder = RankRecorder(
                self.record_path if self.ctx.rank == self.dst else None, self.case, model, optimizer, self.layout,
                source="custom", dst=self.dst, overwrite=True, reader=reader, digests=self.digests,
            )
        self._build_layout_groups()
        self._hook_step = hook_step
        if hook_step:
            install_step_hooks(handed, optimizer, self._hooked_before, self._hooked_after)
        if self.start:
            self._resume()
        self.recorder.start_draws()  # the loop's draws until before_step, for the reference to replay

    def _loop_checkpoint(self) -> Any:
        from harness.record.checkpoint import LoopCheckpoint

        return LoopCheckpoint(self, self.checkpoint.path, self.checkpoint_glue)

    def _resume(self) -> None:
        """Collective: load the checkpoint into the watched objects, then record the loaded
        state as step ``start - 1`` (what the load gate compares with the saving run)."""
        from reference.record import Record

        from harness.record.checkpoint import load_checkpoint

        assert self.recorder is not None
        plan, state = self.checkpoint, self._loop_checkpoint()
        with self._harness_phase():
            loaded = load_checkpoint(plan.path, self.case, state, state)
            saved = Record.load(plan.saved_record) if self.ctx.rank == self.dst and plan.saved_record else None
            self.recorder.resumed(saved, plan.at, loaded)
        self._hooked_steps = self.steps_done = plan.at

    def _save_if_due(self, step: int) -> None:
        plan = self.checkpoint
        if plan is None or plan.resume or step + 1 != plan.at:
            return
        from harness.record.checkpoint import save_checkpoint

        state = self._loop_checkpoint()
        with self._harness_phase():
            save_checkpoint(plan.path, self.case, state, state, at=plan.at)

    def _check_scheduler_stepped(self, step: int) -> None:
        """The watched lr scheduler has stepped for ``step`` already: the reference records (and
        a checkpoint saves) the lr of the next step, as after ``optimizer.step(); scheduler.step()``.
        Said only where both hold: it did not step since :meth:`before_step` (so the order is
        seen, not inferred from a count a resumed loop may have fast-forwarded wrongly, which is
        the load gate's to name) and its count is the step's."""
        epoch = getattr(self.lr_scheduler, "last_epoch", None)
        stepped = epoch != self._epoch_before_step
        if isinstance(epoch, int) and epoch == step and not stepped and not self._hook_step:  # a step hook runs before any scheduler
            raise RecorderError(f"run.after_step({step}): the watched lr scheduler has not stepped for step {step} yet "
                                f"(its last_epoch is {epoch}). The case's schedule, like the reference, steps it once after "
                                "every optimizer step, and the harness records (and saves checkpoints) after the whole "
                                "update; call optimizer.step(), lr_scheduler.step(), then run.after_step(step)")

    def _check_resumed_step(self, step: int, hook: str) -> None:
        if step < self.start:
            raise RecorderError(f"run.{hook}(step {step}) in a run resumed at step {self.start}: the checkpoint of step "
                                f"{self.start - 1} was loaded in run.watch, so the loop trains range(run.start, run.steps)")

    def _hooked_before(self) -> None:
        if not self.done:
            self.before_step(self._hooked_steps)

    def _hooked_after(self) -> None:
        if not self.done:
            self.after_step(self._hooked_steps)
            self._hooked_steps += 1

    def _build_layout_groups(self) -> None:
        """Collective: the process groups of the layout's "tp" dim, for shards declared
        without a group (every rank takes part; each keeps its own)."""
        assert self.recorder is not None
        groups = [tuple(entry["groups"]["tp"]) for entry in self.recorder.layouts if "tp" in entry.get("groups", {})]
        if len(groups) != len(self.recorder.layouts) or all(len(g) == 1 for g in groups):
            return
        import torch.distributed as dist

        mine, _ = dist.new_subgroups_by_enumeration([list(g) for g in dict.fromkeys(groups)])
        set_layout_group("tp", mine)

    def _harness_phase(self) -> Any:
        import contextlib

        phase = self.tracer.phase("harness") if self.tracer is not None else contextlib.nullcontext()
        if self.on_step_end is None:
            return phase
        from torch.profiler import record_function

        stack = contextlib.ExitStack()
        stack.enter_context(phase)
        stack.enter_context(record_function(RECORDING_MARK))
        return stack

    def _step(self, step: int) -> None:
        if self.tracer is not None and self._traced_step != step:
            self._traced_step = step
            self.tracer.begin_step(step)
            self.tracer.set_phase("train")

    def _rec(self, hook: str) -> RankRecorder:
        if self.recorder is None:
            raise RecorderError(f"run.{hook}() before run.watch(model, optimizer, layout): call watch first")
        return self.recorder

    def batches(self, step: int, device: torch.device | None = None) -> list[Batch]:
        """This rank's micro-batches of ``step`` as ``DistributedSampler`` would shard them
        over the layout's data-parallel replicas (use your own loader if you prefer; then pass
        its sample ids to :meth:`loss`)."""
        layout = self.layout or RankLayout.data_parallel(self.ctx.rank, self.ctx.world_size)
        self._batches_step = step
        batches = [
            collate(self.case.dataset, idx, device=device or self.ctx.device, dtype=self.case.dtype, step=step)
            for idx in replica_micro_batch_indices(self.case, step, layout.dp_rank, layout.dp_size)
        ]
        if self.probe is not None and step == self.probe.at_step and batches and self.probe.input is None:
            # The probe replays the reference on the input of the first forward, this one.
            self.probe.keep_batch(batches[0])
        return batches

    def loss_weight(self, batch: Batch | int, *, grad_reduction: str = "mean", step: int | None = None) -> float:
        """The factor on a micro-batch's loss (as ``CASE.loss_fn`` returns it: see
        ``Case.loss_reduction``) that makes the gradients, once averaged (``grad_reduction=
        "mean"``) or summed (``"sum"``) over the layout's replicas, equal those of the
        global-batch mean (see :meth:`reference.case.Case.batch_weight`). With a case
        ``loss_normaliser`` (a token count) the share is the batch's count over the step's,
        which the harness computes from the dataset: the glue stays the same."""
        layout = self.layout or RankLayout.data_parallel(self.ctx.rank, self.ctx.world_size)
        if isinstance(batch, int):
            return self.case.loss_weight(batch, layout.dp_size, grad_reduction=grad_reduction)
        if batch.step is None and step is None:
            step = getattr(self, "_batches_step", None)
        return batch_weight(self.case, batch, layout.dp_size, grad_reduction=grad_reduction, step=step)

    def loss(
        self, step: int, loss: torch.Tensor | float | None, sample_ids: Sequence[int], *, normaliser: float | None = None
    ) -> None:
        """Local: this rank consumed ``sample_ids`` in its next micro-batch, with ``loss`` the
        unweighted loss over them as ``CASE.loss_fn`` returns it (None on ranks that compute
        no loss). ``normaliser``: what that loss is a mean over (its valid tokens), by which the
        harness combines the replicas' and micro-batches' pieces; default the case's
        ``loss_normaliser`` of those samples, else their number."""
        self._check_resumed_step(step, "loss")
        if normaliser is None and self.case.loss_normaliser is not None:
            normaliser = self.case.normaliser(self.case.collate_ids(sample_ids, step=step))
        self._rec("loss").micro_batch(step, loss, sample_ids, normaliser)
        probe = self.probe
        if probe is not None and step == probe.at_step and probe.input is not None and probe.loss is None:
            if probe.ids is None:  # the input came from the forward itself: what samples it should hold
                probe.ids = [int(i) for i in sample_ids]
                try:
                    expected = self.case.collate_ids(sample_ids, step=step)
                except Exception:  # noqa: BLE001 - ids the case's dataset cannot collate: nothing to compare, the loop goes on
                    expected = None
                    probe.missing = f"the samples {probe.ids[:6]} named in run.loss are not ids of the case's dataset"
                if expected is not None:
                    probe.expected_input = map_tensors(lambda t: t.detach().cpu().clone(), expected.inputs)
                    # The loss and the backward are replayed on these samples' targets, as the
                    # case's dataset holds them (the loop's own loader gave the model their inputs).
                    probe.targets = map_tensors(lambda t: t.detach().cpu().clone(), expected.targets)
                    if isinstance(loss, torch.Tensor):
                        probe.keep_loss(loss)
            elif [int(i) for i in sample_ids] == probe.ids and isinstance(loss, torch.Tensor):
                probe.keep_loss(loss)  # the probed micro-batch's loss: replayed against the reference's
        self._step(step)
        if self.tracer is not None:
            self.tracer.record_samples(step, sample_ids)

    def shard(self, tensor: torch.Tensor, dim: int, group: Any = None, **kwargs: Any) -> torch.Tensor:
        """Declare a hand-sharded tensor: this rank holds its slice along ``dim`` among the
        ranks of ``group`` (in group-rank order); without a group (or mesh), the layout's
        ``"tp"`` group, which :meth:`watch` builds."""
        if group is None and kwargs.get("mesh") is None:
            group = "tp"
        return annotate_shard(tensor, dim=dim, group=group, **kwargs)

    def before_step(self, step: int) -> None:
        """Collective: call just before ``optimizer.step()`` (records full gradients)."""
        rec = self._rec("before_step")
        self._check_resumed_step(step, "before_step")
        self._step(step)
        if self.probe is not None:
            self.probe.end_loss_log()  # the probe's op log sits above the draw logs: the modes are a stack
        rec.stop_draws()  # inside the tracer's log: the modes are a stack
        if self.tracer is not None:
            self.tracer.log_random_ops(False)
        if self.probe is not None and step >= self.probe.at_step:
            self.probe.detach()
        with self._harness_phase():
            rec.grads(step)
        self._epoch_before_step = getattr(self.lr_scheduler, "last_epoch", None)

    def after_step(self, step: int) -> None:
        """Collective: call just after ``optimizer.step()`` (parameters, optimizer state)."""
        rec = self._rec("after_step")
        if self.probe is not None and step + 1 == self.probe.at_step:
            self.probe.armed = True  # the probed step's first forward comes next
        self._check_scheduler_stepped(step)
        with self._harness_phase():
            rec.after_step(step)
        self._save_if_due(step)
        self.steps_done += 1
        rec.start_draws()  # the next step's
        if self.tracer is not None:
            self.tracer.set_phase("train")
        if self.on_step_end is not None:
            self.on_step_end(step)

    def check_ran_every_step(self, train: Any) -> None:
        """Local, after the loop returned: it recorded every step of the case on this rank.
        A loop that returns early on one rank leaves the others waiting in the next step's
        collectives; said here, as this rank's exit, before any collective of the harness."""
        if self.recorder is None or self.steps_done >= self.case.steps:
            return
        code = getattr(inspect.unwrap(train), "__code__", None)
        where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
        name = getattr(train, "__name__", "train")
        raise LoopEndedEarly(
            f"{name}{where} returned on rank {self.ctx.rank} after {self.steps_done} of the case's {self.case.steps} "
            "steps; a loop runs run.steps steps on every rank (loop over range(run.steps), or stop at run.done)"
        )

    def stop_draws(self) -> None:
        """Local: stop logging the loop's random draws (the loop ended, or raised)."""
        if self.probe is not None:
            self.probe.end_loss_log()
        if self.recorder is not None:
            self.recorder.stop_draws()

    def finish(self, *, complete: bool = True) -> Any:
        if self.recorder is None:
            raise RecorderError("the custom train function never called run.watch(model, optimizer, layout)")
        if self.probe is not None:
            self.probe.end_loss_log()
        self.recorder.stop_draws()
        return self.recorder.finish(complete=complete)

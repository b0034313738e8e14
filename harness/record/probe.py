"""Activation probe: module outputs of the first forward, on every rank, against the reference.

Gradients tell *that* a forward was wrong; module outputs tell *where*. The probe wraps a
strategy (:class:`ProbedStrategy`), hooks every submodule during the first micro-batch of step
0, and keeps each module's local output (plus the inputs of dropout modules). After the run the
ranks send their captures to one rank (:func:`collect_probe`), which replays the reference
model - same weights, same step-0 state - on each rank's own input and compares module by
module (:func:`harness.analysis.probe_checks.analyze_probe`):

- a module whose output on every rank of a tensor-parallel group differs from the reference,
  while the *sum* over the group equals it, is a row-parallel output used without its
  all-reduce: ``tp-partial-sum``;
- a dropout module whose inputs agree across a tensor-parallel group but whose outputs
  (masks) differ: ``rng-desync``.

The same first forward is also logged op by op (:class:`OpLog`, a dispatch mode entered by
the root module's forward pre-hook and left by its post-hook): each op's output with the
module it ran in and, for a DTensor, its placements - the mode sits above DTensor's own
dispatch, so it sees the DTensor-level op and output, not the local ops inside. Where the run
departs (:mod:`harness.analysis.divergence`) aligns these with the reference's op log.

Only tensors up to ``max_numel`` elements are kept; the probe is for the small models of
correctness tests, not for production-size activations.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from reference.record import is_dtensor
from reference.case import Batch, Case, map_tensors

from harness.frames import call_site
from harness.record.gather import reference_name

__all__ = ["GRAD_MARKER", "LOSS", "OUTPUT", "ActivationProbe", "BackwardLog", "DecomposedOpLog", "OpCapture", "OpLog", "ProbeData", "ProbedStrategy", "collect_probe", "loss_op_log", "op_log", "probe_entry"]

OUTPUT = "<output>"  # capture name of the whole model's output
# The module of the ops a rank runs after its model's forward and before its backward: the loss
# computed outside the model (a vocab-parallel cross entropy written by hand), logged on until
# the backward's first op; the reference's own loss is logged with its composite ops decomposed.
LOSS = "<loss>"


def _tensors_depth_first(value: Any, depth: int = 0) -> Any:
    if isinstance(value, torch.Tensor):
        yield value
    elif depth <= 4:
        items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (tuple, list)) else ()
        for item in items:
            yield from _tensors_depth_first(item, depth + 1)


def first_tensor(value: Any) -> Any:
    """The activation a module's output carries: its first tensor with more than one element,
    depth first through tuples, lists and mappings, else its first tensor; None when there is
    none. A Hugging Face ``ModelOutput`` given labels starts with the scalar ``loss``, which at
    initialisation is near log(vocab) whatever the logits are, so it would hide a wrong
    forward: its ``logits`` are taken instead."""
    first = None
    for t in _tensors_depth_first(value):
        if t.numel() > 1:
            return t
        first = t if first is None else first
    return first


def module_outputs(
    model: nn.Module, call: Any, *, dtype: torch.dtype, whole: str | None = None,
    grads: dict[str, torch.Tensor] | None = None, backward: "BackwardLog | None" = None,
) -> tuple[dict[str, torch.Tensor], Any]:
    """Each named submodule's first activation (:func:`first_tensor`) of one forward,
    ``call()``, detached and cast to ``dtype``; with ``whole``, the model's own output under
    that name too. With ``grads``, each of those activations that requires grad gets a hook
    that keeps its gradient there (in the order they arrive) when a backward runs through it,
    and - with ``backward`` - marks its arrival in that log, which is attached to the model's
    output. Returns the activations and what ``call`` returned."""
    outs: dict[str, torch.Tensor] = {}
    handles = []

    def keep(name: str, t: torch.Tensor) -> None:
        outs[name] = t.detach().to(dtype).clone()
        if grads is not None and t.requires_grad:

            def grad_hook(g: torch.Tensor) -> None:
                if name not in grads and backward is not None:
                    backward.marker(name)
                grads.setdefault(name, g.detach().to(dtype).clone())

            t.register_hook(grad_hook)

    for name, module in model.named_modules():
        if not name:
            continue

        def hook(module: nn.Module, args: tuple, output: Any, name: str = name) -> None:
            t = first_tensor(output)
            if t is not None and name not in outs:
                keep(name, t)

        handles.append(module.register_forward_hook(hook))
    if whole is not None:

        def whole_hook(module: nn.Module, args: tuple, output: Any) -> None:
            t = first_tensor(output)
            if t is not None and whole not in outs:
                keep(whole, t)
                if backward is not None and grads is not None and t.requires_grad:
                    backward.attach(t)

        handles.append(model.register_forward_hook(whole_hook))
    try:
        result = call()
    finally:
        for h in handles:
            h.remove()
    return outs, result


@dataclass(eq=False)  # identity: logs are searched with list.index, and two outputs' tensors have no one truth value
class OpCapture:
    """One op of a logged forward: its output (the local tensor, cast to float32 on the CPU)."""

    module: str  # the innermost module it ran in, reference name ("" for the model's own forward)
    op: str  # the overload, e.g. "aten.addmm.default"
    output: torch.Tensor | None  # None for a collective: kept as a marker of where it ran, not compared
    placements: str | None = None  # DTensor placements of the output, None for plain tensors
    draws: bool = False  # it drew from the generator (a dropout's mask; attention with dropout_p > 0)
    site: str = ""  # the innermost frame outside torch and the harness that ran it: "file:line in fn"


# Ops that move, alias or allocate values without computing any: they cannot be where values
# depart, and a layout change between the parallel run and one device would only misalign the
# logs. Views are recognised by their schema (``OpOverload.is_view``); collectives (the
# functional and c10d namespaces) are redistributions, not computation.
_LAYOUT_OPS = frozenset({
    "detach", "alias", "clone", "copy_", "_to_copy", "contiguous", "_unsafe_view", "lift_fresh", "lift_fresh_copy",
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros", "zeros_like", "new_zeros",
    "ones", "ones_like", "new_ones", "full", "full_like", "new_full", "scalar_tensor", "_local_scalar_dense",
    "arange", "set_", "resize_", "as_strided_", "split_with_sizes_copy", "stack", "cat", "to",
})
_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "_c10d_functional_autograd", "c10d", "c10d_functional", "_dtensor"})


def _is_layout_op(func: Any) -> bool:
    if getattr(func, "is_view", False):
        return True
    return func.overloadpacket.__name__ in _LAYOUT_OPS


class OpLog(TorchDispatchMode):
    """A dispatch mode that keeps every computing op's first floating-point output, with the
    innermost module it ran in (``stack`` is kept by :func:`track_modules`' hooks). Outputs
    over ``max_numel`` elements, and every op once ``budget`` elements are kept, are skipped."""

    def __init__(self, stack: list[str], *, max_numel: int = 1 << 20, budget: int = 1 << 21):
        super().__init__()
        self.stack = stack
        self.max_numel = max_numel
        self.budget = budget
        self.ops: list[OpCapture] = []
        self.skipped = 0
        self.paused = 0  # > 0 while the harness's own hooks run inside the logged forward
        # Set once the model's forward returned: the ops that follow are the loss's (module
        # ``region``) until the backward's first op ends the log (``ended``: ops pass through).
        self.region: str | None = None
        self.ended = False

    def _module(self) -> str:
        return self.region if self.region is not None else (self.stack[-1] if self.stack else "")

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.region is not None and not self.ended and torch._C._current_autograd_node() is not None:
            self.ended = True  # the backward began: the loss is computed
        out = func(*args, **(kwargs or {}))
        if self.paused or self.ended:
            return out
        if getattr(func, "namespace", "aten") in _COLLECTIVE_NAMESPACES:
            self.ops.append(OpCapture(self._module(), str(func), None, site=call_site()))
        elif not _is_layout_op(func):
            try:
                self._keep(func, out, args, kwargs)
            except Exception:  # noqa: BLE001 - a value the log cannot copy (a tensor subclass it does not know) is skipped, never the model's failure
                self.skipped += 1
        return out

    def _keep(self, func: Any, out: Any, args: tuple = (), kwargs: dict | None = None) -> None:
        from torch._subclasses.fake_tensor import FakeTensor

        from reference.draws import random_output

        t = first_tensor(out)
        if t is None or not t.is_floating_point() or isinstance(t, FakeTensor):
            return
        if t.numel() > self.max_numel or t.numel() > self.budget:
            self.skipped += 1
            return
        placements = None
        if is_dtensor(t):
            placements = str(tuple(t.placements))
            t = t.to_local()
        self.budget -= t.numel()
        draws = torch.Tag.nondeterministic_seeded in func.tags and random_output(func, args, kwargs, out) is not False
        self.ops.append(OpCapture(self._module(), str(func), t.detach().float().cpu().clone(), placements, draws, call_site()))


# The reference's loss is logged with its composite ops decomposed into the ops a hand-written
# loss is made of (log_softmax as amax, sub, exp, sum, log, sub; nll_loss as gather, neg, sum,
# div), so a parallel loss written from those ops aligns with it op by op.
_LOSS_DECOMPOSED = ("_log_softmax", "_softmax", "logsumexp", "nll_loss_forward", "nll_loss2d_forward", "mse_loss",
                    "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits")


class DecomposedOpLog(OpLog):
    """An :class:`OpLog` that runs the loss functions' composite ops by their decompositions
    (``torch._decomp``), logging the ops they are made of."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        from torch._decomp import decomposition_table

        packet = getattr(func, "overloadpacket", None)
        decomposition = decomposition_table.get(func) if getattr(packet, "__name__", "") in _LOSS_DECOMPOSED else None
        if decomposition is not None:
            with self:  # the decomposition's own ops come back through this mode
                return decomposition(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def loss_op_log(call: Callable[[], Any], *, decompose: bool = True) -> list[OpCapture]:
    """The ops of one loss computation ``call()`` (no autograd), each with module :data:`LOSS`;
    with ``decompose`` its composite ops decomposed (:class:`DecomposedOpLog`)."""
    log = DecomposedOpLog([]) if decompose else OpLog([])
    log.region = LOSS
    with torch.no_grad(), log:
        call()
    return log.ops


def track_modules(models: list[nn.Module], stack: list[str]) -> list[Any]:
    """Forward pre- and post-hooks that keep ``stack`` the reference names of the modules
    running now (innermost last); the post-hook runs on an exception too. Returns the handles."""
    handles = []
    for model in models:
        for raw, module in model.named_modules():
            if module is model or not raw:
                continue
            name = reference_name(model, raw)

            def enter(module: nn.Module, args: tuple, name: str = name) -> None:
                stack.append(name)

            def leave(module: nn.Module, args: tuple, output: Any) -> None:
                if stack:
                    stack.pop()

            handles.append(module.register_forward_pre_hook(enter))
            handles.append(module.register_forward_hook(leave, always_call=True))
    return handles


def op_log(model: nn.Module, call: Any) -> tuple[list[OpCapture], Any]:
    """The op log (:class:`OpLog`) of one forward of ``model``, ``call()``; returns the ops and
    what ``call`` returned."""
    stack: list[str] = []
    handles = track_modules([model], stack)
    log = OpLog(stack)
    try:
        with log:
            result = call()
    finally:
        for h in handles:
            h.remove()
    return log.ops, result


GRAD_MARKER = "<gradient of the output>"  # a BackwardLog event: module ``module``'s output gradient arrived


class BackwardLog:
    """The backward of one forward, node by node: a post-hook on every autograd node reachable
    from the output keeps the gradient it passes on along the activation path (to an input
    that is not a parameter), as an :class:`OpCapture` named by the node (``AddmmBackward0``,
    a custom Function's ``...Backward``); :meth:`marker` puts in the arrival of a module
    output's gradient, so that a stretch between two modules' gradients can be aligned with
    the reference's. No autograd node is changed: the hooks return nothing. The first call of
    each node only (a second backward through a retained graph is not logged); nodes over
    ``max_nodes``, and outputs once ``budget`` elements are kept, are skipped."""

    def __init__(self, *, max_numel: int = 1 << 20, budget: int = 1 << 21, max_nodes: int = 20000):
        self.events: list[OpCapture] = []
        self.max_numel, self.budget, self.max_nodes = max_numel, budget, max_nodes
        self._seen: set[int] = set()

    def marker(self, name: str) -> None:
        self.events.append(OpCapture(name, GRAD_MARKER, None))

    def attach(self, output: torch.Tensor) -> None:
        """Hook every node of ``output``'s graph (call after the forward, before the backward)."""
        start = getattr(output, "grad_fn", None)
        todo, hooked = [start] if start is not None else [], set()
        while todo and len(hooked) < self.max_nodes:
            node = todo.pop()
            if node is None or id(node) in hooked or type(node).__name__ == "AccumulateGrad":
                continue
            hooked.add(id(node))
            try:
                node.register_hook(self._hook(node))
            except Exception:  # noqa: BLE001 - a node that takes no hook is not logged
                continue
            todo += [n for n, _ in node.next_functions if n is not None]

    def _hook(self, node: Any) -> Callable[..., None]:
        name = node.name()
        # Which of the gradients the node passes on go to an activation (not a parameter's
        # AccumulateGrad, not a constant): the first such is the one compared.
        to_activation = [n is not None and type(n).__name__ != "AccumulateGrad" for n, _ in node.next_functions]

        def hook(grad_inputs: tuple, grad_outputs: tuple) -> None:
            if id(node) in self._seen:
                return
            self._seen.add(id(node))
            try:
                grad = next((g for g, a in zip(grad_inputs, to_activation) if a and isinstance(g, torch.Tensor)), None)
                if grad is None or not grad.is_floating_point():
                    return
                placements = None
                if is_dtensor(grad):
                    placements = str(tuple(grad.placements))
                    grad = grad.to_local()
                if grad.numel() > self.max_numel or grad.numel() > self.budget:
                    return
                self.budget -= grad.numel()
                self.events.append(OpCapture("", name, grad.detach().float().cpu().clone(), placements))
            except Exception:  # noqa: BLE001 - a gradient the log cannot copy is skipped, never the backward's failure
                pass

        return hook


@dataclass
class Capture:
    module_type: str
    output: torch.Tensor
    placements: str | None = None  # DTensor placements of the output, None for plain tensors
    replicated: bool = True  # a DTensor output whose placements are all Replicate, or a plain tensor
    input: torch.Tensor | None = None  # kept for dropout modules only
    p: float | None = None  # dropout probability
    # The gradient of the output in this rank's backward (the local tensor) and its placements:
    # where a backward departs, compared with the reference's (harness.analysis.divergence).
    grad: torch.Tensor | None = None
    grad_placements: str | None = None
    training: bool = True  # the module's mode in this forward (the reference trains every module)


class ActivationProbe:
    """Forward hooks that keep the first output of every submodule (call :meth:`attach`
    before the forward, :meth:`detach` after)."""

    def __init__(self, max_numel: int = 1 << 20, at_step: int = 0):
        self.max_numel = max_numel
        # The step whose first micro-batch is probed; the hooks keep nothing until it is armed
        # (step 0: from the start; a later step: by its loop, once the step before it ended).
        self.at_step = at_step
        self.armed = at_step == 0
        self.captures: dict[str, Capture] = {}
        self.order: list[str] = []
        self.input: torch.Tensor | None = None
        # The same micro-batch's targets, sample ids and this rank's loss on it (as the case's
        # loss_fn returns it; None where the rank computes none): the loss is replayed too.
        self.targets: Any = None
        self.ids: list[int] | None = None
        self.loss: torch.Tensor | None = None
        # The collated samples of ``ids`` when the input was taken from the forward itself (a
        # loop with its own loader): an input that is not those samples departs before the model.
        self.expected_input: Any = None
        # Why the probed micro-batch cannot be replayed, where it cannot (said with the verdict).
        self.missing = ""
        # What the first forward itself received: for a later pipeline stage, the activation the
        # stage before sent (compared with that stage's output on the same micro-batch).
        self.forward_input: Any = None
        self.ops: list[OpCapture] = []  # the first forward's op log (a single model only)
        self.grad_order: list[str] = []  # modules whose output's gradient arrived, in backward order
        self.backward = BackwardLog(max_numel=max_numel)  # the probed forward's backward, node by node
        self._handles: list[Any] = []
        self._stack: list[str] = []
        self._log: OpLog | None = None
        self._logged = False

    def attach(self, models: list[nn.Module]) -> None:
        if len(models) == 1 and not self._logged:
            # The op log covers the root's first forward: entered by its pre-hook (registered
            # first, so it runs before the capture hooks' own) and left by its post-hook,
            # which runs on an exception too: a mode must never outlive the forward it logs.
            self._handles += track_modules(models, self._stack)
            self._handles.append(models[0].register_forward_pre_hook(self._start_log, with_kwargs=True))
            self._handles.append(models[0].register_forward_hook(self._stop_log, always_call=True))
        for i, model in enumerate(models):
            for raw, module in model.named_modules():
                if module is model or not raw:
                    continue
                name = reference_name(model, raw)
                self._handles.append(module.register_forward_hook(self._hook(name)))
            if len(models) == 1:  # the model's own output (pipeline chunks have none of their own)
                self._handles.append(model.register_forward_hook(self._hook(OUTPUT)))

    def _keeping(self) -> bool:
        """Armed, and in a training forward: a forward without autograd (a validation pass
        between two steps, a sanity check before the first) is not the step's."""
        return self.armed and torch.is_grad_enabled()

    def _start_log(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.end_loss_log()  # another forward: the loss of the first one is computed
        if self._logged or self._log is not None or not self._keeping():
            return
        given = dict(kwargs) if kwargs and not args else (args[0] if len(args) == 1 and not kwargs else tuple(args))
        try:
            self.forward_input = map_tensors(lambda t: (t.to_local() if is_dtensor(t) else t).detach().cpu().clone(), given)
        except Exception:  # noqa: BLE001 - an input the probe cannot copy: no replay, the run goes on
            self.forward_input = None
        if self.input is None:  # a loop that reads its own batches: the forward's own input
            self.input = self.forward_input
        self._log = OpLog(self._stack, max_numel=self.max_numel)
        self._log.__enter__()

    def _stop_log(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._log is None or self._log.region is not None:
            return
        # The forward returned: the mode stays for the loss computed from its output (module
        # LOSS) until the backward's first op; it is left where the harness next runs
        # (end_loss_log: the next forward, run.before_step, the strategy's forward_backward).
        self._log.region = LOSS
        self.ops, self._logged = self._log.ops, True

    def end_loss_log(self) -> None:
        """Leave the op log that went on past the forward for its loss. A dispatch mode is a
        stack: one the user entered after the forward and has not left yet stays above it,
        so the log only stops logging then and is left at a later call (or :meth:`detach`)."""
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        log = self._log
        if log is None or log.region is None:
            return
        log.ended = True
        if _get_current_dispatch_mode() is log:
            self._log = None
            log.__exit__(None, None, None)

    def _hook(self, name: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if name in self.captures or not self._keeping():
                return
            log = self._log
            if log is not None:  # the probe's own copies are not the model's ops
                log.paused += 1
            try:
                keep(module, args, output)
            finally:
                if log is not None:
                    log.paused -= 1

        def keep(module: nn.Module, args: tuple, output: Any) -> None:
            out = first_tensor(output)
            if out is None or out.numel() > self.max_numel:
                return
            placements = None
            replicated = True
            if is_dtensor(out):
                placements = str(tuple(out.placements))
                replicated = all(type(p).__name__ == "Replicate" for p in out.placements)
                out = out.to_local()
            cap = Capture(type(module).__name__, out.detach().float().cpu().clone(), placements, replicated,
                          training=bool(module.training))
            if isinstance(module, nn.modules.dropout._DropoutNd):
                inp = first_tensor(args)
                if inp is not None:
                    inp = inp.to_local() if is_dtensor(inp) else inp
                    cap.input = inp.detach().float().cpu().clone()
                cap.p = float(module.p)
            self.captures[name] = cap
            self.order.append(name)
            original = first_tensor(output)
            if original is not None and original.requires_grad and torch.is_grad_enabled():
                original.register_hook(self._grad_hook(name, cap))
                if name == OUTPUT:
                    self.backward.attach(original)

        return hook

    def _grad_hook(self, name: str, cap: Capture) -> Callable[[torch.Tensor], None]:
        """A tensor hook that keeps the first gradient of ``name``'s output (its arrival order
        too); it never changes the gradient nor fails the user's backward."""

        def hook(grad: torch.Tensor) -> None:
            if cap.grad is not None:
                return
            try:
                placements = None
                if is_dtensor(grad):
                    placements = str(tuple(grad.placements))
                    grad = grad.to_local()
                if grad.numel() <= self.max_numel:
                    cap.grad, cap.grad_placements = grad.detach().float().cpu().clone(), placements
                    self.grad_order.append(name)
                    self.backward.marker(name)
            except Exception:  # noqa: BLE001 - a gradient the probe cannot copy is skipped
                pass

        return hook

    def keep_batch(self, batch: Batch) -> None:
        """The probed micro-batch: the reference is replayed on its inputs and targets."""
        self.input = map_tensors(lambda t: t.detach().cpu().clone(), batch.inputs)
        self.targets = map_tensors(lambda t: t.detach().cpu().clone(), batch.targets)
        self.ids = [int(i) for i in batch.ids]

    def keep_loss(self, loss: Any) -> None:
        """This rank's loss on the probed micro-batch (None: it computes none)."""
        if self.loss is not None or not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return
        if is_dtensor(loss):  # only a replicated loss is this rank's whole value
            if not all(type(p).__name__ == "Replicate" for p in loss.placements):
                return
            loss = loss.to_local()
        self.loss = loss.detach().float().cpu().clone().reshape(())

    def detach(self) -> None:
        self.end_loss_log()
        if self._log is not None and self._log.region is None:  # a forward that never finished: no half log
            log, self._log = self._log, None
            log.__exit__(None, None, None)
        # (A loss log under a mode the user entered after the forward and still holds stays
        # on the stack, passing every op through: leaving it would pop the user's mode.)
        for h in self._handles:
            h.remove()
        self._handles.clear()


class ProbedStrategy:
    """Wraps a strategy; probes the first micro-batch of its first forward/backward. Behaves
    exactly like the wrapped strategy otherwise (same name, same steps)."""

    def __init__(self, inner: Any, probe: ActivationProbe | None = None, at_step: int = 0):
        self.inner = inner
        self.name = inner.name
        self.probe = probe or ActivationProbe(at_step=at_step)
        self.layout: Any = None
        self._done = False
        self._step = 0  # the step whose batches were asked for last

    def setup(self, case: Case, ctx: Any) -> Any:
        setup = self.inner.setup(case, ctx)
        self.layout = setup.layout
        return setup

    def local_batches(self, case: Case, setup: Any, step: int) -> list[Batch]:
        self._step = step
        return self.inner.local_batches(case, setup, step)

    def forward_backward(self, case: Case, setup: Any, micro_batches: list[Batch]) -> list[Any]:
        if self._done or not micro_batches or self._step != self.probe.at_step:
            return self.inner.forward_backward(case, setup, micro_batches)
        self._done = True
        self.probe.armed = True
        models = [setup.model] if isinstance(setup.model, nn.Module) else list(setup.model)
        self.probe.keep_batch(micro_batches[0])
        self.probe.attach(models)
        try:
            losses = self.inner.forward_backward(case, setup, micro_batches)
        finally:
            self.probe.detach()
        if losses:
            self.probe.keep_loss(losses[0])
        return losses

    def optimizer_step(self, case: Case, setup: Any) -> None:
        self.inner.optimizer_step(case, setup)

    def __getattr__(self, name: str) -> Any:  # anything else the wrapped strategy offers
        return getattr(self.inner, name)


@dataclass
class ProbeData:
    """Every rank's captures, on the rank that collected them."""

    ranks: list[dict[str, Any]] = field(default_factory=list)
    # The reference replayed on each rank's probed micro-batch, once for every check that reads
    # it (harness.analysis.probe_checks.Replay: module outputs, op logs, gradients).
    replays: dict[int, Any] = field(default_factory=dict, repr=False)
    step: int = 0  # the probed step (its first micro-batch)
    # For a later step: the reference's parameters at its start (the reference record's after the
    # step before), which its replay loads; None at step 0 (the case's initial weights).
    state: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    # The probe of the first failing step, where that is after step 0 (a second run of the
    # target up to it, on failure only): where the run departs is sought there.
    later: "ProbeData | None" = field(default=None, repr=False)


def probe_entry(probe: ActivationProbe, rank: int, layout: Any, value: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """What one rank's probe holds, as :class:`ProbeData` keeps it per rank. ``value`` maps
    each captured tensor to this rank's (simulated ranks: its piece of a LocalTensor);
    default, the tensor itself."""
    import dataclasses

    def of(v: Any) -> Any:
        return v if value is None or v is None else value(v)

    def tree(v: Any) -> Any:
        return map_tensors(of, v) if v is not None and value is not None else v

    return {
        "rank": rank,
        "mesh": dict(layout.mesh) if layout is not None else {},
        "groups": {k: list(v) for k, v in layout.groups.items()} if layout is not None else {},
        "stages": list(layout.stages) if layout is not None and layout.stages is not None else None,
        "input": tree(probe.input),
        "targets": tree(probe.targets),
        "loss": of(probe.loss),
        "ids": probe.ids,
        "missing": probe.missing,
        "expected_input": probe.expected_input,
        "forward_input": tree(probe.forward_input),
        "order": probe.order if value is None else list(probe.order),
        "captures": probe.captures if value is None else {
            name: dataclasses.replace(cap, output=of(cap.output), input=of(cap.input), grad=of(cap.grad))
            for name, cap in probe.captures.items()},
        "grad_order": list(probe.grad_order),
        "backward_ops": probe.backward.events if value is None else [
            dataclasses.replace(op, output=of(op.output)) for op in probe.backward.events],
        "ops": probe.ops if value is None else [dataclasses.replace(op, output=of(op.output)) for op in probe.ops],
    }


def collect_probe(strategy: Any, dst: int = 0) -> ProbeData | None:
    """Collective: send every rank's captures to ``dst`` (returns them there, None elsewhere).
    ``strategy``: a :class:`ProbedStrategy`, or anything with its ``layout`` and ``probe`` (a
    custom loop's ``CustomRun``)."""
    mine = probe_entry(strategy.probe, dist.get_rank() if dist.is_initialized() else 0, strategy.layout)
    step = strategy.probe.at_step
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ProbeData([mine], step=step)
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(mine, out, dst=dst)
    return ProbeData(list(out), step=step) if out is not None else None

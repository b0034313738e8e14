"""Per-rank state a test can leak into the next one, and its reset.

A warm rank is reused across tests, so whatever one test changes globally (process groups,
device meshes, RNG, deterministic flags, env vars, cwd, sys.path, default dtype and device,
thread count, float32 matmul precision, autograd anomaly mode, warning filters, the
open-files limit) is put back before the next. Used by the pool worker and by the in-place
(torchrun) mode alike.
"""

from __future__ import annotations

import os
import random
import resource
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from harness.launch.protocol import CurrentTest


@dataclass
class RankState:
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = ""
    sys_path: list[str] = field(default_factory=list)
    deterministic: bool = False
    deterministic_warn_only: bool = False
    default_dtype: torch.dtype = torch.float32
    num_threads: int = 1
    grad_enabled: bool = True
    cudnn_deterministic: bool = False
    cudnn_benchmark: bool = False
    default_device: Any = None
    matmul_precision: str = "highest"
    anomaly: tuple[bool, bool] = (False, True)
    warning_filters: list[Any] = field(default_factory=list)
    nofile: tuple[int, int] | None = None

    @classmethod
    def capture(cls) -> "RankState":
        return cls(
            env=dict(os.environ),
            cwd=os.getcwd(),
            sys_path=list(sys.path),
            deterministic=torch.are_deterministic_algorithms_enabled(),
            deterministic_warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
            default_dtype=torch.get_default_dtype(),
            num_threads=torch.get_num_threads(),
            grad_enabled=torch.is_grad_enabled(),
            cudnn_deterministic=torch.backends.cudnn.deterministic,
            cudnn_benchmark=torch.backends.cudnn.benchmark,
            default_device=torch.get_default_device(),
            matmul_precision=torch.get_float32_matmul_precision(),
            anomaly=(torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
            warning_filters=list(warnings.filters),
            nofile=resource.getrlimit(resource.RLIMIT_NOFILE),
        )

    def restore(self) -> None:
        if dict(os.environ) != self.env:
            os.environ.clear()
            os.environ.update(self.env)
        try:
            os.chdir(self.cwd)
        except OSError:
            pass
        sys.path[:] = self.sys_path
        # Only touch what changed: the first use_deterministic_algorithms() call costs seconds.
        if (
            torch.are_deterministic_algorithms_enabled() != self.deterministic
            or torch.is_deterministic_algorithms_warn_only_enabled() != self.deterministic_warn_only
        ):
            torch.use_deterministic_algorithms(self.deterministic, warn_only=self.deterministic_warn_only)
        if torch.get_default_dtype() != self.default_dtype:
            torch.set_default_dtype(self.default_dtype)
        if torch.get_num_threads() != self.num_threads:
            torch.set_num_threads(self.num_threads)
        torch.set_grad_enabled(self.grad_enabled)
        torch.backends.cudnn.deterministic = self.cudnn_deterministic
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        if torch.get_default_device() != self.default_device:
            torch.set_default_device(self.default_device)
        if torch.get_float32_matmul_precision() != self.matmul_precision:
            torch.set_float32_matmul_precision(self.matmul_precision)
        if (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()) != self.anomaly:
            torch.set_anomaly_enabled(*self.anomaly)
        warnings.filters[:] = self.warning_filters
        getattr(warnings, "_filters_mutated", lambda: None)()  # drop the cached "once" decisions
        if self.nofile is not None and resource.getrlimit(resource.RLIMIT_NOFILE) != self.nofile:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, self.nofile)
            except (ValueError, OSError):  # a lowered hard limit cannot be raised without privilege
                pass


_CURRENT: CurrentTest | None = None


def current_test() -> CurrentTest | None:
    """The test this rank runs now (pool worker or torchrun in place), None outside one."""
    return _CURRENT


def begin_test(test: CurrentTest) -> int:
    """The per-test rank preamble, the pool worker's and torchrun's in place alike: the test's
    facts for :func:`current_test`, and its start marked in the collective records (returns the
    mark for :func:`harness.tracing.dump.read_entries`). The RNGs are seeded later, right before
    the body (:func:`seed_everything`): importing the test module may draw from them."""
    from harness.tracing import dump

    global _CURRENT
    _CURRENT = test
    return dump.mark_test_start()


def end_test() -> None:
    global _CURRENT
    _CURRENT = None


def seed_everything(seed: int) -> None:
    """The same seed on every rank: a test that wants rank-specific streams sets its own."""
    random.seed(seed)
    torch.manual_seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed % (2**32))


def release_test_groups() -> None:
    """Destroy every process group but the default one, and the caches that point at them."""
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return
    world = c10d.GroupMember.WORLD
    for group in list(c10d._world.pg_map.keys()):
        if group is not world:
            dist.destroy_process_group(group)
    mesh_env = sys.modules.get("torch.distributed.device_mesh")
    resources = getattr(mesh_env, "_mesh_resources", None)
    if resources is not None and hasattr(resources, "mesh_stack"):
        resources.mesh_stack.clear()
    # DTensor's sharding-propagation caches (Python LRU and the C++ fast path) key on specs
    # whose DeviceMesh compares equal by layout and dim names, not by process group: a later
    # test's equal mesh would get output specs pointing at this test's destroyed groups
    # ("Could not resolve the process group registered under the name 3").
    if "torch.distributed.tensor" in sys.modules:
        from torch.distributed.tensor import debug as dtensor_debug

        dtensor_debug._clear_sharding_prop_cache()
    dtensor_random = sys.modules.get("torch.distributed.tensor._random")
    if dtensor_random is not None and hasattr(dtensor_random, "_rng_tracker"):
        dtensor_random._rng_tracker = None
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()
    _release_framework_groups()


def _release_framework_groups() -> None:
    """Frameworks keep the groups a test built in module globals and singletons; on a warm
    rank the next test would get destroyed groups from them ("Group ... is not registered").
    Each is reset to what a fresh process has (only for frameworks already imported)."""
    ds_groups = sys.modules.get("deepspeed.utils.groups")
    if ds_groups is not None:
        # Its state is the private upper-case globals and mesh_device (None or {} in a fresh
        # process); its one string constant is left alone.
        for name, value in list(vars(ds_groups).items()):
            if (name.startswith("_") and name.isupper() or name == "mesh_device") and not isinstance(value, str):
                setattr(ds_groups, name, {} if isinstance(value, dict) else None)
    ds_comm = sys.modules.get("deepspeed.comm.comm")
    if ds_comm is not None:
        ds_comm.cdb = None
    megatron_state = sys.modules.get("megatron.core.parallel_state")
    if megatron_state is not None and megatron_state.model_parallel_is_initialized():
        megatron_state.destroy_model_parallel()
    accelerate_state = sys.modules.get("accelerate.state")
    if accelerate_state is not None:
        accelerate_state.AcceleratorState._reset_state(True)
        accelerate_state.GradientState._reset_state()


def group_count() -> int:
    """How many process groups this rank has created so far; equal on ranks that are in step."""
    from torch.distributed import distributed_c10d as c10d

    return int(getattr(c10d._world, "group_count", -1))

"""`DistributedWorld`: process-group launch and teardown, the device mesh, collectives."""

from __future__ import annotations

import logging
import math
import operator
import os
from collections.abc import Iterable
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from dream_trainer.cluster import detect as detect_cluster
from dream_trainer.configs import DeviceParameters
from dream_trainer.world.memory import MemoryStatus, allocated_bytes, read_memory_status, reset_peak_memory
from dream_trainer.world.plan import MESH_DIMS, MeshPlan, plan_mesh
from dream_trainer.world.rendezvous import Heartbeat, is_communication_error, roll_call
from dream_trainer.world.settle import destroy_settled, install_exit_settle
from dream_trainer.world.sockets import shutdown_sockets, socket_inodes
from dream_trainer.world.transfer import BatchTransfer
from dream_trainer.world.watchdog import CollectiveTracker, Watchdog, explain_hang, watch

logger = logging.getLogger(__name__)

ReduceOp = Literal["sum", "mean", "max", "min"]
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

_GRAD_PLANS_KEPT = 8
"""Parameter lists whose gradient grouping `DistributedWorld` keeps (one per optimizer)."""

_GRAD, _NONE = operator.attrgetter("grad"), type(None)


def _gradient_kind(grad: torch.Tensor) -> tuple[Any, ...]:
    """``(is plain, ...)``: what a gradient can be grouped with in one foreach kernel."""
    if isinstance(grad, DTensor):
        return (False, grad.device_mesh, grad.placements)
    return (True, grad.device, grad.dtype, type(grad))


def _env_int(name: str, default: int) -> int:
    if not (value := os.environ.get(name)):  # unset or empty
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


class DistributedWorld:
    """Owns the process group, the named device mesh and the distributed helpers.

    With no launcher and no environment variables it is a one-rank world on the best
    device; under ``torchrun`` it joins the launched group (gloo on CPU, NCCL with a gloo
    side backend on CUDA). A process group that already exists is reused and left alone
    by `teardown`.
    """

    def __init__(self, device_parameters: DeviceParameters | None = None):
        self.device_parameters = device_parameters or DeviceParameters()
        self.cluster = detect_cluster()  # torchrun, SLURM (srun) or one process: see dream_trainer.cluster
        self.rank, self.world_size = self.cluster.rank, self.cluster.world_size
        self.local_rank, self.local_world_size = self.cluster.local_rank, self.cluster.local_world_size
        self.plan: MeshPlan = plan_mesh(self.device_parameters, self.world_size, self.local_world_size)
        self.device = self._resolve_device()
        self.transfer = BatchTransfer()  # batches to `device` (on CUDA: on a stream of their own), from launch on
        self.mesh: DeviceMesh | None = None
        self._owns_process_group = False
        self._launched = False
        self._groups: list[Any] = []
        self._dp: tuple[int, int] | None = None  # (rank, size) on the launched mesh
        self._sockets: set[str] = set()  # socket inodes of this world's process groups
        self._timeout = timedelta(seconds=self.device_parameters.init_timeout_s)
        self._heartbeat: Heartbeat | None = None  # names lost ranks after a failure (`explain_failure`)
        self._watchdog: Watchdog | None = None  # names a rank that never enters a collective (`watch`)
        self.collectives = CollectiveTracker(self.plan, (__file__,))  # this rank's collectives, in memory only
        base, cls = DistributedWorld, type(self)  # `trainer.step` calls the step's seams where a subclass overrides one
        self.step_seams = cls.sync_gradients is not base.sync_gradients or cls.agree_on_step is not base.agree_on_step
        # id(parameter list) -> (its parameters, [(gradient kind, indices)]): see _gradient_groups
        self._grad_plans: dict[int, tuple[tuple[Any, ...], list[tuple[Any, list[int]]]]] = {}

    # ------------------------------------------------------------------ launch
    def _resolve_device(self) -> torch.device:
        requested = self.device_parameters.device
        if requested == "auto":
            if torch.cuda.is_available():
                return torch.device("cuda", self.local_rank % torch.cuda.device_count())
            return torch.device("cpu")
        device = torch.device(requested)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(f"DeviceParameters.device={requested!r} but CUDA is not available here")
            if device.index is None:
                device = torch.device("cuda", self.local_rank % torch.cuda.device_count())
        return device

    @property
    def backend(self) -> str:
        chosen = self.device_parameters.backend
        if chosen == "auto":
            chosen = "nccl" if self.device.type == "cuda" else "gloo"
        if chosen == "nccl":
            if self.device.type != "cuda":
                raise ValueError(f"backend 'nccl' needs a CUDA device, the world runs on {self.device}")
            return "cuda:nccl,cpu:gloo"  # a gloo side backend for CPU collectives
        return chosen

    def launch(self) -> None:
        """Create (or join) the process group and build the device mesh. Every group is
        given `init_timeout_s` (device-mesh subgroups otherwise keep torch's 30 minutes)."""
        if self._launched:
            return
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.transfer.start(self.device)
        timeout = timedelta(seconds=self.device_parameters.init_timeout_s)
        before = socket_inodes()
        if not dist.is_initialized():
            if self.cluster.source == "slurm":
                self.cluster.export()  # srun's ranks, in the variables env:// reads
            if self.world_size == 1 and "MASTER_ADDR" not in os.environ:
                # One rank, no launcher: an in-memory store, no ports.
                dist.init_process_group(self.backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
            else:
                # A roll call names any rank that never arrives (env:// would only count them).
                store, roster, prefix = roll_call(self.cluster, timeout)
                dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=self.world_size,
                                        timeout=timeout)
                self._watchdog = watch(self, roster)
                self._heartbeat = Heartbeat(self.cluster, roster, prefix, tick=self._watchdog.tick)
            self._owns_process_group = True
            install_exit_settle()  # gloo's workers release their last work before the interpreter ends (settle.py)
        elif dist.get_world_size() != self.world_size or dist.get_rank() != self.rank:
            raise RuntimeError(
                f"an existing process group has rank {dist.get_rank()}/{dist.get_world_size()} but the "
                f"environment says RANK={self.rank} WORLD_SIZE={self.world_size}"
            )
        self._launched = True
        try:
            self.mesh = init_device_mesh(self.device.type, self.plan.shape, mesh_dim_names=MESH_DIMS)
            self._groups = [dist.group.WORLD, *self.mesh.get_all_groups()]
            if self.plan.dp_replicate * self.plan.dp_shard > 1 and min(self.plan.dp_replicate, self.plan.dp_shard) > 1:
                self._groups.append(self.mesh[("dp_replicate", "dp_shard")]._flatten("dp").get_group())
            if self.plan.cp > 1:  # FSDP2 shards the parameters over the context-parallel ranks too
                self._groups.append(self.mesh[("dp_shard", "cp")]._flatten("dp_shard_cp").get_group())
            dp_mesh = self.get_mesh("dp")
            self._dp = (dp_mesh.get_local_rank(), dp_mesh.size())
            self._set_timeout(timeout)
        except BaseException:
            self._track_sockets(before)
            self.teardown(abort=True)
            raise
        self._track_sockets(before)

    def _track_sockets(self, before: dict[str, int]) -> None:
        """Remember the sockets opened since `before` (this process's connections to its
        peers) when this world owns the process group: `teardown(abort=True)` shuts them."""
        if self._owns_process_group:
            self._sockets |= socket_inodes().keys() - before.keys()

    def new_group(self, **kwargs: Any) -> Any:
        """``torch.distributed.new_group(**kwargs)`` (every rank must call it), owned by the
        world: it gets the world's current timeout and is released by `teardown`."""
        before = socket_inodes()
        group = dist.new_group(**kwargs)
        self._track_sockets(before)
        if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
            self._groups.append(group)
            group.set_timeout(self._timeout)
        return group

    def _set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
        seen: set[int] = set()
        for group in self._groups:
            if group is not None and id(group) not in seen:
                seen.add(id(group))
                group.set_timeout(timeout)

    def relax_timeout(self) -> None:
        """Switch every group of the world from the long init timeout to `timeout_s` (called
        by the trainer after the first optimizer step of a `fit()`, once compilation and
        warm-up are done, also after a resume). A barrier first: no rank tightens its
        timeout while another is still in its first step."""
        if self._launched and dist.is_initialized():
            self.barrier()  # once per fit(): the only host wait it adds
            self._set_timeout(timedelta(seconds=self.device_parameters.timeout_s))

    @property
    def timeout(self) -> timedelta:
        """The timeout the world's process groups use now."""
        return self._timeout

    def teardown(self, abort: bool = False) -> None:
        """Destroy the process group if this world created it. Safe to call twice.

        With `abort` (a failed run), the peers are released at once: NCCL communicators
        are aborted, and on Linux this process's connections to its peers are shut down,
        so a peer waiting in a collective fails within a second, even if this process
        lingers and still references the groups (otherwise it would wait for the
        process-group timeout or this process's exit)."""
        self.mesh = None
        self._groups = []
        self._dp = None
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat, self._watchdog = None, self._watchdog and self._watchdog.uninstall()  # -> None
        if self._owns_process_group and dist.is_initialized():
            try:
                if abort and "nccl" in self.backend:
                    dist.distributed_c10d._abort_process_group()  # NCCL only: unblocks the GPU streams
                else:
                    destroy_settled()  # gloo's workers idle first: the group's destructor joins them (settle.py)
            except Exception:  # noqa: BLE001 - teardown must not mask the original error
                logger.exception("destroying the process group failed")
        if abort and self._sockets:
            released = shutdown_sockets(self._sockets)
            logger.info("released %d connection(s) to peer ranks", released)
        self._sockets = set()
        self._owns_process_group = False
        self._launched = False

    def explain_failure(self, exc: BaseException) -> None:
        """Called on every rank whose run failed, before teardown. A rank's own error is
        posted for its peers; a failed collective is explained (logged, and a note on `exc`) by
        the watchdog's report of a rank that never entered it (`watchdog.explain_hang`), else
        by naming the ranks that failed or stopped answering."""
        if explain_hang(self._watchdog, exc) or self._heartbeat is None or not isinstance(exc, Exception):
            return
        if not is_communication_error(exc):
            self._heartbeat.post_failure(exc)
            return
        why = self._heartbeat.explain()
        if why:
            logger.error("rank %d: a collective failed because %s", self.rank, why)
            exc.add_note(f"dream_trainer: {why}")

    # ------------------------------------------------------------------ properties
    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def get_mesh(self, *dims: str) -> DeviceMesh:
        """The submesh over `dims` (``"dp"`` is the flattened data-parallel dims)."""
        if self.mesh is None:
            raise RuntimeError("the world is not launched: call launch() first")
        if dims == ("dp",):
            if self.plan.dp_replicate > 1 and self.plan.dp_shard > 1:
                return self.mesh["dp"]
            dims = ("dp_shard",) if self.plan.dp_shard > 1 else ("dp_replicate",)
        return self.mesh[dims if len(dims) > 1 else dims[0]]

    @property
    def launched(self) -> bool:
        """Whether `launch` ran (and `teardown` has not)."""
        return self._launched

    @property
    def dp_size(self) -> int:
        """Number of data-parallel ranks (each reads its own shard of the data): from the
        launched mesh's data-parallel dimension (before launch: from the plan)."""
        return self._dp[1] if self._dp is not None else self.plan.dp

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks: its coordinate on the launched
        mesh's data-parallel dimension (before launch: from the plan, the mesh being laid
        out ``pp x dp_replicate x dp_shard x cp x tp``, row-major)."""
        return self._dp[0] if self._dp is not None else self.rank // (self.plan.cp * self.plan.tp) % self.plan.dp

    @property
    def fsdp_config(self) -> dict[str, Any]:
        """Keyword arguments for ``fully_shard``: ``mesh``, ``mp_policy``, ``offload_policy``.
        The mesh is ``dp_shard`` (HSDP: ``dp_replicate x dp_shard``); with context
        parallelism, ``dp_shard x cp`` flattened (``"dp_shard_cp"``): each context-parallel
        rank's gradients are of its part of the sequences, reduced over it."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

        params = self.device_parameters
        shard = "dp_shard_cp" if self.plan.cp > 1 else "dp_shard"  # context-parallel ranks shard too
        if self.plan.dp_replicate > 1 and (self.plan.dp_shard > 1 or self.plan.cp > 1):
            mesh = self.get_mesh("dp_replicate", shard)
        elif self.plan.cp > 1:
            mesh = self.get_mesh(shard)
        else:
            mesh = self.get_mesh("dp")
        return {
            "mesh": mesh,
            "mp_policy": MixedPrecisionPolicy(param_dtype=params.param_dtype, reduce_dtype=params.reduce_dtype),
            "offload_policy": CPUOffloadPolicy() if params.cpu_offload else OffloadPolicy(),
        }

    # ------------------------------------------------------------------ collectives
    def barrier(self) -> None:
        if self.world_size > 1:
            with self.collectives.region("barrier", find_caller=True):
                dist.barrier()

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "mean", group: Any = None) -> torch.Tensor:
        """Reduce `tensor` in place over `group` (default: all ranks) and return it."""
        if self.world_size == 1:
            return tensor
        if op != "mean" and op not in _OPS:
            raise ValueError(f"op={op!r} is invalid: expected one of 'sum', 'mean', 'max', 'min'")
        with self.collectives.region("all_reduce", find_caller=True):
            dist.all_reduce(tensor, op=_OPS.get(op, dist.ReduceOp.SUM), group=group)
        if op == "mean":
            tensor /= dist.get_world_size(group)
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Every rank gets rank `src`'s `obj` (a picklable value)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        with self.collectives.region("broadcast_object", find_caller=True):
            dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        with self.collectives.region("all_gather_object", find_caller=True):
            dist.all_gather_object(out, obj)
        return out

    def global_agreement(self, value: Any) -> bool:
        """True when every rank passed an equal `value`."""
        values = self.all_gather_object(value)
        return all(v == values[0] for v in values[1:])

    # ------------------------------------------------------------------ gradients
    def _gradient_groups(self, parameters: Iterable[torch.nn.Parameter]) -> list[list[torch.Tensor]]:
        """Gradients grouped so each group is one kind: plain tensors, or DTensors of one
        mesh and placement (foreach kernels cannot mix them). This runs every step on the
        norm path, so the grouping of a parameter list (the same list object every step, as
        ``trainer.step`` passes it) is worked out once and kept while the list holds the same
        parameters, every one has a gradient and each group's first gradient is still of its
        kind (a gradient's kind follows its parameter: dtype, device, mesh and placements)."""
        if isinstance(parameters, list):
            cached = self._grad_plans.get(id(parameters))
            if cached is not None and len(cached[0]) == len(parameters) and all(map(operator.is_, cached[0], parameters)):
                grads = list(map(_GRAD, parameters))
                if _NONE not in map(type, grads):  # every parameter has a gradient
                    plan = cached[1]
                    if len(plan) == 1:
                        if _gradient_kind(grads[0]) == plan[0][0]:
                            return [grads]
                    elif all(_gradient_kind(grads[idx[0]]) == kind for kind, idx in plan):
                        return [[grads[i] for i in idx] for _, idx in plan]
        else:
            parameters = list(parameters)
        by_kind: dict[Any, list[int]] = {}
        grads = [p.grad for p in parameters]
        for i, g in enumerate(grads):
            if g is not None:
                by_kind.setdefault(_gradient_kind(g), []).append(i)
        if all(g is not None for g in grads):  # a plan for the next steps (keyed by the list)
            if len(self._grad_plans) >= _GRAD_PLANS_KEPT:  # lists made per call: keep a few
                del self._grad_plans[next(iter(self._grad_plans))]
            self._grad_plans[id(parameters)] = (tuple(parameters), list(by_kind.items()))
        return [[grads[i] for i in idx] for idx in by_kind.values()]

    def _norm_of_groups(self, groups: list[list[torch.Tensor]], norm_type: float) -> torch.Tensor:
        # No no_grad() context (its cost shows on small models, where this runs every step):
        # gradients do not require grad, so nothing is recorded; those of a create_graph
        # backward do, and the result is detached.
        if not groups:
            return self._over_stages(torch.zeros((), device=self.device), norm_type)
        norms = []
        for grads in groups:
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, norm_type)), norm_type)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()  # reduce a sharded (or partial) norm over its mesh
            norms.append(norm.float())
        total = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(
            torch.stack([n.to(norms[0].device) for n in norms]), norm_type)
        return self._over_stages(total.detach() if total.requires_grad else total, norm_type)

    def _over_stages(self, norm: torch.Tensor, norm_type: float) -> torch.Tensor:
        """Pipeline parallel: each rank holds some stages' gradients; the norm of all of
        them (a collective over the ``pp`` dimension, no host sync)."""
        if self.plan.pp == 1 or self.mesh is None:
            return norm
        group = self.mesh["pp"].get_group()
        if math.isinf(norm_type):
            dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
            return norm
        powered = norm.float() ** norm_type
        dist.all_reduce(powered, group=group)
        return powered ** (1.0 / norm_type)

    def total_gradient_norm(self, parameters: Iterable[torch.nn.Parameter], norm_type: float = 2.0) -> torch.Tensor:
        """The global gradient norm as one device tensor (no host sync).

        Gradients are grouped by kind (plain tensors by device and dtype; DTensors from
        FSDP2, replicate or TP by mesh and placements); each group's norm is reduced over its
        mesh, then the groups are combined.
        """
        return self._norm_of_groups(self._gradient_groups(parameters), norm_type)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.nn.Parameter], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip gradients in place to a global norm of `max_norm`; return the norm before
        clipping (a device tensor: nothing is read to the host). Works on a mix of plain and
        DTensor gradients (e.g. tensor-parallel blocks with replicated embeddings).

        A non-finite norm zeroes the finite gradients and leaves the non-finite ones
        non-finite (coefficient 0, the limit of max_norm / norm: ``torch.nn.utils`` would
        multiply every gradient by NaN for a NaN norm), so a NaN check after clipping names
        exactly the parameters whose gradients were non-finite before it."""
        groups = self._gradient_groups(parameters)
        total = self._norm_of_groups(groups, norm_type)
        # In place on a fresh tensor, no sync: max_norm / (total + eps), at most 1, NaN -> 0.
        coefficient = (total + 1e-6).reciprocal_().mul_(max_norm).clamp_(max=1.0).nan_to_num_(0.0)
        for grads in groups:
            if grads[0].requires_grad:  # gradients of a create_graph backward: not recorded
                with torch.no_grad():
                    torch._foreach_mul_(grads, coefficient.to(grads[0].device))
            else:
                torch._foreach_mul_(grads, coefficient if coefficient.device == grads[0].device
                                    else coefficient.to(grads[0].device))
        return total

    # ------------------------------------------------------------------ the run's files (seams)
    run_subdirectory: str | None = None
    """A directory of its own, under the run's directory and under an explicit checkpoint
    root, for this world's files, when it is one of several worlds that share a run (a
    fault-tolerant replica group: ``replica_group_<id>``). None here: the run's directory is
    this world's. The trainer's ``run_dir`` and `CheckpointCallback` follow it."""

    checkpoint_interval: int | None = None
    """How often, in optimizer steps, this world needs the run's state on disk (a
    fault-tolerant world: ``FaultToleranceParameters.checkpoint_interval``, for a restart of
    every group at once). None here: the checkpoint callback's own schedule."""

    def resume_roots(self, root: Path) -> list[Path]:
        """The checkpoint roots a resume from the newest checkpoint looks in: this world's
        `root`, and those of the worlds it shares the run with (a fault-tolerant world:
        every replica group's this machine sees). Here: `root`."""
        return [Path(root)]

    # ------------------------------------------------------------------ the step (seams)
    announces_batches: bool = False
    """Whether the trainer calls `before_batch` before fetching each training batch (a
    world that decides per step, like `FaultTolerantWorld`, sets it)."""

    def before_batch(self, starts_step: bool) -> None:
        """Called before each training (micro-)batch is fetched when `announces_batches`;
        `starts_step`: it is the first micro-batch of an optimizer step. A no-op here."""

    def sync_gradients(self, parameters: list[torch.nn.Parameter]) -> None:
        """Called by ``trainer.step(optimizer)`` (only where a subclass overrides it or
        `agree_on_step`) before clipping, with the optimizer's parameters: communication the
        mesh's own modules do not do (FSDP2/DDP reduce in backward); a fault-tolerant world's."""

    def agree_on_step(self, skip_reason: str | None) -> str | None:
        """The reason to skip the step about to be applied, or None (`skip_reason`: this one's).
        A fault-tolerant world's quorum decides."""
        return skip_reason

    # ------------------------------------------------------------------ memory
    def memory_status(self, device: torch.device | str | None = None) -> MemoryStatus:
        """Memory now, a `MemoryStatus` (bytes): CUDA's caching-allocator counters of `device` (default: this
        rank's), else the process's resident set and peak; the resident set always. No device sync."""
        return read_memory_status(torch.device(device) if device is not None else self.device)

    def memory_allocated(self) -> int:
        """``memory_status().allocated`` of this rank's device alone, for frequent samples (cheaper)."""
        return allocated_bytes(self.device)

    def reset_peak_memory(self) -> bool:
        """Start the peaks of `memory_status` again from now: the device's (CUDA) and the process's
        resident set's (Linux). False when the latter could not be reset (no ``/proc/self/clear_refs``)."""
        return reset_peak_memory(self.device)

    # ------------------------------------------------------------------ contexts
    def train_context(self) -> AbstractContextManager[Any] | None:
        """Autocast when `autocast_dtype` is configured, else None."""
        dtype = self.device_parameters.autocast_dtype
        if dtype is None:
            return None
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def __repr__(self) -> str:
        return (f"DistributedWorld(rank={self.rank}/{self.world_size}, device={self.device}, "
                f"plan={self.plan}, launched={self._launched})")

"""Configuration dataclasses. Every field is keyword-only and validated on construction,
so a bad value fails before any process group, model or file exists."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Union

import torch

from dream_trainer.config_checks import check_name, flags, path_field, positive_int, seconds, watchdog_fields
from dream_trainer.pipeline.plan import PipelineParameters

if TYPE_CHECKING:
    from dream_trainer.protocol.base import Callback
    from dream_trainer.protocol.collection import CallbackCollection

Size = Union[int, Literal["auto", "node"]]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DEVICE_RE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


@dataclass(kw_only=True)
class TrainingParameters:
    """How long and how to train.

    Attributes:
        n_epochs: epochs to run (None: until `max_steps`).
        max_steps: stop after this many optimizer steps (None: no limit).
        train_steps_per_epoch: batches per epoch; needed by iterable loaders without
            ``__len__`` that never end. Default: ``len(train_dataloader)`` (the minimum over
            ranks), or until the iterator is exhausted.
        train_steps_per_epoch_hint: an estimate of the batches per epoch of a training
            loader without ``__len__`` (a stream), for what an estimate serves:
            `trainer.total_steps` (progress, ETA, a schedule's length). It never ends an
            epoch (`train_steps_per_epoch` does) and is ignored when the length is known.
        val_steps_per_epoch: batches per validation run (None: the whole loader).
        gradient_accumulation_steps: micro-batches per optimizer step (derived instead when
            `global_batch_size` is set; leave it at 1 then).
        global_batch_size: samples per optimizer step over all data-parallel ranks. Set, the
            accumulation is derived from the data-parallel size when the world is up
            (``global_batch_size / (dp_size * micro_batch_size)``, `trainer.gradient_accumulation_steps`),
            so another world size, HSDP layout or quorum keeps the global batch; a size that
            cannot be split is refused, naming the sizes that can. See `TokenLoader`.
        micro_batch_size: samples per forward pass on one rank (needs `global_batch_size`).
            None: one micro-batch per rank and step.
        gradient_clip_val: clip the global gradient norm to this value (None: no clipping).
        val_every_n_steps: validate every N optimizer steps (None: only at epoch end).
        validate_at_epoch_end: validate after every epoch.
        num_sanity_val_steps: validation batches run before training (0: none).
        scheduler_monitor: the logged metric (e.g. ``"val/loss"``) that schedulers stepped
            with a metric (``ReduceLROnPlateau``) receive, after every validation run (at
            every epoch's end without validation data). Needed when there is such a
            scheduler; checked at setup.
    """

    n_epochs: int | None = 1
    max_steps: int | None = None
    train_steps_per_epoch: int | None = None
    train_steps_per_epoch_hint: int | None = None
    val_steps_per_epoch: int | None = None
    gradient_accumulation_steps: int = 1
    global_batch_size: int | None = None
    micro_batch_size: int | None = None
    gradient_clip_val: float | None = None
    val_every_n_steps: int | None = None
    validate_at_epoch_end: bool = True
    num_sanity_val_steps: int = 2
    scheduler_monitor: str | None = None

    def __post_init__(self) -> None:
        owner = "TrainingParameters"
        flags(owner, self, "validate_at_epoch_end")
        positive_int(owner, "n_epochs", self.n_epochs, allow_none=True)
        positive_int(owner, "max_steps", self.max_steps, allow_none=True)
        if self.n_epochs is None and self.max_steps is None:
            raise ValueError(f"{owner}: n_epochs and max_steps are both None; set at least one")
        positive_int(owner, "train_steps_per_epoch", self.train_steps_per_epoch, allow_none=True)
        positive_int(owner, "train_steps_per_epoch_hint", self.train_steps_per_epoch_hint, allow_none=True)
        positive_int(owner, "val_steps_per_epoch", self.val_steps_per_epoch, allow_none=True)
        positive_int(owner, "gradient_accumulation_steps", self.gradient_accumulation_steps)
        positive_int(owner, "global_batch_size", self.global_batch_size, allow_none=True)
        positive_int(owner, "micro_batch_size", self.micro_batch_size, allow_none=True)
        self._check_batch_sizes(owner)
        positive_int(owner, "val_every_n_steps", self.val_every_n_steps, allow_none=True)
        positive_int(owner, "num_sanity_val_steps", self.num_sanity_val_steps, allow_zero=True)
        clip = self.gradient_clip_val
        if clip is not None and (
            isinstance(clip, bool) or not isinstance(clip, (int, float)) or not math.isfinite(clip) or clip <= 0
        ):
            raise ValueError(f"{owner}.gradient_clip_val={clip!r} is invalid: expected a finite number > 0 or None")
        if self.scheduler_monitor is not None and (not isinstance(self.scheduler_monitor, str) or not self.scheduler_monitor):
            raise ValueError(
                f"{owner}.scheduler_monitor={self.scheduler_monitor!r} is invalid: expected a metric name "
                "(e.g. 'val/loss') or None"
            )

    def _check_batch_sizes(self, owner: str) -> None:
        gbs, micro = self.global_batch_size, self.micro_batch_size
        if micro is not None and gbs is None:
            raise ValueError(f"{owner}.micro_batch_size={micro} needs global_batch_size (the samples of one optimizer "
                             "step over all data-parallel ranks)")
        if gbs is not None and self.gradient_accumulation_steps != 1:
            raise ValueError(f"{owner}: gradient_accumulation_steps={self.gradient_accumulation_steps} with "
                             f"global_batch_size={gbs}: the accumulation is derived from the global batch, the "
                             "micro-batch and the data-parallel size; set micro_batch_size instead")
        if gbs is not None and micro is not None and (micro > gbs or gbs % micro):
            sizes = [m for m in range(1, gbs + 1) if gbs % m == 0]
            raise ValueError(f"{owner}.micro_batch_size={micro} does not divide global_batch_size={gbs}; "
                             f"micro-batch sizes that do: {sizes}")


@dataclass(kw_only=True)
class LoggingParameters:
    """What the trainer logs by itself and how often.

    Attributes:
        log_every_n_steps: metrics are sent to `on_log` every N optimizer steps, at the
            step that reaches ``max_steps`` (a run shorter than N steps logs its last one)
            and at the end of each validation, read from the device in one transfer when a
            callback listens (with no `on_log` hook, when ``trainer.logged_metrics`` is read).
            Values logged on other steps are kept without a host-device sync and sent with the
            next dispatch.
        log_grad_norm: also compute and log ``train/grad_norm`` on log steps when not
            clipping (a norm over every gradient: ~1% of the step time of a small model at
            ``log_every_n_steps=10``). With ``gradient_clip_val`` set the norm is computed
            anyway and always logged.
        log_lr: log ``train/lr`` (``train/lr/<optimizer>`` with several optimizers).
    """

    log_every_n_steps: int = 50
    log_grad_norm: bool = False
    log_lr: bool = True

    def __post_init__(self) -> None:
        positive_int("LoggingParameters", "log_every_n_steps", self.log_every_n_steps)
        flags("LoggingParameters", self, "log_grad_norm", "log_lr")


@dataclass(kw_only=True)
class DeviceParameters:
    """Where and how the model runs: device, mesh sizes, precision, compile.

    Mesh sizes (`dp_replicate`, `dp_shard`, `context_parallel`, `tensor_parallel`) are
    ints or ``"auto"`` (at most one): ``"auto"`` takes what the world size leaves.
    `dp_shard` may also be ``"node"``: the ranks of one node that context and tensor
    parallelism leave (HSDP's default: shard within a node, replicate across nodes).
    Use the constructors `SINGLE_DEVICE`, `DDP`, `FSDP`, `HSDP` for the common layouts.
    `pipeline_parallel` (an int) is the number of pipeline ranks, the mesh's outermost
    dimension (the trainer declares a `PipelineLayout`); `pipeline` how they run.
    `context_parallel` ranks each hold a part of every sequence, attention running as ring
    attention over them (`dream_trainer.context_parallel`); FSDP2 shards over them too.

    `weight_init`: how sharded models (FSDP2, HSDP, TP: DTensor parameters) are
    initialized. ``"full"`` (default): every rank runs ``init_weights()`` on full-size
    tensors and keeps its own part, so the weights are exactly those of a single process
    with the same seed, whatever the layout; it costs one full copy of the model's
    parameters per rank while `configure` runs. ``"sharded"``: each rank initializes only
    its shards, with DTensor's random ops (no full copy; for models too large for one
    device): CUDA only (DTensor's RNG tracker gives each shard its own part of the random
    stream, but the values are not those of a single-process run); refused on CPU, where
    every shard would draw the same numbers.

    `fused_optimizers`: on CUDA, torch's Adam, AdamW and SGD built with neither ``fused``
    nor ``foreach`` run fused (one kernel launch per update phase for all parameters;
    torch's own default there is ``foreach``). False: optimizers run as built. See
    `dream_trainer.trainer.fused`.

    `hang_report_s`: how long a rank waits in one collective before it looks for the rank
    that never entered it and names it (its step, phase and Python stack), at ERROR
    (`dream_trainer.world.watchdog`). None (default): ``min(60, timeout_s / 4)``; during the
    first step of a `fit()` (under `init_timeout_s`) at least a quarter of `init_timeout_s`;
    0: off. Must be under `timeout_s`.
    `hang_abort_s`: how long that wait may last before the named hang stops the run on both
    sides (the late rank interrupted, the waiting one released), each with the report. None
    (default): just before the collective timeout (which would end the wait anyway), so a
    rank that legitimately works alone for longer than `hang_report_s` is named, not killed.
    `straggler_factor`: at each log step, a rank whose work before its first collective
    (or whose data wait) per step is over this factor times the median of the other ranks'
    is named (`dream_trainer.world.stragglers`); None: off.
    """

    device: str = "auto"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    dp_replicate: Size = "auto"
    dp_shard: Size = 1
    context_parallel: Size = 1
    tensor_parallel: Size = 1
    pipeline_parallel: int = 1
    pipeline: PipelineParameters = field(default_factory=PipelineParameters)
    compile_model: bool = False
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    autocast_dtype: torch.dtype | None = None
    checkpoint_activations: bool = False
    cpu_offload: bool = False
    weight_init: Literal["full", "sharded"] = "full"
    fused_optimizers: bool = True
    init_timeout_s: float = 600.0
    timeout_s: float = 300.0
    hang_report_s: float | None = None
    hang_abort_s: float | None = None
    straggler_factor: float | None = 1.5

    def __post_init__(self) -> None:
        owner = "DeviceParameters"
        if not isinstance(self.device, str) or not _DEVICE_RE.match(self.device):
            raise ValueError(
                f"{owner}.device={self.device!r} is invalid: expected 'auto', 'cpu', 'mps', 'cuda' or 'cuda:N'"
            )
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"{owner}.backend={self.backend!r} is invalid: expected 'auto', 'gloo' or 'nccl'")
        if self.weight_init not in ("full", "sharded"):
            raise ValueError(f"{owner}.weight_init={self.weight_init!r} is invalid: expected 'full' or 'sharded'")
        autos = []
        positive_int(owner, "pipeline_parallel", self.pipeline_parallel)
        if not isinstance(self.pipeline, PipelineParameters):
            raise TypeError(f"{owner}.pipeline must be a PipelineParameters, got {type(self.pipeline).__name__}")
        for name in ("dp_replicate", "dp_shard", "context_parallel", "tensor_parallel"):
            value = getattr(self, name)
            if value == "auto":
                autos.append(name)
            elif value == "node" and name == "dp_shard":
                continue
            else:
                positive_int(owner, name, value)
        if len(autos) > 1:
            raise ValueError(f"{owner}: only one mesh size may be 'auto', got {autos}")
        for name in ("param_dtype", "reduce_dtype", "autocast_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _DTYPES:
                raise ValueError(f"{owner}.{name}={value!r} is invalid: expected None or one of {_DTYPES}")
        for name in ("init_timeout_s", "timeout_s"):
            seconds(owner, name, getattr(self, name))
        watchdog_fields(owner, self.hang_report_s, self.hang_abort_s, self.timeout_s, self.straggler_factor)
        flags(owner, self, "compile_model", "checkpoint_activations", "cpu_offload", "fused_optimizers")

    @classmethod
    def SINGLE_DEVICE(cls, **kwargs: Any) -> DeviceParameters:
        """One process, no data parallelism (the world size must be 1)."""
        return cls(dp_replicate=1, dp_shard=1, **kwargs)

    @classmethod
    def DDP(cls, **kwargs: Any) -> DeviceParameters:
        """Replicate the model on every rank and average gradients."""
        return cls(dp_replicate="auto", dp_shard=1, **kwargs)

    @classmethod
    def FSDP(cls, dp_shard: Size = "auto", **kwargs: Any) -> DeviceParameters:
        """Shard parameters, gradients and optimizer state over `dp_shard` ranks (FSDP2)."""
        return cls(dp_replicate=1, dp_shard=dp_shard, **kwargs)

    @classmethod
    def HSDP(cls, dp_shard: Size = "node", **kwargs: Any) -> DeviceParameters:
        """Shard within groups of `dp_shard` ranks, replicate across the groups. Default
        ``"node"``: a group is one node (its ranks that context/tensor parallelism leave)."""
        return cls(dp_replicate="auto", dp_shard=dp_shard, **kwargs)


@dataclass(kw_only=True)
class CheckpointParameters:
    """When and where `CheckpointCallback` saves, what it keeps and what it resumes from.

    Attributes:
        root_dir: where checkpoints go (default: ``<run_dir>/checkpoints``). Each one is a
            directory ``step_<global_step>``, visible only once complete.
        every_n_steps: save every N optimizer steps (after that step's validation).
        every_n_epochs: save at the end of every N epochs (after epoch-end validation).
        at_fit_end: save the final state when `fit()` ends (if not saved at that step).
        keep_last: keep the newest K checkpoints (None: keep all). The newest complete
            checkpoint is never removed.
        monitor: a logged metric (e.g. ``"val/loss"``) scoring each checkpoint; the
            `keep_best` best ones are kept besides the last K.
        mode: ``"min"`` or ``"max"``: which `monitor` value is best.
        keep_best: how many of the best checkpoints to keep (with `monitor`).
        resume_mode: ``"last"`` (the newest complete checkpoint under `root_dir`, if any),
            ``"best"`` (the best by `monitor`), a checkpoint path, or None (start fresh).
        strict: fail when the checkpoint's keys or shapes differ from this run's; with
            False, mismatched and missing keys are skipped with a warning.
        async_mode: ``"off"`` (the loop waits for the save), ``"async"`` (the loop waits
            only for a copy of the state; writing runs in the background) or
            ``"async_pinned"`` (the same with staging buffers kept between saves, in pinned
            memory on CUDA).
        allow_fresh_restart: with False (the default), a run that finds no checkpoint to
            resume from fails (naming the root and the host) when its run directory's
            resume record says one was committed, or when its job is a restart
            (``SLURM_RESTART_COUNT`` or ``TORCHELASTIC_RESTART_COUNT`` above 0) without
            such a record; True starts it from step 0 with a warning
            (`dream_trainer.restarts.missing_checkpoint`).
        verify: how a resume checks a checkpoint against the checksums saved with it
            (``manifest.json``) before loading it: ``"all"`` (the default: every file's size
            and checksum, the ranks sharing the reading), ``"sampled"`` (every file's size,
            the checksums of ``.metadata``, ``dream_trainer.json`` and one data file in 8) or
            ``"off"``. A damaged newest checkpoint is named at WARNING and the one before it
            is resumed from (`dream_trainer.checkpoint_resume`).
    """

    root_dir: str | os.PathLike[str] | None = None
    every_n_steps: int | None = None
    every_n_epochs: int | None = 1
    at_fit_end: bool = True
    keep_last: int | None = 3
    monitor: str | None = None
    mode: Literal["min", "max"] = "min"
    keep_best: int = 1
    resume_mode: str | os.PathLike[str] | None = "last"
    strict: bool = True
    async_mode: Literal["off", "async", "async_pinned"] = "off"
    allow_fresh_restart: bool = False
    verify: Literal["all", "sampled", "off"] = "all"

    def __post_init__(self) -> None:
        owner = "CheckpointParameters"
        flags(owner, self, "at_fit_end", "strict", "allow_fresh_restart")
        self.root_dir = path_field(owner, "root_dir", self.root_dir, allow_none=True)
        if self.resume_mode is not None:
            self.resume_mode = path_field(owner, "resume_mode", self.resume_mode)
        positive_int(owner, "every_n_steps", self.every_n_steps, allow_none=True)
        positive_int(owner, "every_n_epochs", self.every_n_epochs, allow_none=True)
        positive_int(owner, "keep_last", self.keep_last, allow_none=True)
        positive_int(owner, "keep_best", self.keep_best)
        if self.mode not in ("min", "max"):
            raise ValueError(f"{owner}.mode={self.mode!r} is invalid: expected 'min' or 'max'")
        if self.async_mode not in ("off", "async", "async_pinned"):
            raise ValueError(f"{owner}.async_mode={self.async_mode!r} is invalid: expected 'off', 'async' or 'async_pinned'")
        if self.verify not in ("all", "sampled", "off"):
            raise ValueError(f"{owner}.verify={self.verify!r} is invalid: expected 'all', 'sampled' or 'off'")
        if self.resume_mode == "best" and self.monitor is None:
            raise ValueError(f"{owner}.resume_mode='best' needs a monitor (e.g. monitor='val/loss')")


@dataclass(kw_only=True)
class FaultToleranceParameters:
    """Fault tolerance across replica groups with torchft (`FaultToleranceCallback`).

    A *replica group* is one job (one process, or ``torchrun``/``--nproc`` ranks) holding
    a full replica of the model (FSDP2/TP inside the group); the groups train together
    through a torchft lighthouse and survive the loss of whole groups.

    Attributes:
        lighthouse: the lighthouse's address, ``"http://host:port"`` (start one with
            ``python -m dream_trainer.fault_tolerance lighthouse``). None: the ``TORCHFT_LIGHTHOUSE``
            environment variable.
        replica_group_id: this group's id, an int >= 0, distinct per group and the same
            when a group is restarted. None: the ``REPLICA_GROUP_ID`` environment variable.
        min_replica_size: the number of groups that must take part in a step for it to be
            committed (with fewer, the step is not applied and the group waits for peers).
        start_groups: a fresh run (no group has committed a step) waits at its first step
            until this many groups are in the quorum, so that they start together, for at
            most `quorum_timeout_s` (then `FaultToleranceError`); later quorums, and a group
            joining a run under way, never wait for it. 1: start with whoever is there.
        checkpoint_interval: steps between disk checkpoints while fault tolerant (the run's
            `CheckpointCallback` saves every N steps; needs one). Healing from a live peer
            persists nothing: these checkpoints are what survives losing every group at once.
            None: the `CheckpointCallback`'s own schedule.
        max_failures: how many replica-group losses (a group that took part in a step and
            is missing from the next quorum) this group tolerates; one more halts the run
            with `FaultToleranceError`. None: no limit.
        heartbeat_interval: seconds between this group's heartbeats to the lighthouse: at
            most half the lighthouse's heartbeat timeout (checked when the group starts).
        lighthouse_heartbeat_timeout_s: the lighthouse's ``--heartbeat-timeout-ms``, in
            seconds (default 1: dream_trainer's lighthouse); `heartbeat_interval` is checked
            against it (against the real one when a `Lighthouse` of this process serves it).
        timeout_s: limit for one cross-group operation: the gradient all-reduce, the commit
            vote, a heal's transfer.
        quorum_timeout_s: limit for forming a quorum (waiting for the lighthouse).
        connect_timeout_s: limit for reaching the lighthouse and the peers; an unreachable
            lighthouse at start fails within it, before any model is built.
        hostname: the address peers use to reach this group (its manager, its heal server
            and, for a one-process group, its store); those servers listen on this address
            only, not on every interface. None: ``127.0.0.1`` when the lighthouse is on
            loopback, else this machine's hostname (an error when it does not resolve).
        init_sync: at step 0, every group but one heals from that one (identical start even
            if the groups' initializations differ). False: trust identical seeding.
    """

    lighthouse: str | None = None
    replica_group_id: int | None = None
    min_replica_size: int = 1
    start_groups: int = 1
    checkpoint_interval: int | None = None
    max_failures: int | None = None
    heartbeat_interval: float = 0.1
    lighthouse_heartbeat_timeout_s: float = 1.0
    timeout_s: float = 60.0
    quorum_timeout_s: float = 120.0
    connect_timeout_s: float = 10.0
    hostname: str | None = None
    init_sync: bool = True

    def __post_init__(self) -> None:
        owner = "FaultToleranceParameters"
        flags(owner, self, "init_sync")
        if self.lighthouse is not None and not _LIGHTHOUSE_RE.match(str(self.lighthouse)):
            raise ValueError(
                f"{owner}.lighthouse={self.lighthouse!r} is invalid: expected 'http://host:port' "
                "(e.g. 'http://127.0.0.1:29510') or None (TORCHFT_LIGHTHOUSE)"
            )
        positive_int(owner, "replica_group_id", self.replica_group_id, allow_none=True, allow_zero=True)
        positive_int(owner, "min_replica_size", self.min_replica_size)
        positive_int(owner, "start_groups", self.start_groups)
        positive_int(owner, "checkpoint_interval", self.checkpoint_interval, allow_none=True)
        positive_int(owner, "max_failures", self.max_failures, allow_none=True, allow_zero=True)
        for name in ("heartbeat_interval", "lighthouse_heartbeat_timeout_s", "timeout_s", "quorum_timeout_s",
                     "connect_timeout_s"):
            seconds(owner, name, getattr(self, name))
        if self.hostname is not None and (not isinstance(self.hostname, str) or not self.hostname.strip()):
            raise ValueError(f"{owner}.hostname={self.hostname!r} is invalid: expected a host name or address, or None")


_LIGHTHOUSE_RE = re.compile(r"^https?://[^/:\s]+(:\d+)?/?$|^https?://\[[0-9a-fA-F:]+\](:\d+)?/?$")


@dataclass(kw_only=True)
class TrainerConfig:
    """Everything a trainer needs.

    Attributes:
        experiment: name of the experiment (a folder under `root_dir`).
        run_name: name of this run (default: a timestamp, agreed on by every rank).
        root_dir: where run directories go: ``root_dir/experiment/run_name``.
        seed: seed of every RNG (the same on every rank; 0 <= seed < 2**32; None: not seeded).
        callbacks: the callbacks, as a list, a name -> callback mapping, a collection, or a
            single callback.
    """

    experiment: str = "default"
    run_name: str | None = None
    root_dir: str | os.PathLike[str] = "runs"
    seed: int | None = 42
    training_parameters: TrainingParameters = field(default_factory=TrainingParameters)
    device_parameters: DeviceParameters = field(default_factory=DeviceParameters)
    logging_parameters: LoggingParameters = field(default_factory=LoggingParameters)
    callbacks: CallbackCollection | list[Callback[Any]] | dict[str, Callback[Any]] | Callback[Any] | None = field(
        default=None, metadata={"code": True})  # objects: never from a config file (dream_trainer.config_files)

    def __post_init__(self) -> None:
        for name in ("experiment", "run_name"):
            value = getattr(self, name)
            if value is None and name == "run_name":
                continue
            check_name(f"TrainerConfig.{name}", value)
        self.root_dir = path_field("TrainerConfig", "root_dir", self.root_dir)  # type: ignore[assignment]
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32):
            raise ValueError(f"TrainerConfig.seed={seed!r} is invalid: expected an int in [0, 2**32) or None")
        self.callbacks = _callbacks(self.callbacks)
        for name, kind in (
            ("training_parameters", TrainingParameters),
            ("device_parameters", DeviceParameters),
            ("logging_parameters", LoggingParameters),
        ):
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"TrainerConfig.{name} must be a {kind.__name__}, got {type(getattr(self, name)).__name__}")


def _callbacks(value: Any) -> Any:
    """A single callback becomes a one-element list; anything else that is not a list,
    tuple, mapping or collection of callbacks is an error (the collection checks the items)."""
    from collections.abc import Mapping

    from dream_trainer.protocol.base import Callback
    from dream_trainer.protocol.collection import CallbackCollection

    if value is None or isinstance(value, (CallbackCollection, Mapping)):
        return value
    if isinstance(value, Callback):
        return [value]
    if isinstance(value, (list, tuple)):
        return list(value)
    raise TypeError(
        f"TrainerConfig.callbacks={value!r} is invalid: expected a list of callbacks, a name -> callback "
        "mapping, a CallbackCollection, a single Callback or None"
    )

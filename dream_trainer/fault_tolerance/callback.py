"""`FaultToleranceCallback`: train through the loss of whole replica groups (torchft)."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import IO, Any

from dream_trainer.checkpoint import Checkpointer
from dream_trainer.configs import FaultToleranceParameters
from dream_trainer.errors import FaultToleranceError
from dream_trainer.fault_tolerance.history import run_history
from dream_trainer.fault_tolerance.sampler import FaultTolerantSampler
from dream_trainer.fault_tolerance.world import FaultTolerantWorld
from dream_trainer.protocol.base import Callback
from dream_trainer.trainer.base import BaseTrainer

logger = logging.getLogger(__name__)


class FaultToleranceCallback(Callback[BaseTrainer]):
    """Make this job one replica group of a fault-tolerant run (see `FaultToleranceParameters`
    and ``docs/fault_tolerance.md``).

    - `pre_launch`: installs a `FaultTolerantWorld` (``trainer.set_world``): the lighthouse
      is checked before anything is built, the world's replicate dimension is torchft's.
    - this group's files go to ``<run_dir>/replica_group_<id>/`` (logs, checkpoints; an
      explicit `CheckpointParameters.root_dir` gets a ``replica_group_<id>`` subdirectory
      too), so the groups of one run never write the same files: the world's
      `run_subdirectory`, which the trainer's ``run_dir`` and `CheckpointCallback` follow.
    - `post_configure`: the trainer's whole state (models, optimizers, schedulers, counters,
      callbacks, RNG and data position) is what a heal sends and loads; with
      ``checkpoint_interval`` the run's `CheckpointCallback` saves every N steps (the
      world's `checkpoint_interval`).
    - resume: a group resumes from the newest checkpoint of *any* group of the run it can
      see (the world's `resume_roots`: its peers may have finished or be gone); the first
      quorum fails with `FaultToleranceError` rather than train on from an older state than
      the run's files show (see `FaultTolerantWorld.progress`).
    - every step: the quorum before the step's data, gradients averaged over the groups, the
      update applied only when the quorum commits (see `FaultTolerantWorld`).
    - checkpoints carry the torchft Manager's state (committed steps), so losing every group
      at once still resumes from disk.

    Logged on log steps: ``train/ft_participants``, ``train/ft_replica_losses``,
    ``train/ft_heals``, ``train/ft_uncommitted_steps``. Events go to ``<group
    dir>/fault_tolerance.jsonl`` (group rank 0), one JSON object per line: quorum changes,
    heals, steps not committed, lost groups, a ``step`` line on every log step, and an
    ``end`` line (its ``status``) when the group stops.

    Needs one optimizer (torchft commits once per step), ``max_steps`` and an unbounded
    epoch: a group that joins mid-run continues from its peers' step, so epochs of
    fixed length would not line up. Use `FaultTolerantSampler` for the training data.
    """

    critical = True
    order = -1000  # first: a heal (at the fetch) precedes every hook of the step

    def __init__(self, params: FaultToleranceParameters | None = None):
        if params is not None and not isinstance(params, FaultToleranceParameters):
            raise TypeError(f"FaultToleranceCallback takes a FaultToleranceParameters, got {type(params).__name__}")
        self.params = params or FaultToleranceParameters()
        self.world: Any = None
        self.heals = 0
        self.uncommitted = 0
        self._file: IO[str] | None = None
        self._lock = threading.Lock()
        self._run_dir: Path | None = None  # the run's directory: every group's lies below it

    # ------------------------------------------------------------------ lifecycle
    def pre_launch(self) -> None:
        trainer = self.trainer
        training = trainer.training_parameters
        if training.max_steps is None:
            raise ValueError("FaultToleranceCallback needs TrainingParameters(max_steps=...): fault-tolerant runs are "
                             "counted in committed steps (groups join and leave mid-epoch)")
        if training.train_steps_per_epoch is not None:
            raise ValueError(
                f"TrainingParameters.train_steps_per_epoch={training.train_steps_per_epoch} cannot be used with "
                "FaultToleranceCallback: a group that joins mid-run continues from its peers' step, so fixed epochs "
                "would not line up across groups; use max_steps and val_every_n_steps"
            )
        self.world = FaultTolerantWorld(trainer.world.device_parameters, self.params)  # checks group id, hostname
        trainer.set_world(self.world)

    def pre_configure(self) -> None:
        trainer = self.trainer
        # The trainer's run directory is this group's (the world's run_subdirectory, which
        # the checkpoint callback follows too); the run's, above it, holds every group's.
        self._run_dir = Path(trainer.run_dir).parent
        trainer.run_dir.mkdir(parents=True, exist_ok=True)
        if self.world.rank == 0:
            self._file = open(trainer.run_dir / "fault_tolerance.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        self.world.on_event = self._record

    def post_configure(self) -> None:
        trainer = self.trainer
        optimizers = trainer.named_optimizers()
        if len(optimizers) != 1:
            raise ValueError(
                f"FaultToleranceCallback supports one optimizer (torchft commits once per step); the trainer has "
                f"{len(optimizers)}: {sorted(optimizers)}"
            )
        optimizer = next(iter(optimizers.values()))
        self.world.attach(
            state_dict=lambda: _to_local(trainer.state_dict()),  # the checkpoints' composition
            load_state_dict=lambda state: trainer.load_state_dict(_from_local(state, self.world)),
            parameters=lambda: [p for group in optimizer.param_groups for p in group["params"]],
            accumulating=lambda: trainer.is_accumulating_gradients,
        )
        self._checkpoint_schedule()

    def _checkpoint_schedule(self) -> None:
        """``checkpoint_interval`` is applied by the checkpoint callback (it reads the world's
        `checkpoint_interval`); here: that there is one to apply it."""
        interval = self.params.checkpoint_interval
        if interval is not None and not any(isinstance(cb, Checkpointer) for cb in self.trainer.callbacks):
            raise ValueError(f"FaultToleranceParameters.checkpoint_interval={interval} needs a CheckpointCallback "
                             "in the callbacks")

    def pre_setup(self) -> None:
        """Hand the run's history (what its groups' event files say) to the world, which
        checks this group's first quorum against it. The checkpoint callback has resumed
        from the newest checkpoint of any group already (the world's `resume_roots`)."""
        world = self.world
        found: Any = None
        if world.is_rank_zero:  # one look at the files for the whole group
            try:
                found = run_history(self._run_dir)  # type: ignore[arg-type]
            except FaultToleranceError as exc:  # a path that leads out of the run: every rank raises it
                found = exc
        found = world.broadcast_object(found)
        if isinstance(found, FaultToleranceError):
            raise found
        world.progress = found

    def post_setup(self) -> None:
        trainer = self.trainer
        sampler = getattr(trainer.train_dataloader, "batch_sampler", None)
        accumulation = trainer.gradient_accumulation_steps
        loader = trainer.train_dataloader
        if isinstance(sampler, FaultTolerantSampler):
            if sampler.micro_batches != accumulation:
                raise ValueError(
                    f"FaultTolerantSampler(micro_batches={sampler.micro_batches}) but the trainer accumulates "
                    f"{accumulation} micro-batch(es) per step (gradient_accumulation_steps): they must be equal"
                )
            if getattr(loader, "num_workers", 0):
                raise ValueError("FaultTolerantSampler needs DataLoader(num_workers=0): workers prefetch indices "
                                 "before the step's quorum decides who takes which data")
        elif getattr(loader, "follows_quorum", False) is not True:
            logger.warning(
                "the training data comes from neither a TokenLoader nor a FaultTolerantSampler: it will not follow "
                "the quorum (when groups leave or join, samples are repeated or skipped, and a healed group's loader "
                "does not move)"
            )
        if trainer.train_steps_per_epoch is None:
            raise ValueError("FaultToleranceCallback needs a training loader with a length (or FaultTolerantSampler): "
                             "without one the trainer looks a batch ahead, before that step's quorum")

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        trainer = self.trainer
        if trainer.is_accumulating_gradients:
            return
        if trainer.step_skipped:
            self.uncommitted += 1
        if trainer.is_log_step:
            self._record({"event": "step", "step": trainer.global_step, "committed": not trainer.step_skipped,
                          "participants": self.world.participants, "time": time.time(), "group": self.world.group_id})
            trainer.log_dict({
                "train/ft_participants": float(self.world.participants),
                "train/ft_replica_losses": float(self.world.replica_losses),
                "train/ft_heals": float(self.heals),
                "train/ft_uncommitted_steps": float(self.uncommitted),
            })

    def _record(self, event: dict[str, Any]) -> None:
        if event["event"] == "heal":
            self.heals += 1
            self.trainer.goodput.add("heal", float(event.get("seconds", 0.0)))  # the quorum that healed: the ledger's
        with self._lock:  # "heal_sent" comes from torchft's quorum thread
            if self._file is not None:
                self._file.write(json.dumps(event) + "\n")
                self._file.flush()

    def on_teardown(self, status: str) -> None:
        trainer = self.trainer
        if self.world is not None:  # a finished group tells a late one (FaultTolerantWorld.progress)
            self._record({"event": "end", "status": status, "step": trainer.global_step, "time": time.time(),
                          "group": self.world.group_id})
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"manager": self.world.state_dict() if self.world is not None else {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.world.load_state_dict(state.get("manager", {}))


_SHARD = "__dream_trainer_dtensor__"


def _to_local(state: Any) -> Any:
    """Each DTensor as its local shard and how to rebuild it (mesh dimension names,
    placements, global shape): what a heal sends. The peer's rank has the same layout."""
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_map_only

    def local(t: DTensor) -> dict[str, Any]:
        names = t.device_mesh.mesh_dim_names
        if names is None:
            raise ValueError("a heal needs named device meshes (DTensors on the world's mesh)")
        return {_SHARD: t.to_local(), "mesh": tuple(names), "placements": tuple(t.placements),
                "shape": tuple(t.shape), "stride": tuple(t.stride())}

    return tree_map_only(DTensor, local, state)


def _from_local(state: Any, world: Any) -> Any:
    """What `_to_local` made, with this rank's own mesh."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        if _SHARD in state:
            return DTensor.from_local(state[_SHARD].to(world.device), world.get_mesh(*state["mesh"]),
                                      state["placements"], run_check=False, shape=state["shape"], stride=state["stride"])
        return {k: _from_local(v, world) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_from_local(v, world) for v in state)
    return state

"""`CheckpointCallback`: distributed checkpoints (torch.distributed.checkpoint) of the
whole trainer, saved on a schedule, at preemption and at the end; resumed at setup.

- What: ``trainer.state_dict()`` — models and optimizers (any sharding), schedulers,
  counters, callback states, every rank's RNG states and dataloader position.
- Resume: in `post_configure`, from the newest checkpoint that verifies (``verify``,
  `dream_trainer.checkpoint_resume`); incomplete saves are removed. A restart that finds no
  checkpoint where its earlier attempt committed one fails (`dream_trainer.restarts`).
- When: every N steps (after that step's validation, so a resumed run continues exactly),
  every N epochs, at the end of `fit()`, and when the run is preempted (SIGTERM/SIGINT
  handled at a step boundary, see `BaseTrainer`).
- How: into a staging directory with a manifest of checksums, committed by rename once
  complete (`dream_trainer.checkpoint`, `dream_trainer.checkpoint_manifest`).
  With ``async_mode`` the loop waits only for a copy of the state; writing, the commit and
  pruning run in a background thread (collectives on their own gloo process group), one
  save at a time; its errors are raised at the next step; the end of `fit()` waits for it.
"""

from __future__ import annotations

import logging
import shutil
import time
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any

from dream_trainer.protocol.base import Callback
from dream_trainer.checkpoint import (CheckpointError, check_shared_root, check_writable, clean_staging, commit,
                                      committed_name, dcp_errors, describe, list_checkpoints, load_checkpoint,
                                      staging_dir, to_remove)
from dream_trainer.checkpoint_resume import choose_resume
from dream_trainer.checkpoint_staging import PinnedStager, write_state, write_state_async
from dream_trainer.configs import CheckpointParameters
from dream_trainer.restarts import fresh_start_refusal, note_checkpoints, warn_if_node_local
from dream_trainer.serialization import UnsafeStateError
from dream_trainer.trainer.base import BaseTrainer

logger = logging.getLogger(__name__)


class CheckpointCallback(Callback[BaseTrainer]):
    """Save and resume the trainer with DCP. See `CheckpointParameters`.

    Attributes:
        root: the checkpoint directory (known after setup).
        resumed_from: the checkpoint this run resumed from, if any.
        saved: committed checkpoints of this run, oldest first.
        blocked_s: per save, the seconds the training loop waited (for a save still in
            flight too; with ``async_mode="off"``, the whole save and commit).
        save_s: per finished save, the seconds from its start until it was committed.
    """

    critical = True
    order = 1000  # last in every hook: the other callbacks' state is current when saved

    def __init__(self, params: CheckpointParameters | None = None):
        if params is not None and not isinstance(params, CheckpointParameters):
            raise TypeError(f"CheckpointCallback takes a CheckpointParameters, got {type(params).__name__}")
        self.params = params or CheckpointParameters()
        self.root: Path | None = None
        self.resumed_from: Path | None = None
        self.saved: list[Path] = []
        self.blocked_s: list[float] = []
        self.save_s: list[float] = []
        self._last_step: int | None = None
        self._pending: tuple[Future[None], Path, int] | None = None
        self._group: Any = None
        self._stager: Any = None
        self._after_validation = False
        self._at_epoch_end = False
        self.every_n_steps = self.params.every_n_steps  # the schedule in force (see post_configure)

    # ------------------------------------------------------------------ lifecycle
    def pre_launch(self) -> None:
        """Fail before any process group or model exists: a missing resume path, or a
        checkpoint directory that cannot be created or written."""
        mode = self.params.resume_mode
        if mode not in (None, "last", "best") and not Path(mode).exists():
            raise CheckpointError(f"CheckpointParameters.resume_mode={mode!r}: no checkpoint at {Path(mode).resolve()}")
        root = self.params.root_dir or self.trainer.config.root_dir
        what = "CheckpointParameters.root_dir" if self.params.root_dir else "TrainerConfig.root_dir"
        check_writable(Path(root), what)

    def post_configure(self) -> None:
        """Resume here: models, optimizers, schedulers and dataloaders exist, and the
        other callbacks see the restored state from `pre_setup` on."""
        world = self.trainer.world
        self.root = self.checkpoint_root()
        if world.cluster.num_nodes > 1:  # before any step: a node-local root fails here, on every rank
            check_shared_root(world, self.root, world.cluster.node_rank)
        elif world.is_rank_zero:  # one node: a root a requeue to another node would lose is warned
            warn_if_node_local(self.root, world.cluster.num_nodes)
        self.every_n_steps = self._schedule(world.checkpoint_interval)
        if self.params.async_mode != "off":
            # Background saves run collectives; on their own group they never interleave
            # with the training loop's.
            self._group = world.new_group(backend="gloo")
            if self.params.async_mode == "async_pinned":
                self._stager = PinnedStager()
        path = self._choose_resume()
        if world.is_rank_zero:
            note_checkpoints(self.trainer.run_dir, self.root, None)  # where a restart must find them
            for stale in clean_staging(self.root):
                logger.warning("removed incomplete checkpoint %s (a save that did not finish)", stale)
        if path is not None:
            self.load(path)

    def checkpoint_root(self) -> Path:
        """Where this run's checkpoints go: ``CheckpointParameters.root_dir`` (under it, the
        world's ``run_subdirectory``: a world sharing the run, such as a replica group, has
        a directory of its own), else ``<run_dir>/checkpoints`` (the run directory already
        follows the world). Known from ``pre_configure`` on."""
        world, explicit = self.trainer.world, self.params.root_dir
        return Path(explicit) / (world.run_subdirectory or "") if explicit else self.trainer.run_dir / "checkpoints"

    def resume_roots(self) -> list[Path]:
        """The checkpoint roots a resume looks in: with ``resume_mode="last"`` this run's
        root and those of the worlds it shares the run with (the world's ``resume_roots``),
        with ``"best"`` this run's root, else none (a path, or no resume). Known from
        ``pre_configure`` on; `RunRecordCallback` checks the saved configuration against
        exactly these."""
        mode = self.params.resume_mode
        if mode == "last":
            return [Path(r) for r in self.trainer.world.resume_roots(self.checkpoint_root())]
        return [self.checkpoint_root()] if mode == "best" else []

    def _schedule(self, needed: int | None) -> int | None:
        """``every_n_steps`` in force: the world's `checkpoint_interval` when it needs one
        (a fault-tolerant world), which a different ``CheckpointParameters.every_n_steps``
        contradicts, else the parameters'."""
        every = self.params.every_n_steps
        if needed is None:
            return every
        if every is not None and every != needed:
            world = type(self.trainer.world).__name__
            raise ValueError(
                f"the world ({world}) needs checkpoint_interval={needed} but CheckpointParameters.every_n_steps={every}: "
                "set one of them (for a fault-tolerant run: FaultToleranceParameters.checkpoint_interval)"
            )
        return needed

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        trainer = self.trainer
        if trainer.is_accumulating_gradients or trainer.step_skipped:  # nothing new to save
            return
        self._poll()
        every, max_steps = self.every_n_steps, trainer.training_parameters.max_steps
        run_ends = max_steps is not None and trainer.global_step >= max_steps
        if not ((every is not None and trainer.global_step % every == 0) or (run_ends and self.params.at_fit_end)):
            return
        # Save where an uninterrupted run stands between this step and the next, so a
        # resumed run continues exactly: after this step's validation, or after the
        # epoch's end hooks when the epoch ends here. A run cut off by max_steps is saved
        # before its epoch-end hooks, which a longer run would not run at this step.
        if trainer.validation_due:
            self._after_validation = True
        elif trainer.is_last_batch and not run_ends:
            self._at_epoch_end = True
        else:
            self.save()

    def post_validation_epoch(self, result: dict[str, Any]) -> None:
        if self._after_validation and not self.trainer.sanity_checking:
            self._after_validation = False
            self.save()

    def post_epoch(self) -> None:
        every = self.params.every_n_epochs
        if self._at_epoch_end or (every is not None and (self.trainer.current_epoch + 1) % every == 0):
            self._at_epoch_end = False
            self.save()

    def post_fit(self) -> None:
        if self.params.at_fit_end:
            self.save()
        self.wait()

    def on_interrupt(self, error: BaseException) -> None:
        if self.trainer.status == "preempted":  # at a step boundary: a consistent state
            self.save(blocking=True)  # a failure here fails the run (never a false "preempted")
            self.wait()
        else:  # a crash mid-step: keep the last good checkpoint, finish a save under way
            self.wait(raise_errors=False)

    def on_teardown(self, status: str) -> None:
        """Every path ends here: a save still in flight is finished (its error logged), the
        staging buffers and the background group are released."""
        try:
            self.wait(raise_errors=False)
        finally:
            self._close()

    # ------------------------------------------------------------------ saving
    def save(self, blocking: bool = False) -> None:
        """Checkpoint the trainer now (all ranks must call it). Returns once the state is
        copied (async) or written (``async_mode="off"`` or `blocking`)."""
        trainer = self.trainer
        step = trainer.global_step
        if step == self._last_step or self.root is None:
            return
        start = time.perf_counter()
        self.wait()  # at most one save in flight (waiting for it counts as blocked time)
        staging = staging_dir(self.root, step)
        staging.mkdir(parents=True, exist_ok=True)
        meta = self._meta(step)
        state = trainer.state_dict()
        if self.params.async_mode == "off" or blocking:
            write_state(state, staging)
            self._commit(staging, meta)
            self.blocked_s.append(time.perf_counter() - start)
            self.save_s.append(self.blocked_s[-1])
            trainer.callbacks.on_checkpoint_saved(committed_name(staging), step)
        else:
            def committed() -> None:  # in the writer thread: commit and prune there too
                self._commit(staging, meta)
                self.save_s.append(time.perf_counter() - start)

            done = write_state_async(state, staging, self._group, self._stager, committed)
            self._pending = (done, staging, step)
            self.blocked_s.append(time.perf_counter() - start)
        trainer.goodput.add("checkpoint", self.blocked_s[-1])  # the ledger: the training thread was blocked
        self._last_step = step

    def _meta(self, step: int) -> dict[str, Any]:
        """What ``dream_trainer.json`` records of the save at `step`."""
        trainer, monitor = self.trainer, self.params.monitor
        score = trainer.logged_metrics.get(monitor) if monitor else None
        if monitor and score is None:
            logger.warning("checkpoint at step %d has no score: %r has not been logged yet", step, monitor)
        return {"step": step, "epoch": trainer.current_epoch, "score": score, "monitor": monitor,
                "world_size": trainer.world.world_size, "time": time.time()}

    def wait(self, raise_errors: bool = True) -> None:
        """Wait for the background save (if any): written and committed. Its error, if
        any, is raised here as a `CheckpointError`."""
        if self._pending is None:
            return
        done, staging, step = self._pending
        self._pending = None
        try:
            done.result()
        except dcp_errors() as exc:
            if not raise_errors:
                logger.error("background checkpoint save to %s failed: %s", staging, describe(exc))
                return
            raise CheckpointError(f"background checkpoint save to {staging} failed: {describe(exc)}") from exc
        self.trainer.callbacks.on_checkpoint_saved(committed_name(staging), step)

    def _poll(self) -> None:
        if self._pending is not None and self._pending[0].done():
            self.wait()  # raises the background error, if any, on this step

    def _commit(self, staging: Path, meta: dict[str, Any]) -> None:
        if not self.trainer.world.is_rank_zero:
            return
        final = commit(staging, meta)
        self.saved.append(final)
        note_checkpoints(self.trainer.run_dir, final.parent, meta["step"])
        p = self.params
        for old in to_remove(list_checkpoints(final.parent), p.keep_last, p.keep_best, p.mode, p.monitor):
            shutil.rmtree(old.path, ignore_errors=True)
            logger.info("removed old checkpoint %s", old.path)

    def _close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self._group is not None:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group(self._group)
            self._group = None

    # ------------------------------------------------------------------ resuming
    def _choose_resume(self) -> Path | None:
        """The newest (or best, or named) checkpoint that verifies, agreed by every rank
        (`dream_trainer.checkpoint_resume.choose_resume`); a restart that lost its
        checkpoints fails (rank 0 decides for all)."""
        assert self.root is not None
        roots = self.resume_roots()
        refusal = partial(fresh_start_refusal, self.trainer.run_dir, roots, self.params.allow_fresh_restart)
        return choose_resume(self.trainer.world, self.params, self.root, roots, refusal)

    def load(self, path: str | Path) -> None:
        """Restore the trainer from the checkpoint at `path`."""
        trainer = self.trainer
        try:  # a template of the trainer's state, filled from the checkpoint, restored once
            template = load_checkpoint(Path(path), trainer.state_dict(), strict=self.params.strict)
            trainer.load_state_dict(template, strict=self.params.strict)
        except UnsafeStateError as exc:  # per-rank state, decoded by the trainer
            raise UnsafeStateError(f"checkpoint {path}: {exc}") from None
        self.resumed_from = Path(path)
        self._last_step = trainer.global_step
        logger.info("resumed from %s at step %d, epoch %d", path, trainer.global_step, trainer.current_epoch)
        trainer.callbacks.on_checkpoint_loaded(Path(path), trainer.global_step)


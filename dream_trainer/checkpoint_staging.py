"""Writing a checkpoint's state: `write_state` / `write_state_async` (DCP, each rank hashing
the files it wrote for the manifest), and staging for ``async_mode="async_pinned"`` saves:
`PinnedStager`, DCP's ``DefaultStager`` kept from one save to the next where this torch
allows it (`stager_reusable`)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch


class PinnedStager:
    """The stager of ``async_mode="async_pinned"`` saves: DCP's ``DefaultStager`` copying the
    state into pinned host memory (CUDA) with non-blocking copies, its buffers kept from one
    save to the next. torch 2.11's ``DefaultStager`` closes itself at the end of every stage
    (pytorch/pytorch#183413: a second save fails with ``KeyError: <class 'type'>``); where
    the installed torch does (`stager_reusable`), each save gets a fresh one (the buffers
    were not kept there anyway)."""

    def __init__(self) -> None:
        self._stager: Any = None

    def for_save(self) -> Any:
        """The stager to hand to this save's ``dcp.async_save``."""
        if self._stager is not None and not stager_reusable():
            self._stager.close()
            self._stager = None
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(StagingOptions(cuda, False, False, cuda))
        return self._stager

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None


def write_state(state: dict[str, Any], staging: Path) -> None:
    """Write `state` into the directory `staging` with DCP, each rank hashing the files it
    wrote (`dream_trainer.checkpoint_manifest.manifest_writer`); a failure raises
    `CheckpointError`."""
    import torch.distributed.checkpoint as dcp

    from dream_trainer.checkpoint import dcp_errors, describe
    from dream_trainer.checkpoint_manifest import manifest_writer
    from dream_trainer.errors import CheckpointError

    try:
        dcp.save(state, checkpoint_id=str(staging), storage_writer=manifest_writer(staging))
    except dcp_errors() as exc:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(f"checkpoint save to {staging} failed: {describe(exc)}") from exc


def write_state_async(state: dict[str, Any], staging: Path, group: Any, pinned: PinnedStager | None,
                      then: Callable[[], None]) -> Future[None]:
    """`write_state` in DCP's background thread, its collectives on `group`: returns once
    the state is copied (by `pinned`'s stager, or by a stager of this save's own, closed
    when the upload ends); runs `then` in that thread once written, and returns a future
    that ends after `then` (with the error of either)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from dream_trainer.checkpoint_manifest import manifest_writer

    writer = manifest_writer(staging)
    # Without a stager of ours: what dcp.async_save makes when given none, which it no
    # longer does once handed a storage writer (the writer would stage).
    own = None if pinned is not None else DefaultStager(StagingOptions(False, False, False, False))
    done: Future[None] = Future()

    def finish(upload: Any) -> None:
        try:
            if own is not None:
                own.close()
            upload.result()
            then()
            done.set_result(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread
            done.set_exception(exc)

    try:
        upload = dcp.async_save(state, checkpoint_id=str(staging), storage_writer=writer, process_group=group,
                                async_stager=own if pinned is None else pinned.for_save())
    except BaseException:
        if own is not None:
            own.close()
        raise
    upload.add_done_callback(finish)
    return done


_REUSABLE: list[bool] = []


def stager_reusable() -> bool:
    """Whether this torch's ``DefaultStager`` stages twice (asked once per process, of a
    throw-away stager and a one-element state)."""
    if not _REUSABLE:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        probe = DefaultStager(StagingOptions(False, False, False, False))
        try:
            for _ in range(2):
                probe.stage({"probe": torch.zeros(1)})
            _REUSABLE.append(True)
        except KeyError:
            _REUSABLE.append(False)
        finally:
            probe.close()
    return _REUSABLE[0]

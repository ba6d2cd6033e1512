"""Staging for ``async_mode="async_pinned"`` checkpoint saves: `PinnedStager`, DCP's
``DefaultStager`` kept from one save to the next where this torch allows it
(`stager_reusable`)."""

from __future__ import annotations

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

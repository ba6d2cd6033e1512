"""Durable file writes: what a rename needs to survive a crash (standard library only)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_dir"]


def fsync_dir(directory: str | Path) -> None:
    """Flush a directory's entries (a rename into it) to disk, where the platform can (a
    directory that cannot be opened or synced, e.g. on some network file systems, is left
    as it is)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

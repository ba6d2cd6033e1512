"""The cuda lane's helpers. `hide_cuda` (tests/conftest.py calls it before any test) hides the
GPUs from the test process and every process it starts, so that every other test runs on the
CPU; `gpu_count` asks a subprocess how many GPUs the machine has (the test process never
initializes CUDA); `on_cuda` runs a lane test's body in fresh processes that see them."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from dream_trainer.testing import spawn_world

_MACHINE: list[str | None] = []
"""The machine's CUDA_VISIBLE_DEVICES (None: not set), kept by `hide_cuda` in the test
process (a process a test starts has its own, empty, copy of this module)."""


def hide_cuda() -> None:
    """Hide CUDA from this process and its children (``CUDA_VISIBLE_DEVICES=""``, before torch
    looks for a GPU), keeping the machine's value for the cuda lane."""
    if not _MACHINE:
        _MACHINE.append(os.environ.get("CUDA_VISIBLE_DEVICES"))
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def _machine_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if _MACHINE and _MACHINE[0] is not None:
        env["CUDA_VISIBLE_DEVICES"] = _MACHINE[0]
    return env


@functools.lru_cache(maxsize=1)
def gpu_count() -> int:
    """CUDA GPUs this machine shows (0 without an NVIDIA driver: no subprocess then)."""
    if shutil.which("nvidia-smi") is None and not os.path.exists("/dev/nvidiactl"):
        return 0
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                           capture_output=True, text=True, timeout=120, env=_machine_env())
    try:
        return int(probe.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return 0


def on_cuda(fn: Callable[..., Any], *args: Any, world_size: int = 1, timeout: float = 600.0) -> list[Any]:
    """``fn(*args)`` on `world_size` fresh processes that see the GPUs (`spawn_world`: a
    failure or an assertion in `fn` fails the test with its traceback); each rank's result.
    The machine's CUDA_VISIBLE_DEVICES (or every GPU) is set in each process before `fn`
    runs, before anything there initializes CUDA."""
    visible = _MACHINE[0] if _MACHINE and _MACHINE[0] is not None else ",".join(map(str, range(gpu_count())))
    return spawn_world(world_size, fn, *args, timeout=timeout, env={"CUDA_VISIBLE_DEVICES": visible})

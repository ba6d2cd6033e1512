"""What every benchmark script shares: the machine description, the JSON file, the spread of
repeated measurements, a per-step timer (windows of steps: `StepWindowCallback`) and a
hand-written step paired with each framework step (`RawBeside`)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from dream_trainer import Callback
from dream_trainer.callbacks.step_window import spread, verdict  # noqa: F401  (the benchmarks' import point)




def cpu_model() -> str:
    """The processor's name (Linux: /proc/cpuinfo), else the platform's."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    """Where the numbers were taken: the host, the GPUs (if any) and the versions."""
    info: dict[str, Any] = {"platform": platform.platform(), "processor": cpu_model(), "cpu_count": os.cpu_count(),
                            "python": sys.version.split()[0], "torch": torch.__version__,
                            "torchao": _version("torchao"), "date": time.strftime("%Y-%m-%d")}
    if torch.cuda.is_available():
        info["cuda"] = torch.version.cuda
        info["gpus"] = [f"{torch.cuda.get_device_name(i)} (sm_{''.join(map(str, torch.cuda.get_device_capability(i)))}, "
                        f"{torch.cuda.get_device_properties(i).total_memory / 2**30:.0f} GiB)"
                        for i in range(torch.cuda.device_count())]
    return info


def device_name(device: str) -> str:
    """The GPU's name on CUDA, else the processor's."""
    return torch.cuda.get_device_name(0) if device == "cuda" else cpu_model()


def write_json(result: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write `result` to `path` (creating its folder) and say where."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return out


PROFILED_STEPS = 4
"""``--profile``: after a run's timed window, 1 warm-up step and 3 profiled ones."""


def step_profiler(after: int, root: str) -> Any:
    """A `ProfileCallback` for the `PROFILED_STEPS` after the first `after` steps, its tables under `root`."""
    from dream_trainer.callbacks import ProfileCallback

    return ProfileCallback(skip_first=after, wait=0, warmup=1, active=PROFILED_STEPS - 1, with_stack=False,
                           record_shapes=False, row_limit=30, output_dir=os.path.join(root, "profile"))


def profile_table(profiler: Any) -> str | None:
    """The ops table `step_profiler` wrote (by device time on CUDA), or None."""
    tables = [p.read_text() for p in (profiler.exported if profiler else []) if p.name.startswith("key_averages")]
    return tables[0] if tables else None


def _sync(trainer: Any) -> None:
    if trainer.world.device.type == "cuda":
        torch.cuda.synchronize()  # deliberate: the window's edges are device time


class StepTimes(Callback[Any]):
    """Each optimizer step's wall time, from ``trainer.step_stats`` (synchronized on CUDA)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        if not self.trainer.is_accumulating_gradients:
            _sync(self.trainer)
            self.times.append(self.trainer.step_stats.step_time_s)


class RawBeside:
    """A hand-written step run right beside each framework step, timed on its own.

    `loader(batches)` is what the framework iterates: each time the framework asks for a
    batch, one hand-written step (`step(batch)`, on the run's own model and optimizer) first
    runs on the batch the raw loop's own iterator yields, timed on this thread's CPU clock
    from its fetch to its last free; then the framework's batch is fetched (the framework's
    time). Every framework step thus has its raw step next to it, on the same tensors in the
    same memory: drift and a busy machine hit both alike, step by step, and the paired
    difference is what the framework adds (the epoch-by-epoch pairing it replaced had a
    spread 5-10x wider on a shared 2-core machine). `chunk` > 1 runs that many raw steps
    together, then as many framework steps (``chunk`` = the epoch's steps: epoch pairing).
    The framework's time of a window = its elapsed CPU time - `seconds` spent in it.

    On a GPU the CPU clock misses the device's time: give `sync` (``torch.cuda.synchronize``)
    and read the ``*_wall`` times. The device is then synchronized before each raw step (what
    the framework queued is its time) and after it (the raw step's kernels are its own), so
    both start from an empty queue: neither hides its host time behind the other's kernels."""

    def __init__(self, step: Callable[[Any], None], chunk: int = 1, sync: Callable[[], None] | None = None) -> None:
        self.step, self.chunk, self.sync = step, chunk, sync
        self.seconds = 0.0  # the raw steps' CPU time so far
        self.wall = 0.0  # and their wall time
        self.count = 0  # raw steps so far

    def loader(self, batches: Any) -> _PairedLoader:
        """`batches` (re-iterable, with a length), each fetch paired with a raw step."""
        return _PairedLoader(self, batches)

    def mark(self) -> tuple[float, float, float, float, int]:
        """Now: a window's start (the clocks and the raw steps' totals)."""
        return time.thread_time(), time.perf_counter(), self.seconds, self.wall, self.count

    def window(self, start: tuple[float, float, float, float, int], steps: int) -> dict[str, float]:
        """Since `start`, in seconds per step: ``raw``/``framework`` (this thread's CPU time) and
        ``raw_wall``/``framework_wall`` (wall time); the framework's over its `steps`."""
        cpu, wall = time.thread_time() - start[0], time.perf_counter() - start[1]
        raw, raw_wall, n = self.seconds - start[2], self.wall - start[3], max(self.count - start[4], 1)
        return {"raw": raw / n, "framework": (cpu - raw) / steps,
                "raw_wall": raw_wall / n, "framework_wall": (wall - raw_wall) / steps}


class _PairedLoader:
    def __init__(self, raw: RawBeside, batches: Any) -> None:
        self.raw, self.batches = raw, batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> _PairedFetch:
        return _PairedFetch(self.raw, iter(self.batches), iter(self.batches))


class _PairedFetch:
    def __init__(self, raw: RawBeside, framework: Iterator[Any], beside: Iterator[Any]) -> None:
        self.raw, self.framework, self.beside, self.fetched = raw, framework, beside, 0

    def __iter__(self) -> _PairedFetch:
        return self

    def __next__(self) -> Any:
        if self.fetched % self.raw.chunk == 0:
            sync = self.raw.sync
            if sync is not None:
                sync()  # the framework's queued kernels: its time
            start, wall = time.thread_time(), time.perf_counter()
            for _ in range(self.raw.chunk):
                batch = next(self.beside, None)
                if batch is None:
                    break
                self.raw.step(batch)
                self.raw.count += 1
            del batch  # freed inside the raw step's time
            if sync is not None:
                sync()  # the raw step's kernels: its time
            self.raw.seconds += time.thread_time() - start
            self.raw.wall += time.perf_counter() - wall
        self.fetched += 1
        return next(self.framework)  # the framework's fetch: its own time

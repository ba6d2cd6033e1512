"""A custom memory profiler: peak memory per logging window, and a CUDA snapshot on request.

    python examples/callbacks/memory_profiler.py

Corrected here: the earlier version of this example read the CPU peak from ``getrusage``,
which is the peak since the process started (never per window), logged it under
``train/memory_peak_mb`` (the shipped ``MemoryMonitorCallback``'s name, with another
meaning) and left CUDA's allocation recording on when the run ended before `snapshot_at`.
This version reads ``trainer.world.memory_status()`` and resets the peaks with
``trainer.world.reset_peak_memory()`` (both devices), logs its own name, and stops the
recording on every path (``on_teardown``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dream_trainer import BaseTrainer, Callback

MB = 2**20


class MemoryProfiler(Callback[BaseTrainer]):
    """Logs ``train/memory_window_peak_mb`` on log steps: the peak since the previous log
    step, of the device's allocated memory on CUDA, of the process's resident set on CPU
    (where the OS cannot reset that peak, ``self.resettable`` is False and it is the peak
    since the process started). Resetting peaks is process-wide: another reader of
    ``memory_status()``'s peaks then sees them per window too. On CUDA, ``snapshot_at=N``
    records allocations from the start and dumps a snapshot at step N (open it at
    pytorch.org/memory_viz)."""

    critical = False

    def __init__(self, snapshot_at: int | None = None) -> None:
        if snapshot_at is not None and snapshot_at < 1:
            raise ValueError(f"MemoryProfiler(snapshot_at={snapshot_at!r}): expected a step >= 1 or None")
        self.snapshot_at = snapshot_at
        self.peaks: list[tuple[int, float]] = []
        self.snapshot: Path | None = None
        self.resettable = True
        self._recording = False

    def pre_fit(self) -> None:
        world = self.trainer.world
        self.resettable = world.reset_peak_memory()  # the first window starts here, not at import
        if world.device.type == "cuda" and self.snapshot_at is not None:
            torch.cuda.memory._record_memory_history()
            self._recording = True

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        trainer = self.trainer
        if trainer.is_accumulating_gradients or trainer.step_skipped:
            return
        if self._recording and trainer.global_step >= self.snapshot_at:  # type: ignore[operator]
            self.snapshot = Path(trainer.run_dir) / f"memory_snapshot_step{trainer.global_step}.pickle"
            torch.cuda.memory._dump_snapshot(str(self.snapshot))
            self._stop_recording()
        if not trainer.is_log_step:
            return
        peak = trainer.world.memory_status().peak_allocated / MB  # host counters: no device sync
        trainer.world.reset_peak_memory()
        self.peaks.append((trainer.global_step, peak))
        trainer.log_scalar("train/memory_window_peak_mb", peak)

    def on_teardown(self, status: str) -> None:
        self._stop_recording()  # the run ended before snapshot_at: recording must not outlive it

    def _stop_recording(self) -> None:
        if self._recording:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording = False


def main(argv: list[str] | None = None) -> tuple[Any, MemoryProfiler]:
    from _demo import run

    profiler = MemoryProfiler()
    trainer = run([profiler], argv)
    print("peak memory (MiB) by log step:", [(s, round(mb)) for s, mb in profiler.peaks])
    return trainer, profiler


if __name__ == "__main__":
    main()

"""A custom memory profiler: peak memory per logging window, and a CUDA snapshot on request.

    python examples/callbacks/memory_profiler.py
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path
from typing import Any

import torch

from dream_trainer import BaseTrainer, Callback


class MemoryProfiler(Callback[BaseTrainer]):
    """Logs ``train/memory_peak_mb`` on log steps: the device's peak allocation since the last
    log step on CUDA (the peak is reset each window), the process's peak resident set on CPU.
    On CUDA, ``snapshot_at=N`` records allocations from the start and dumps a snapshot at step
    N (open it at pytorch.org/memory_viz)."""

    critical = False

    def __init__(self, snapshot_at: int | None = None) -> None:
        self.snapshot_at = snapshot_at
        self.peaks: list[tuple[int, float]] = []

    def _cuda(self) -> bool:
        return self.trainer.world.device.type == "cuda"

    def pre_fit(self) -> None:
        if self._cuda() and self.snapshot_at is not None:
            torch.cuda.memory._record_memory_history()

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        trainer = self.trainer
        if trainer.is_accumulating_gradients:
            return
        if self._cuda() and trainer.global_step == self.snapshot_at:
            path = Path(trainer.run_dir) / f"memory_snapshot_step{trainer.global_step}.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
            torch.cuda.memory._record_memory_history(enabled=None)
        if not trainer.is_log_step:
            return
        if self._cuda():
            peak = torch.cuda.max_memory_allocated(trainer.world.device) / 2**20
            torch.cuda.reset_peak_memory_stats(trainer.world.device)
        else:  # ru_maxrss: KiB on Linux, bytes on macOS
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)
        self.peaks.append((trainer.global_step, peak))
        trainer.log_scalar("train/memory_peak_mb", peak)


def main(argv: list[str] | None = None) -> tuple[Any, MemoryProfiler]:
    from _demo import run

    profiler = MemoryProfiler()
    trainer = run([profiler], argv)
    print("peak memory (MiB) by log step:", [(s, round(mb)) for s, mb in profiler.peaks])
    return trainer, profiler


if __name__ == "__main__":
    main()

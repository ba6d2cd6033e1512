"""A custom performance reporter: a one-page summary of the run's step times, written at the end.

    python examples/callbacks/performance_reporter.py

Corrected here: the earlier version of this example skipped the first steps by
``global_step``, so after a resume (which starts at the checkpoint's step) the slow first
steps of the new process (compiles, allocator warm-up) were measured. This version skips
the first `skip_first` steps this process runs.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from dream_trainer import BaseTrainer, RankZeroCallback


class PerformanceReporter(RankZeroCallback[BaseTrainer]):
    """Keeps every step's time and data wait from ``trainer.step_stats`` and writes
    ``perf_summary.md`` in the run directory when the run ends, however it ends. (The
    shipped ``PerformanceReportCallback`` does more: shares of the step, throughput, findings.)"""

    critical = False

    def __init__(self, skip_first: int = 2) -> None:
        self.skip_first = skip_first
        self.steps: list[tuple[float, float]] = []
        self.path: Path | None = None
        self._seen = 0  # optimizer steps run by this process (a resume starts again at 0)

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        trainer = self.trainer
        if trainer.is_accumulating_gradients:
            return
        self._seen += 1
        if self._seen > self.skip_first:  # step_time_s leaves validation out
            self.steps.append((trainer.step_stats.step_time_s, trainer.step_stats.data_wait_s))

    def on_teardown(self, status: str) -> None:
        if not self.steps:
            return
        times = [t for t, _ in self.steps]
        data = sum(w for _, w in self.steps) / sum(times)
        self.path = Path(self.trainer.run_dir) / "perf_summary.md"
        self.path.write_text(
            f"# {self.trainer.run_name}: {status}\n\n"
            f"- steps measured: {len(times)}\n"
            f"- median step: {1e3 * statistics.median(times):.1f} ms (max {1e3 * max(times):.1f} ms)\n"
            f"- waiting for data: {100 * data:.1f} % of step time\n"
        )


def main(argv: list[str] | None = None) -> tuple[Any, PerformanceReporter]:
    from _demo import run

    reporter = PerformanceReporter()
    trainer = run([reporter], argv)
    print(reporter.path.read_text() if reporter.path else "no steps measured")
    return trainer, reporter


if __name__ == "__main__":
    main()

"""A custom throughput monitor: tokens/s and samples/s over each logging window.

    python examples/callbacks/throughput_monitor.py
"""

from __future__ import annotations

import time
from typing import Any

from dream_trainer import BaseTrainer, Callback


class ThroughputMonitor(Callback[BaseTrainer]):
    """Logs ``train/tokens_per_sec`` and ``train/samples_per_sec`` (across data-parallel
    ranks) on the trainer's log steps, from ``trainer.step_stats``: no timers of its own in
    the step, no device sync."""

    critical = False  # a monitor must never stop training

    def __init__(self) -> None:
        self.last: tuple[float, int, int] | None = None  # (time, world samples, world tokens)
        self.history: list[dict[str, float]] = []

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        trainer = self.trainer
        if trainer.is_accumulating_gradients or trainer.global_step % trainer.logging_parameters.log_every_n_steps:
            return
        stats, now = trainer.step_stats, time.perf_counter()
        if self.last is not None:  # the world totals are current on the trainer's log steps
            then, samples, tokens = self.last
            elapsed = now - then
            metrics = {"train/samples_per_sec": (stats.world_samples - samples) / elapsed}
            if stats.world_tokens is not None:
                metrics["train/tokens_per_sec"] = (stats.world_tokens - tokens) / elapsed
            self.history.append(metrics)
            trainer.log_dict(metrics)
        self.last = (now, stats.world_samples, stats.world_tokens or 0)


def main(argv: list[str] | None = None) -> tuple[Any, ThroughputMonitor]:
    from _demo import run

    monitor = ThroughputMonitor()
    trainer = run([monitor], argv)
    print("tokens/s by window:", [round(m.get("train/tokens_per_sec", 0)) for m in monitor.history])
    return trainer, monitor


if __name__ == "__main__":
    main()

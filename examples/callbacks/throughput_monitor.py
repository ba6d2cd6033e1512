"""A custom throughput monitor: tokens/s and samples/s over each logging window.

    python examples/callbacks/throughput_monitor.py

What the original got wrong: it computed samples/s from ``config.batch_size``, which does
not exist in dream-trainer's config (and a configured batch size would be wrong anyway for
an epoch's last, short batch or per data-parallel rank). The trainer counts every
micro-batch itself (``trainer.count_batch``) into ``trainer.step_stats`` once a callback
asks (``trainer.request_batch_counts()``); this version asks at setup and reads the world
totals there. It also times the window with the steps' own
times (``step_stats.step_time_s``), so a validation run inside a window does not count as
training time, and it skips steps whose update was skipped.
"""

from __future__ import annotations

from typing import Any

from dream_trainer import BaseTrainer, Callback


class ThroughputMonitor(Callback[BaseTrainer]):
    """Logs ``train/tokens_per_sec`` and ``train/samples_per_sec`` (across data-parallel
    ranks) on the trainer's log steps, from ``trainer.step_stats``: no timers of its own in
    the step, no device sync."""

    critical = False  # a monitor must never stop training

    def __init__(self) -> None:
        self.last: tuple[int, int] | None = None  # world (samples, tokens) at the last log step
        self.elapsed = 0.0  # training time since then: the steps' own times
        self.history: list[dict[str, float]] = []

    def post_setup(self) -> None:
        self.trainer.request_batch_counts()  # the trainer counts batches for those who ask

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        trainer = self.trainer
        if trainer.is_accumulating_gradients:
            return
        stats = trainer.step_stats
        self.elapsed += stats.step_time_s  # validation is left out of step_time_s
        # the world totals are refreshed on the trainer's own log steps only (not after a skipped step)
        if trainer.step_skipped or trainer.global_step % trainer.logging_parameters.log_every_n_steps:
            return
        if self.last is not None and self.elapsed > 0:
            samples, tokens = self.last
            metrics = {"train/samples_per_sec": (stats.world_samples - samples) / self.elapsed}
            if stats.world_tokens is not None:
                metrics["train/tokens_per_sec"] = (stats.world_tokens - tokens) / self.elapsed
            self.history.append(metrics)
            trainer.log_dict(metrics)
        self.last, self.elapsed = (stats.world_samples, stats.world_tokens or 0), 0.0


def main(argv: list[str] | None = None) -> tuple[Any, ThroughputMonitor]:
    from _demo import run

    monitor = ThroughputMonitor()
    trainer = run([monitor], argv)
    print("tokens/s by window:", [round(m.get("train/tokens_per_sec", 0)) for m in monitor.history])
    return trainer, monitor


if __name__ == "__main__":
    main()

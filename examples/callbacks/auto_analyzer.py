"""A custom automatic analyzer: watches the step telemetry and says what slows the run, once.

    python examples/callbacks/auto_analyzer.py

Corrected here: the earlier version of this example logged each finding's warning on every
rank (N copies on N ranks); every rank still records the finding and logs ``perf/<name>``,
but only rank 0 warns.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from typing import Any

from dream_trainer import BaseTrainer, Callback

logger = logging.getLogger(__name__)


class AutoAnalyzer(Callback[BaseTrainer]):
    """Over a sliding window of steps it checks three things and warns the first time each is
    true: the dataloader takes more than `data_share` of the step, the optimizer more than
    `optimizer_share`, or step times are irregular (p90 above `spread` x the median).
    Findings are kept in ``self.findings`` and logged as ``perf/<finding>`` = 1."""

    critical = False

    def __init__(self, window: int = 10, data_share: float = 0.3, optimizer_share: float = 0.4, spread: float = 2.0):
        self.window, self.data_share, self.optimizer_share, self.spread = window, data_share, optimizer_share, spread
        self.recent: deque[tuple[float, float, float]] = deque(maxlen=window)
        self.findings: dict[str, str] = {}

    def pre_fit(self) -> None:
        self.trainer.request_step_times()  # optimizer_s is measured only when asked

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        trainer = self.trainer
        if trainer.is_accumulating_gradients or trainer.step_skipped:
            return
        stats = trainer.step_stats
        self.recent.append((stats.step_time_s, stats.data_wait_s, stats.optimizer_s))
        if len(self.recent) < self.window:
            return
        total = sum(t for t, _, _ in self.recent)
        times = sorted(t for t, _, _ in self.recent)
        p90_over_median = times[int(0.9 * (len(times) - 1))] / statistics.median(times)
        checks = {  # name: (value, threshold, advice)
            "dataloader_bound": (sum(d for _, d, _ in self.recent) / total, self.data_share,
                                 "the dataloader takes {:.0%} of each step: more workers, pinned memory"),
            "optimizer_bound": (sum(o for _, _, o in self.recent) / total, self.optimizer_share,
                                "the optimizer takes {:.0%} of each step: a fused or foreach optimizer"),
            "irregular_steps": (p90_over_median, self.spread,
                                "step times vary (p90 {:.1f}x the median): recompiles, GC, stragglers"),
        }
        for name, (value, threshold, text) in checks.items():
            if value > threshold and name not in self.findings:
                self.findings[name] = text.format(value)
                if trainer.world.is_rank_zero:  # once per run, not once per rank
                    logger.warning("step %d: %s", trainer.global_step, self.findings[name])
                trainer.log_scalar(f"perf/{name}", 1.0)


def main(argv: list[str] | None = None) -> tuple[Any, AutoAnalyzer]:
    from _demo import run

    analyzer = AutoAnalyzer()
    trainer = run([analyzer], argv)
    print("findings:", analyzer.findings or "none")
    return trainer, analyzer


if __name__ == "__main__":
    main()

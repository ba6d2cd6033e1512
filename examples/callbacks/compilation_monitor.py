"""A custom compilation monitor: how much time torch.compile spends, and when.

    python examples/callbacks/compilation_monitor.py --compile
"""

from __future__ import annotations

import logging
import time
from typing import Any

from dream_trainer import Callback, DreamTrainer

logger = logging.getLogger(__name__)


class CompilationMonitor(Callback[DreamTrainer]):
    """Counts dynamo's compile events and their time; logs ``compile/events`` and
    ``compile/seconds`` on log steps and warns when something compiles after `warmup_steps`
    (a recompile in the steady state costs a compile every time it happens). For per-region
    numbers and recompile reasons use the shipped ``CompileMonitor``."""

    critical = False

    def __init__(self, warmup_steps: int = 3) -> None:
        self.warmup_steps = warmup_steps
        self.events: list[tuple[int, float]] = []  # (global step, seconds)
        self.trainer_regions: list[str] = []
        self._started: dict[str, float] = {}

    def pre_fit(self) -> None:
        import torch._dynamo.callback as dynamo

        self.trainer_regions = list(self.trainer.compiled_modules)
        dynamo.callback_handler.register_start_callback(self._start)
        dynamo.callback_handler.register_end_callback(self._end)

    def on_teardown(self, status: str) -> None:
        import torch._dynamo.callback as dynamo

        dynamo.callback_handler.remove_start_callback(self._start)
        dynamo.callback_handler.remove_end_callback(self._end)

    def _start(self, args: Any) -> None:
        self._started[str(args.compile_id)] = time.perf_counter()

    def _end(self, args: Any) -> None:
        started = self._started.pop(str(args.compile_id), None)
        if started is None:
            return
        step = self.trainer.global_step
        self.events.append((step, time.perf_counter() - started))
        if step >= self.warmup_steps:
            logger.warning("torch.compile compiled again at step %d (%s): a recompile", step, args.compile_id)

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        if self.trainer.is_log_step and not self.trainer.is_accumulating_gradients:
            self.trainer.log_dict({"compile/events": len(self.events), "compile/seconds": sum(s for _, s in self.events)})


def main(argv: list[str] | None = None) -> tuple[Any, CompilationMonitor]:
    from _demo import run

    monitor = CompilationMonitor()
    trainer = run([monitor], argv)
    print(f"compiled regions: {monitor.trainer_regions}; {len(monitor.events)} compile event(s), "
          f"{sum(s for _, s in monitor.events):.1f} s")
    return trainer, monitor


if __name__ == "__main__":
    main()

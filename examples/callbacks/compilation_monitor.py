"""A custom compilation monitor: how much time torch.compile spends, and when.

    python examples/callbacks/compilation_monitor.py --compile

What the original got wrong: it patched ``torch.compile`` to time it, after DreamTrainer
had already compiled the model (``apply_compile``, in ``configure``), so its wrapper was
never called and it reported nothing; patching a torch function also changes it for every
other user. And ``torch.compile`` only wraps: the work happens later. Dynamo
compiles lazily, at a region's first call (and again at every recompile), so this version
patches nothing: it registers dynamo's compile start/end callbacks
(``torch._dynamo.callback.callback_handler``) in ``post_configure``, after the regions
were wrapped and before anything calls them, and removes them in ``on_teardown``.
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
    (a recompile in the steady state costs a compile every time it happens). A region's
    first call under validation compiles once more (no-grad is a new guard): in the demo
    that is the sanity validation, at step 0. For per-region numbers and recompile reasons
    use the shipped ``CompileMonitorCallback``."""

    critical = False

    def __init__(self, warmup_steps: int = 3) -> None:
        self.warmup_steps = warmup_steps
        self.events: list[tuple[int, float]] = []  # (global step, seconds)
        self.trainer_regions: list[str] = []
        self._started: dict[str, float] = {}
        self._registered = False

    def post_configure(self) -> None:
        import torch._dynamo.callback as dynamo

        self.trainer_regions = list(self.trainer.compiled_modules)  # wrapped, not compiled yet
        dynamo.callback_handler.register_start_callback(self._start)
        dynamo.callback_handler.register_end_callback(self._end)
        self._registered = True

    def on_teardown(self, status: str) -> None:
        import torch._dynamo.callback as dynamo

        if not self._registered:  # the run ended before post_configure
            return
        self._registered = False
        handler = dynamo.callback_handler  # torch._dynamo.reset() may have cleared it already
        if self._start in handler.start_callbacks:
            handler.remove_start_callback(self._start)
        if self._end in handler.end_callbacks:
            handler.remove_end_callback(self._end)

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

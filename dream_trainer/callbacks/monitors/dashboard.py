"""`TrainingDashboardCallback`: a live terminal panel of what the monitors logged (rich)."""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from typing import IO, Any

from dream_trainer.protocol.base import RankZeroCallback
from dream_trainer.trainer.base import BaseTrainer

ROWS = (
    ("loss", ("train/loss", "train/loss_avg")),
    ("val loss", ("val/loss",)),
    ("lr", ("train/lr",)),
    ("grad norm", ("train/grad_norm", "train/grad_norm_avg")),
    ("clip rate", ("train/clip_rate",)),
    ("memory MB", ("train/memory_current_mb", "train/memory_peak_mb")),
    ("tokens/s", ("train/tokens_per_sec",)),
    ("samples/s", ("train/samples_per_sec",)),
    ("step time s", ("train/step_time",)),
    ("MFU", ("train/mfu",)),
    ("progress %", ("train/progress_pct",)),
    ("ETA s", ("train/eta",)),
    ("skipped steps", ("train/skipped_steps",)),
)


class _Warnings(logging.Handler):
    def __init__(self, keep: deque[str]):
        super().__init__(logging.WARNING)
        self.keep = keep

    def emit(self, record: logging.LogRecord) -> None:
        self.keep.append(f"{time.strftime('%H:%M:%S')} {record.getMessage()[:160]}")


class TrainingDashboardCallback(RankZeroCallback[BaseTrainer]):
    """A ``rich`` live panel on rank zero: step and epoch, loss, lr, gradient norm, memory,
    throughput, ETA (what the trainer and the monitors logged: it reads
    ``trainer.logged_metrics`` and ``trainer.display_fields``, measures nothing itself), and
    the last `warnings` warnings of dream_trainer's loggers.

    It redraws at most `refresh_rate` times per second, on log steps. ``enabled=None`` (the
    default) shows it only when `file` (default: stdout) is a terminal; ``False`` never.
    Needs ``rich`` (``pip install "dream-trainer[rich]"``), imported only when it shows.
    """

    critical = False

    def __init__(self, refresh_rate: float = 2.0, enabled: bool | None = None, warnings: int = 5,
                 file: IO[str] | None = None, console: Any = None):
        if not (isinstance(refresh_rate, (int, float)) and refresh_rate > 0):
            raise ValueError(f"TrainingDashboardCallback(refresh_rate={refresh_rate!r}): expected a number > 0")
        self.refresh_rate, self.enabled, self.file, self.console = refresh_rate, enabled, file, console
        self.warnings: deque[str] = deque(maxlen=warnings)
        self.renders = 0
        self._live: Any = None
        self._handler = _Warnings(self.warnings)
        self._last = 0.0

    @property
    def active(self) -> bool:
        if self.enabled is not None:
            return self.enabled
        stream = self.file or sys.stdout
        return bool(getattr(stream, "isatty", lambda: False)())

    def pre_fit(self) -> None:
        if not self.active:
            return
        from rich.console import Console
        from rich.live import Live

        console = self.console or Console(file=self.file or sys.stdout)
        logging.getLogger("dream_trainer").addHandler(self._handler)
        self._live = Live(self.render(), console=console, refresh_per_second=self.refresh_rate, transient=False)
        self._live.start()

    def on_log(self, metrics: dict[str, float], step: int) -> None:
        now = time.monotonic()
        if self._live is None or now - self._last < 1.0 / self.refresh_rate:
            return
        self._last = now
        self._live.update(self.render())

    def render(self) -> Any:
        """The panel (a rich renderable) for what was logged so far."""
        from rich.panel import Panel
        from rich.table import Table

        trainer, metrics = self.trainer, self.trainer.logged_metrics
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold")
        table.add_column()
        table.add_row("step", f"{trainer.global_step}  (epoch {trainer.current_epoch})")
        for label, keys in ROWS:
            values = [f"{metrics[k]:.4g}" for k in keys if k in metrics]
            if values:
                table.add_row(label, " / ".join(values))
        for name, text in getattr(trainer, "display_fields", {}).items():
            table.add_row(name, text)
        for line in self.warnings:
            table.add_row("[yellow]warning[/]", line)
        self.renders += 1
        return Panel(table, title=f"dream_trainer · {trainer.run_name or ''}", border_style="cyan")

    def on_teardown(self, status: str) -> None:
        logging.getLogger("dream_trainer").removeHandler(self._handler)
        if self._live is not None:
            self._live.update(self.render())
            self._live.stop()
            self._live = None

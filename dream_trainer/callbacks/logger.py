"""`LoggerCallback`: every `on_log` metric to TensorBoard event files and a JSON-lines file."""

from __future__ import annotations

import json
import logging
import math
import numbers
import sys
import time
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

import torch

from dream_trainer.protocol.base import RankZeroCallback
from dream_trainer.protocol.trainers import Counters, Logs, RunDirectory

logger = logging.getLogger(__name__)


@runtime_checkable
class LoggedTrainer(Counters, Logs, RunDirectory, Protocol):
    """What `LoggerCallback` needs of a trainer (any trainer with these pieces)."""


class LoggerCallback(RankZeroCallback[LoggedTrainer]):
    """Write metrics under the run directory (rank zero only).

    - TensorBoard event files in ``<run_dir>/<subdir>/`` (read them with ``tensorboard
      --logdir``);
    - ``<run_dir>/<subdir>/metrics.jsonl``: one JSON object per `on_log` call,
      ``{"step": ..., "time": ..., "<name>": value, ...}`` (non-finite values as strings).

    Files are flushed at the end of every epoch and validation, and closed in `on_teardown`
    (every path: finished, stopped, preempted or failed). Not critical: a failing disk never
    stops training.

    A value that is not a number (only a dispatch that bypasses the trainer's checks can
    bring one) is left out of every sink with a warning, once per name; the other values of
    the call are written.

    A console sink too, by `verbosity`: 0 (default) prints nothing, 1 a summary line per
    epoch (its mean training loss and the latest validation and epoch metrics), 2 also every
    `on_log` call as it comes. It writes to `console` (default: stdout).
    """

    critical = False

    def __init__(self, subdir: str = "logs", tensorboard: bool = True, jsonl: bool = True, verbosity: int = 0,
                 console: IO[str] | None = None):
        if not (tensorboard or jsonl or verbosity):
            raise ValueError("LoggerCallback needs at least one sink: tensorboard=True, jsonl=True or verbosity > 0")
        if verbosity not in (0, 1, 2):
            raise ValueError(f"LoggerCallback(verbosity={verbosity!r}) is invalid: expected 0 (quiet), 1 (epoch "
                             "summaries) or 2 (every log step)")
        self.verbosity, self.console = verbosity, console
        self.subdir = subdir
        self.tensorboard = tensorboard
        self.jsonl = jsonl
        self._writer: Any = None
        self._file: IO[str] | None = None
        self.log_dir: Path | None = None
        self._refused: set[str] = set()  # names of non-number values already warned about

    def _open(self) -> None:
        self.log_dir = Path(self.trainer.run_dir) / self.subdir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.tensorboard and self._writer is None:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: lazily

            # A resumed run drops the events an earlier run logged after its checkpoint.
            purge = self.trainer.global_step + 1 if getattr(self.trainer, "resumed", False) else None
            self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge)
        if self.jsonl and self._file is None:
            self._file = open(self.log_dir / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115

    def pre_fit(self) -> None:
        self._open()

    def on_log(self, metrics: dict[str, float], step: int) -> None:
        if self.log_dir is None:
            self._open()
        metrics = self._numbers(metrics, step)
        if self._writer is not None:
            for name, value in metrics.items():
                self._writer.add_scalar(name, value, global_step=step)
        if self._file is not None:
            record = {"step": step, "time": time.time()}
            record.update({k: v if math.isfinite(v) else str(v) for k, v in metrics.items()})
            self._file.write(json.dumps(record) + "\n")
        if self.verbosity >= 2:
            self._print(f"step {step}: " + "  ".join(f"{k}={_short(v)}" for k, v in metrics.items()))

    def _numbers(self, metrics: dict[str, Any], step: int) -> dict[str, float]:
        return numbers_only(metrics, step, self._refused, type(self).__name__)

    def _print(self, line: str) -> None:
        print(line, file=self.console or sys.stdout, flush=True)

    def _flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()
        if self._file is not None:
            self._file.flush()

    def post_train_epoch(self, result: dict[str, Any]) -> None:
        self._flush()
        if self.verbosity >= 1:
            trainer = self.trainer
            loss = result.get("loss")
            parts = [f"epoch {trainer.current_epoch} done at step {trainer.global_step}"]
            if loss is not None:
                parts.append(f"mean loss {float(loss):.4g}")  # the epoch's end: a deliberate read
            parts += [f"{k}={_short(v)}" for k, v in sorted(trainer.logged_metrics.items()) if not k.startswith("train/")]
            self._print(" | ".join(parts))

    def post_validation_epoch(self, result: dict[str, Any]) -> None:
        self._flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def on_teardown(self, status: str) -> None:
        self.close()


def numbers_only(metrics: dict[str, Any], step: int, refused: set[str], owner: str) -> dict[str, float]:
    """The values of `metrics` as floats. A value that is not a number would break a sink
    (and with it the whole call): it is left out, with a warning once per name (`refused`
    holds the names already warned about)."""
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_complex:
            out[name] = float(value)  # on_log runs on log steps: a read is expected there
        elif isinstance(value, numbers.Real):
            out[name] = float(value)
        elif name not in refused:
            refused.add(name)
            logger.warning("%s: metric %r=%r (%s) at step %d is not a number: it is not written (warned once per "
                           "name)", owner, name, value, type(value).__name__, step)
    return out


def _short(value: float) -> str:
    return f"{value:.4g}"

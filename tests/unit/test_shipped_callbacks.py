"""ProgressBar and LoggerCallback on real runs; SIGTERM goes through on_interrupt."""

import io
import json
import os
import signal

import pytest
import torch.distributed as dist

from dream_trainer import Callback, LoggerCallback, ProgressBar, TrainingInterrupted
from tests.unit.test_trainer_loop import make


def test_progress_bar_shows_step_loss_lr_and_estimates_iterable_epochs():
    out = io.StringIO()
    trainer = make([ProgressBar(enabled=True, file=out)], trainer_kwargs=dict(iterable=True, n_samples=64, batch_size=8),
                   n_epochs=2, log_every_n_steps=2)
    trainer.fit()
    text = out.getvalue()
    assert "epoch 0" in text and "epoch 1 (~total)" in text  # the 2nd epoch's total is estimated
    assert "6/6" in text  # ... from the 6 batches of the first one
    assert "step=" in text and "loss=" in text and "lr=" in text and "batch/s" in text


def test_progress_bar_is_quiet_when_not_a_tty():
    out = io.StringIO()  # not a terminal
    make([ProgressBar(file=out)]).fit()
    assert out.getvalue() == ""


def test_logger_writes_jsonl_and_event_files():
    trainer = make([LoggerCallback()], n_epochs=2, log_every_n_steps=3)
    trainer.fit()
    log_dir = trainer.run_dir / "logs"
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/loss" in r] == [3, 6, 9, 12, 15, 18, 21, 24]
    assert [r["step"] for r in records if "val/loss" in r] == [12, 24]
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(log_dir))


def test_logger_needs_a_sink():
    with pytest.raises(ValueError, match="at least one sink"):
        LoggerCallback(tensorboard=False, jsonl=False)


def test_sigterm_runs_on_interrupt_and_tears_down():
    seen = []

    class Terminate(Callback):
        def post_train_step(self, result, batch_idx):
            if self.trainer.global_step == 2:
                os.kill(os.getpid(), signal.SIGTERM)

        def on_interrupt(self):
            seen.append(self.trainer.global_step)

    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(TrainingInterrupted):
        make([Terminate()]).fit()
    assert seen == [2]
    assert not dist.is_initialized()
    assert signal.getsignal(signal.SIGTERM) is previous  # the handler is restored

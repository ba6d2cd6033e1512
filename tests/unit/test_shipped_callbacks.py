"""ProgressBarCallback and LoggerCallback on real runs; SIGTERM goes through on_interrupt."""

import io
import json
import os
import time
import signal

import pytest
import torch.distributed as dist

from dream_trainer import EXIT_PREEMPTED, Callback, LoggerCallback, ProgressBarCallback, TrainingInterrupted
from tests.unit.test_trainer_loop import make


def test_progress_bar_shows_step_loss_lr_and_estimates_iterable_epochs():
    out = io.StringIO()
    trainer = make([ProgressBarCallback(enabled=True, file=out)], trainer_kwargs=dict(iterable=True, n_samples=64, batch_size=8),
                   n_epochs=2, log_every_n_steps=2)
    trainer.fit()
    text = out.getvalue()
    assert "epoch 0" in text and "epoch 1 (~total)" in text  # the 2nd epoch's total is estimated
    assert "6/6" in text  # ... from the 6 batches of the first one
    assert "step=" in text and "loss=" in text and "lr=" in text and "batch/s" in text


def test_progress_bar_estimates_the_first_epoch_of_a_loader_without_length_from_the_hint():
    out = io.StringIO()
    trainer = make([ProgressBarCallback(enabled=True, file=out)], trainer_kwargs=dict(iterable=True, n_samples=64, batch_size=8),
                   n_epochs=1, train_steps_per_epoch_hint=10)
    assert not hasattr(trainer.train_dataloader, "__len__")  # no length: only the hint tells
    trainer.fit()
    text = out.getvalue()
    assert trainer.train_steps_per_epoch is None and trainer.total_steps == 10
    assert "epoch 0 (~total)" in text
    assert "0/10" in text and "6/10" in text  # the hint is the total; the epoch had 6 batches


def test_progress_bar_is_quiet_when_not_a_tty():
    out = io.StringIO()  # not a terminal
    make([ProgressBarCallback(file=out)]).fit()
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


def test_sigterm_stops_at_the_step_boundary_and_a_second_signal_aborts():
    from dream_trainer.trainer.control import SIGNAL_REPEAT_WINDOW_S

    seen = []

    class Terminate(Callback):
        def __init__(self, times, gap=0.0):
            self.times, self.gap = times, gap

        def pre_train_step(self, batch, batch_idx):
            if self.trainer.global_step == 2:
                for i in range(self.times):
                    if i:
                        time.sleep(self.gap)
                    os.kill(os.getpid(), signal.SIGTERM)

        def on_interrupt(self, error):
            seen.append((self.trainer.global_step, self.trainer.status))

    previous = signal.getsignal(signal.SIGTERM)
    trainer = make([Terminate(times=1)])
    trainer.fit()  # returns: the run is preempted, not crashed
    assert seen == [(3, "preempted")]  # the step under way when the signal came was finished
    assert trainer.exit_code == EXIT_PREEMPTED == 75 and "SIGTERM" in trainer.stop_reason
    assert not dist.is_initialized()
    assert signal.getsignal(signal.SIGTERM) is previous  # the handler is restored

    seen.clear()  # one signal delivered twice at once (launcher + scheduler): still one preemption
    make([Terminate(times=2)]).fit()
    assert seen == [(3, "preempted")]

    seen.clear()  # a second signal, later, before the boundary: abort at once
    with pytest.raises(TrainingInterrupted, match="again"):
        make([Terminate(times=2, gap=SIGNAL_REPEAT_WINDOW_S + 0.1)]).fit()
    assert seen == [(2, "failed")] and not dist.is_initialized()


def test_shipped_callbacks_follow_one_naming_rule_and_keep_dream_trainers_names():
    """Every shipped callback's class is named ``<what it does>Callback``; the other names
    exported are dream-trainer's for the same classes (this project's former names and
    `ProgressBar` are gone)."""
    import dream_trainer
    import dream_trainer.callbacks as shipped
    from dream_trainer.protocol import Callback, RankZeroCallback

    exported = {name: getattr(shipped, name) for name in shipped.__all__}
    classes = {name: obj for name, obj in exported.items()
               if isinstance(obj, type) and issubclass(obj, Callback) and obj not in (Callback, RankZeroCallback)}
    assert len({id(c) for c in classes.values()}) >= 16  # not vacuous: every shipped callback is exported
    assert sorted(c.__name__ for c in classes.values() if not c.__name__.endswith("Callback")) == []
    aliases = {name: c.__name__ for name, c in classes.items() if name != c.__name__}
    assert aliases == {"Fp8Quantization": "Fp8QuantizationCallback", "OptimizeFSDP": "OptimizeFSDPCallback"}
    for name in ("CompileMonitor", "PerformanceReport", "ProgressBar"):  # former names: gone everywhere
        assert not hasattr(shipped, name) and not hasattr(dream_trainer, name)
        assert name not in dream_trainer.__all__
    for name in ("OptimizeFSDP", "FindGraphBreaksCallback", "Fp8Quantization", "ProfileCallback",
                 "LoggerCallback", "CheckpointCallback", "FaultToleranceCallback"):  # dream-trainer's names
        assert name in exported

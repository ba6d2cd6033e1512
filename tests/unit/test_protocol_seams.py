"""The protocol's seams in one process: the lr a step used, optimizer-step begin/end hooks,
on_callback_error, a batch transform, a plateau scheduler with a warm-up, and a failed
training step recovered by a callback (its 2-rank agreement: tests/distributed)."""

import logging

import pytest
import torch

from dream_trainer import Callback, DeviceParameters, LoggingParameters, TrainerConfig, TrainingParameters
from dream_trainer.testing import ToyTrainer


def make(callbacks=(), cls=ToyTrainer, trainer_kwargs=None, log_every=1000, **training):
    params = dict(n_epochs=1, num_sanity_val_steps=0)
    params.update(training)
    config = TrainerConfig(root_dir="runs", run_name="r", device_parameters=DeviceParameters.SINGLE_DEVICE(),
                           training_parameters=TrainingParameters(**params),
                           logging_parameters=LoggingParameters(log_every_n_steps=log_every),
                           callbacks=list(callbacks))
    return cls(config, **(trainer_kwargs or {}))


class Logs(Callback):
    def __init__(self):
        self.logs = []

    def on_log(self, metrics, step):
        self.logs.append((step, dict(metrics)))


# ------------------------------------------------------------------ the lr a step used
class WarmUp(Callback):
    """Sets the lr in pre_optimizer_step (a warm-up written against that hook) and records
    what optimizer.step() then sees."""

    def __init__(self):
        self.used = {}

    def pre_optimizer_step(self, model, optimizer):
        step = self.trainer.global_step + 1
        for group in optimizer.param_groups:
            group["lr"] = 0.01 * step
        self.used[step] = optimizer.param_groups[0]["lr"]


def test_train_lr_is_the_lr_the_step_used():
    warm, logs = WarmUp(), Logs()
    make([warm, logs], log_every=1).fit()
    logged = {step: m["train/lr"] for step, m in logs.logs if "train/lr" in m}
    assert len(logged) == 12
    assert logged == pytest.approx(warm.used)  # before the fix: the previous step's value


# ------------------------------------------------------------------ step begin/end
class StepHooks(Callback):
    vetoes_steps = True

    def __init__(self):
        self.events = []

    def on_step_begin(self, step):
        self.events.append(("begin", step, self.trainer.global_step, self.trainer.local_batches))

    def pre_optimizer_step(self, model, optimizer):
        return self.trainer.global_step + 1 != 3 or self.events[-1][0] != "begin" or len(self.events) > 6

    def on_step_end(self, step):
        self.events.append(("end", step, self.trainer.global_step, self.trainer.step_skipped))


def test_step_begin_and_end_once_per_optimizer_step_with_accumulation():
    hooks = StepHooks()
    trainer = make([hooks], trainer_kwargs=dict(n_samples=64, batch_size=6), gradient_accumulation_steps=2)
    trainer.fit()  # 48 training samples: 8 micro-batches = 4 optimizer steps; step 3 vetoed once
    begins = [e for e in hooks.events if e[0] == "begin"]
    ends = [e for e in hooks.events if e[0] == "end"]
    assert [e[0] for e in hooks.events] == ["begin", "end"] * 4
    assert [b[1] for b in begins] == [1, 2, 3, 3]  # the vetoed step 3 runs again
    assert [b[3] for b in begins] == [1, 3, 5, 7]  # at the first micro-batch of each step
    assert [(e[1], e[2], e[3]) for e in ends] == [(1, 1, False), (2, 2, False), (3, 2, True), (3, 3, False)]
    assert trainer.global_step == 3


# ------------------------------------------------------------------ on_callback_error
class Flaky(Callback):
    critical = False
    max_consecutive_failures = 100

    def __init__(self):
        self.told = []

    def post_train_step(self, result, batch_idx):
        if batch_idx in (2, 5):
            raise ValueError(f"flaky at {batch_idx}")

    def on_callback_error(self, callback, hook, error):
        self.told.append(callback)  # never about itself


class Watcher(Callback):
    def __init__(self, fail=False):
        self.seen, self.fail = [], fail

    def on_callback_error(self, callback, hook, error):
        self.seen.append((callback, hook, str(error), self.trainer.global_step))
        if self.fail:
            raise RuntimeError("the watcher fails too")


def test_on_callback_error_is_told_each_failure_of_a_non_critical_callback(caplog):
    flaky, watcher, failing = Flaky(), Watcher(), Watcher(fail=True)
    with caplog.at_level(logging.ERROR):
        trainer = make([flaky, watcher, failing])
        trainer.fit()
    assert watcher.seen == [("Flaky", "post_train_step", "flaky at 2", 3), ("Flaky", "post_train_step", "flaky at 5", 6)]
    assert len(failing.seen) == 2 and flaky.told == []
    assert "on_callback_error of 'Watcher' failed" in caplog.text  # logged, not dispatched again
    assert trainer.global_step == 12 and "Flaky" in trainer.callbacks


# ------------------------------------------------------------------ batch transform
class Scale(Callback):
    def __init__(self, factor):
        self.factor = factor

    def pre_train_step(self, batch, batch_idx):
        x, y = batch
        return x * self.factor, y


class Seen(ToyTrainer):
    def training_step(self, batch, batch_idx):
        self.seen = getattr(self, "seen", [])
        self.seen.append(batch[0].clone())
        return super().training_step(batch, batch_idx)


class Keep(Callback):
    def pre_train_step(self, batch, batch_idx):
        self.given = batch  # returns None: keeps it


def test_pre_train_step_may_replace_the_batch_and_replacements_compose():
    keep = Keep()
    plain = make(cls=Seen, max_steps=2)
    plain.fit()
    scaled = make([Scale(2.0), keep, Scale(-1.0)], cls=Seen, max_steps=2)
    scaled.fit()
    for a, b in zip(plain.seen, scaled.seen):
        assert torch.equal(b, -2.0 * a)
    assert torch.equal(keep.given[0], 2.0 * plain.seen[-1])  # a later callback sees the replacement


# ------------------------------------------------------------------ plateau + warm-up
class Scheduled(ToyTrainer):
    """A warm-up (LambdaLR, per step) and a plateau scheduler on a metric that never improves."""

    def configure_optimizers(self):
        super().configure_optimizers()
        self.warmup = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: min(1.0, (step + 1) / 4))
        self.plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(self.optimizer, factor=0.5, patience=0)

    def validation_step(self, batch, batch_idx):
        return {"flat": torch.tensor(1.0)}


def test_a_plateau_reduction_survives_the_step_schedulers_next_step():
    logs = Logs()
    trainer = make([logs], cls=Scheduled, trainer_kwargs=dict(lr=0.8), log_every=1, n_epochs=3,
                   scheduler_monitor="val/flat")
    trainer.fit()  # 12 steps per epoch; a validation (no improvement after the first) at each epoch end
    lrs = {step: m["train/lr"] for step, m in logs.logs if "train/lr" in m}
    assert lrs[1] == pytest.approx(0.2) and lrs[12] == pytest.approx(0.8)  # the warm-up, then flat
    assert lrs[13] == pytest.approx(0.8) and lrs[24] == pytest.approx(0.8)  # the first value is the best
    assert lrs[25] == pytest.approx(0.4) and lrs[36] == pytest.approx(0.4)  # halved, and it stays halved
    assert trainer.warmup.base_lrs == pytest.approx([0.2])  # halved after epochs 2 and 3


# ------------------------------------------------------------------ a failed step, recovered
class FailsOnce(ToyTrainer):
    """training_step raises (as a CUDA OOM would) on the given batches, once each."""

    def __init__(self, config, fail_at=(), **kwargs):
        super().__init__(config, **kwargs)
        self.fail_at, self.failed = set(fail_at), []

    def training_step(self, batch, batch_idx):
        if batch_idx in self.fail_at:
            self.fail_at.discard(batch_idx)
            self.failed.append(batch_idx)
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return super().training_step(batch, batch_idx)


class Retry(Callback):
    recovers_errors = True

    def __init__(self, answer=True):
        self.answer, self.errors = answer, []

    def on_train_step_error(self, error, batch, batch_idx):
        self.errors.append((type(error).__name__ if error is not None else None, batch_idx))
        return self.answer


def test_a_failed_step_retried_by_a_callback_ends_as_if_it_never_failed():
    clean = make(cls=FailsOnce, trainer_kwargs=dict(dropout=0.2), gradient_accumulation_steps=2)
    clean.fit()
    retry = Retry()
    failed = make([retry], cls=FailsOnce, trainer_kwargs=dict(dropout=0.2, fail_at=(3, 6)), gradient_accumulation_steps=2)
    failed.fit()
    assert failed.failed == [3, 6] and retry.errors == [("OutOfMemoryError", 3), ("OutOfMemoryError", 6)]
    assert failed.global_step == clean.global_step == 6
    for a, b in zip(clean.model.parameters(), failed.model.parameters()):
        assert torch.equal(a, b)


def test_an_unrecovered_failure_ends_the_run_and_retries_are_bounded():
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        make([Retry(answer=None)], cls=FailsOnce, trainer_kwargs=dict(fail_at=(2,))).fit()

    class AlwaysFails(ToyTrainer):
        def training_step(self, batch, batch_idx):
            raise torch.OutOfMemoryError("CUDA out of memory (always)")

    forever = Retry()
    with pytest.raises(torch.OutOfMemoryError, match="always"):
        make([forever], cls=AlwaysFails).fit()
    assert len(forever.errors) == 5  # the first attempt and 4 retries

"""The training-health suite in one process: spikes and explosions found (and not on a
normal run), NaN policies, a failing monitor disabled, no host reads on non-log steps, the
dashboard, health_callbacks and the console sink."""

import io
import logging

import pytest
import torch
from torch.overrides import TorchFunctionMode

from dream_trainer import Callback, DeviceParameters, LoggerCallback, LoggingParameters, TrainerConfig, TrainingParameters
from dream_trainer.callbacks import (
    AnomalyDetectorCallback,
    GradientMonitorCallback,
    LossMonitorCallback,
    MemoryMonitorCallback,
    ThroughputMonitorCallback,
    TrainingDashboardCallback,
    health_callbacks,
)
from dream_trainer.callbacks.monitors import AnomalyError
from dream_trainer.testing import ToyTrainer


def config(callbacks=(), log_every=1000, **training):
    params = dict(n_epochs=2, num_sanity_val_steps=0)
    params.update(training)
    return TrainerConfig(run_name="r", device_parameters=DeviceParameters.SINGLE_DEVICE(),
                         training_parameters=TrainingParameters(**params),
                         logging_parameters=LoggingParameters(log_every_n_steps=log_every), callbacks=list(callbacks))


class Inject(ToyTrainer):
    """Scales (or poisons) the loss of one batch: batch `at` of epoch 0 (global step `at` + 1)."""

    def __init__(self, cfg, at=None, factor=1.0, rank=None, **kwargs):
        super().__init__(cfg, **kwargs)
        self.at, self.factor, self.rank = at, factor, rank

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.current_epoch == 0 and batch_idx == self.at and (self.rank is None or self.world.rank == self.rank):
            hit = self.model(x)
            loss = torch.nn.functional.mse_loss(hit, y) * self.factor
            self.backward(loss)
            self.step(self.optimizer)
            self.step_losses.append(loss.detach())
            return {"loss": loss}
        return super().training_step(batch, batch_idx)


# -------------------------------------------------------------------- detection
@pytest.mark.parametrize("spike", [True, False])
def test_explosion_and_spike_detection(caplog, spike):
    gradient = GradientMonitorCallback(log_interval=5, history_size=50, min_history=10)
    loss = LossMonitorCallback(log_interval=5, history_size=50, min_history=10)
    trainer = Inject(config([gradient, loss]), at=10 if spike else None, factor=1000.0)
    with caplog.at_level(logging.WARNING):
        trainer.fit()
    if spike:
        # the spike itself; the big update it made may make the next step an outlier too
        assert gradient.explosions[0][0] == 11 and loss.spikes[0][0] == 11
        assert "gradient explosion at step 11" in caplog.text and "loss spike at step 11" in caplog.text
    else:
        assert not gradient.explosions and not loss.spikes and "explosion" not in caplog.text
    assert trainer.logged_metrics["train/grad_norm_avg"] > 0 and trainer.logged_metrics["train/loss_avg"] > 0


def test_loss_spike_skip_and_stop_policies():
    skip = LossMonitorCallback(log_interval=5, min_history=10, on_spike="skip")
    trainer = Inject(config([skip]), at=10, factor=1000.0)
    trainer.fit()
    assert skip.skipped == 1 and trainer.skipped_steps == 1 and trainer.global_step == 23
    stop = LossMonitorCallback(log_interval=5, min_history=10, on_spike="stop")
    trainer = Inject(config([stop]), at=10, factor=1000.0)
    trainer.fit()  # found at the next log step (15), then every rank stops there
    assert trainer.status == "stopped" and trainer.global_step == 15 and trainer.stop_reason == "loss spike at step 11"


# -------------------------------------------------------------------- NaN policies
class Snapshot(Callback):
    """Parameters before and after the step at `at` + 1."""

    def __init__(self, at):
        self.at, self.before, self.after = at, None, None

    def pre_train_step(self, batch, batch_idx):
        if self.trainer.global_step == self.at:
            self.before = [p.detach().clone() for p in self.trainer.model.parameters()]

    def post_train_step(self, result, batch_idx):
        if self.after is None and self.before is not None:
            self.after = [p.detach().clone() for p in self.trainer.model.parameters()]


def test_nan_is_skipped_on_the_step_it_happens():
    detector, snap = AnomalyDetectorCallback("skip"), Snapshot(5)
    trainer = Inject(config([detector, snap]), at=5, factor=float("nan"))
    trainer.fit()
    assert all(torch.equal(a, b) for a, b in zip(snap.before, snap.after))  # step 6 was not applied
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert detector.skipped_steps == 1 and detector.events == [(6, 5)] and trainer.global_step == 23  # 24 batches
    assert trainer.logged_metrics["train/skipped_steps"] == 1.0
    assert detector.state_dict()["skipped_steps"] == 1


def test_nan_halt_names_the_parameters_and_too_many_skips_halt():
    with pytest.raises(AnomalyError, match=r"step 6 \(policy 'halt'\): loss nan; gradients of 4 parameter\(s\): model\.0\.weight|0\.weight, 0\.bias, 2\.weight, 2\.bias.*Try:"):
        Inject(config([AnomalyDetectorCallback("halt")]), at=5, factor=float("nan")).fit()

    class AlwaysNaN(ToyTrainer):
        def training_step(self, batch, batch_idx):
            x, y = batch
            return super().training_step((x * float("nan") if self.global_step >= 2 else x, y), batch_idx)

    trainer = AlwaysNaN(config([AnomalyDetectorCallback("skip", max_consecutive=3)]))
    with pytest.raises(AnomalyError, match="3 optimizer steps in a row"):
        trainer.fit()
    assert trainer.status == "failed" and trainer.global_step == 2


def test_warn_policy_counts_on_log_steps_only(caplog):
    detector = AnomalyDetectorCallback("warn", log_interval=4)
    trainer = Inject(config([detector]), at=5, factor=float("nan"))
    with caplog.at_level(logging.WARNING):
        trainer.fit()
    assert trainer.logged_metrics["train/nonfinite_steps"] >= 1 and "non-finite loss or gradients so far" in caplog.text
    assert not detector.critical and trainer.skipped_steps == 0


# -------------------------------------------------------------------- robustness
class BrokenMemory(MemoryMonitorCallback):
    def current_mb(self):
        raise OSError("no /proc here")


def test_a_failing_monitor_is_disabled_and_training_goes_on(caplog):
    with caplog.at_level(logging.WARNING):
        trainer = ToyTrainer(config([BrokenMemory(log_interval=1, sample_every=1)]))
        trainer.fit()
    assert trainer.status == "completed" and trainer.global_step == 24
    assert "BrokenMemory" not in trainer.callbacks and "disabling callback 'BrokenMemory'" in caplog.text


class CountReads(TorchFunctionMode):
    """Counts host reads of tensors: .item(), .tolist(), .cpu(), bool(), float(), int()."""

    NAMES = {"item", "tolist", "cpu", "__bool__", "__float__", "__int__", "numpy"}

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.NAMES:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


class Watch(Callback):
    """Enters the counting mode at the start of every step that is not a log step (first of
    all callbacks) and leaves it at its end (last of all)."""

    order = -10**9

    def __init__(self):
        self.mode, self.reads = None, {}

    def pre_train_step(self, batch, batch_idx):
        if (self.trainer.global_step + 1) % 10:  # not a log step of any monitor below (intervals of 10)
            self.mode = CountReads()
            self.mode.__enter__()


class Unwatch(Callback):
    order = 10**9

    def __init__(self, watch):
        self.watch = watch

    def post_train_step(self, result, batch_idx):
        if self.watch.mode is not None:
            self.watch.mode.__exit__(None, None, None)
            self.watch.reads[self.trainer.global_step] = list(self.watch.mode.calls)
            self.watch.mode = None


def _reads(callbacks):
    watch = Watch()
    trainer = ToyTrainer(config([watch, *callbacks, Unwatch(watch)], log_every=10, gradient_clip_val=1.0))
    trainer.fit()
    return watch.reads


def test_no_host_reads_on_non_log_steps():
    baseline = _reads([])
    monitors = health_callbacks(
        gradient={"log_interval": 10}, memory={"log_interval": 10, "sample_every": 1}, throughput={"log_interval": 10},
        loss={"log_interval": 10}, anomaly={"policy": "warn", "log_interval": 10}, dashboard={"enabled": True, "console": _console()})
    with_monitors = _reads(monitors)
    assert len(baseline) == 22 and baseline == with_monitors and not any(baseline.values())
    # A per-step decision costs exactly its one read per step (the trainer's agreement on it).
    skip = _reads([AnomalyDetectorCallback("skip", log_interval=10)])
    assert all(calls == ["__bool__"] for calls in skip.values())


# -------------------------------------------------------------------- dashboard, composition, console
def _console():
    from rich.console import Console

    return Console(file=io.StringIO(), force_terminal=True, width=100)


def test_dashboard_renders_and_is_off_without_a_tty(tmp_path):
    console = _console()
    dashboard = TrainingDashboardCallback(refresh_rate=1000, enabled=True, console=console)
    monitors = [GradientMonitorCallback(log_interval=4), MemoryMonitorCallback(log_interval=4), dashboard]
    ToyTrainer(config(monitors, log_every=4)).fit()
    text = console.file.getvalue()
    assert dashboard.renders > 3 and "grad norm" in text and "memory MB" in text and "rss:" in text
    quiet = TrainingDashboardCallback(file=io.StringIO())  # enabled=None and not a terminal
    ToyTrainer(config([quiet])).fit()
    assert not quiet.active and quiet.renders == 0


def test_health_callbacks_and_its_overrides():
    full = health_callbacks()
    assert [type(c).__name__ for c in full] == ["GradientMonitorCallback", "MemoryMonitorCallback", "ThroughputMonitorCallback",
                                                "LossMonitorCallback", "AnomalyDetectorCallback", "TrainingDashboardCallback"]
    minimal = health_callbacks(memory=False, throughput=False, dashboard=False, gradient={"log_interval": 7})
    assert [type(c).__name__ for c in minimal] == ["GradientMonitorCallback", "LossMonitorCallback", "AnomalyDetectorCallback"]
    assert minimal[0].log_interval == 7
    with pytest.raises(TypeError, match=r"unknown \['gpu'\]"):
        health_callbacks(gpu=False)
    with pytest.raises(ValueError, match=r"LossMonitorCallback\(on_spike='ignore'\) is invalid"):
        LossMonitorCallback(on_spike="ignore")
    with pytest.raises(ValueError, match=r"AnomalyDetectorCallback\(policy='retry'\)"):
        AnomalyDetectorCallback("retry")


@pytest.mark.parametrize("verbosity, lines", [(0, 0), (1, 2), (2, None)])
def test_console_verbosity(verbosity, lines):
    out = io.StringIO()
    ToyTrainer(config([LoggerCallback(verbosity=verbosity, console=out)], log_every=4)).fit()
    text = out.getvalue().splitlines()
    summaries = [line for line in text if line.startswith("epoch ")]
    steps = [line for line in text if line.startswith("step ")]
    if verbosity == 0:
        assert not text
    elif verbosity == 1:
        assert len(summaries) == 2 and not steps and "mean loss" in summaries[0] and "val/loss=" in summaries[1]
    else:
        assert len(summaries) == 2 and len(steps) == 8 and "train/loss=" in steps[0]  # 6 train + 2 val logs


class GradNorms(Callback):
    """The per-parameter gradient norms of every 4th step by hand, and what was logged."""

    def __init__(self):
        self.norms, self.logged = {}, {}

    def pre_optimizer_step(self, model, optimizer):
        if (self.trainer.global_step + 1) % 4 == 0:
            self.norms[self.trainer.global_step + 1] = {n: p.grad.norm().item() for n, p in model.named_parameters()}

    def on_log(self, metrics, step):
        self.logged.setdefault(step, {}).update(metrics)


def test_top_k_layer_norms():
    hand = GradNorms()
    trainer = ToyTrainer(config([GradientMonitorCallback(log_interval=4, top_k_layers=2), hand], log_every=4))
    trainer.fit()
    assert sorted(hand.norms) == [4, 8, 12, 16, 20, 24]
    for step, norms in hand.norms.items():
        logged = {k[len("train/grad_norm/"):]: v for k, v in hand.logged[step].items() if k.startswith("train/grad_norm/")}
        top = sorted(norms, key=norms.get, reverse=True)[:2]
        assert sorted(logged) == sorted(top) and all(logged[n] == pytest.approx(norms[n], rel=1e-5) for n in top)
        assert hand.logged[step]["train/grad_norm"] >= max(logged.values())

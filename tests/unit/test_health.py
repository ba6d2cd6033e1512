"""The training-health suite in one process: spikes and explosions found (and not on a
normal run), NaN policies, a failing monitor disabled, no host reads on non-log steps, the
dashboard, health_callbacks and the console sink."""

import io
import logging
from collections import Counter

import numpy as np
import pytest
import torch

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
from dream_trainer.testing import HostReadCounter, StepReads, ToyTrainer


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


@pytest.fixture(params=["cpu values", "device flag"])
def anomaly_path(request):
    """Both ways the anomaly detector decides: on the CPU it reads the loss and the norm
    directly; on an accelerator (here: the same code on CPU tensors) it makes a device flag
    that the trainer's agreement reads."""
    original = AnomalyDetectorCallback.reads_cpu_values
    AnomalyDetectorCallback.reads_cpu_values = request.param == "cpu values"
    yield request.param
    AnomalyDetectorCallback.reads_cpu_values = original


@pytest.fixture
def device_flag():
    """The accelerator's path (a device flag read once, at the agreement): what the read
    budgets below describe."""
    original = AnomalyDetectorCallback.reads_cpu_values
    AnomalyDetectorCallback.reads_cpu_values = False
    yield
    AnomalyDetectorCallback.reads_cpu_values = original


def test_nan_is_skipped_on_the_step_it_happens(anomaly_path):
    detector, snap = AnomalyDetectorCallback("skip"), Snapshot(5)
    trainer = Inject(config([detector, snap]), at=5, factor=float("nan"))
    trainer.fit()
    assert all(torch.equal(a, b) for a, b in zip(snap.before, snap.after))  # step 6 was not applied
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert detector.skipped_steps == 1 and detector.events == [(6, 5)] and trainer.global_step == 23  # 24 batches
    assert trainer.logged_metrics["train/skipped_steps"] == 1.0
    assert detector.state_dict()["skipped_steps"] == 1


def test_nan_halt_names_the_parameters_and_too_many_skips_halt(anomaly_path):
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


class NaNGrad(ToyTrainer):
    """A finite loss, and a NaN put into one element of one parameter's gradient (``2.bias``)
    at batch 5 of epoch 0 (global step 6), after backward and before ``self.step``."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.backward(loss)
        if self.current_epoch == 0 and batch_idx == 5:
            self.model[2].bias.grad[0] = float("nan")
        self.step(self.optimizer)
        return {"loss": loss}


def test_halt_with_clipping_names_the_parameter_whose_gradient_was_not_finite(anomaly_path):
    # Clipping multiplies every gradient by max_norm / norm: a NaN norm must not make every
    # gradient NaN, or the report would name all four parameters.
    trainer = NaNGrad(config([AnomalyDetectorCallback("halt")], gradient_clip_val=1.0))
    with pytest.raises(AnomalyError, match=r"step 6 \(policy 'halt'\): loss \d[^;]*; gradients of 1 parameter\(s\): 2\.bias\. Try"):
        trainer.fit()


def test_clipping_a_nan_gradient_leaves_the_other_gradients_finite():
    # Policy "warn" applies the update: only the parameter with the NaN gradient becomes NaN;
    # clipping zeroes the finite gradients (the limit of max_norm / norm), as an Inf norm does.
    snap = Snapshot(5)
    trainer = NaNGrad(config([AnomalyDetectorCallback("warn"), snap], n_epochs=1, gradient_clip_val=1.0))
    trainer.fit()
    after = dict(zip([n for n, _ in trainer.model.named_parameters()], snap.after))
    assert [n for n, p in after.items() if not torch.isfinite(p).all()] == ["2.bias"]
    assert all(torch.equal(a, b) for (n, a), b in zip(after.items(), snap.before) if n != "2.bias")


def test_warn_policy_counts_on_log_steps_only(caplog, anomaly_path):
    detector = AnomalyDetectorCallback("warn", log_interval=4)
    trainer = Inject(config([detector]), at=5, factor=float("nan"))
    with caplog.at_level(logging.WARNING):
        trainer.fit()
    assert trainer.logged_metrics["train/nonfinite_steps"] >= 1 and "non-finite loss or gradients so far" in caplog.text
    assert not detector.critical and trainer.skipped_steps == 0


# -------------------------------------------------------------------- robustness
class BrokenMemory(MemoryMonitorCallback):  # every reading fails: the sample and the log step's status
    def current_mb(self):
        raise OSError("no /proc here")

    def status(self):
        raise OSError("no /proc here")


def test_a_failing_monitor_is_disabled_and_training_goes_on(caplog):
    with caplog.at_level(logging.WARNING):
        trainer = ToyTrainer(config([BrokenMemory(log_interval=1, sample_every=1)]))
        trainer.fit()
    assert trainer.status == "completed" and trainer.global_step == 24
    assert "BrokenMemory" not in trainer.callbacks and "disabling callback 'BrokenMemory'" in caplog.text


# -------------------------------------------------------------------- the sync budget
def _reads(callbacks, n_samples=256, batch_size=16, **training):
    """Host reads per optimizer step of a run, the trainer's own removed: ``{step: Counter of
    (kind, caller)}`` for the steps where the callbacks added reads (none removed any)."""
    runs = []
    for cbs in ([], callbacks):
        counter = HostReadCounter()
        steps = StepReads(counter)
        trainer = ToyTrainer(config([steps, *cbs], n_epochs=1, **training), n_samples=n_samples, batch_size=batch_size,
                             with_validation=False)
        with counter:
            trainer.fit()
        runs.append({step: Counter(steps.kinds(step)) for step in steps.steps})
    base, added = runs
    assert all(not base[s] - added[s] for s in base), "the callbacks removed a read of the trainer's"
    return {s: added[s] - base[s] for s in added if added[s] - base[s]}, trainer.global_step


def test_the_counter_catches_every_kind_of_host_read():
    t, v = torch.tensor(1.5), torch.tensor([1.0, 0.0, 2.0])
    reads = {
        "item": lambda: t.item(), "tolist": lambda: v.tolist(), "cpu": lambda: t.cpu(),
        "to_cpu": lambda: (t.to("cpu"), t.to(torch.device("cpu"), torch.float64), t.to(device="cpu")),
        "bool": lambda: bool(t), "float": lambda: (float(t), "%.3f" % t), "int": lambda: (int(t), [0, 1][torch.tensor(1)]),
        "format": lambda: (f"{t}", f"{t:.2f}", "{}".format(t), "%s" % t, str(t)), "nonzero": lambda: (v.nonzero(), torch.where(v > 0)),
        "mask_index": lambda: v[v > 0], "masked_select": lambda: torch.masked_select(v, v > 0), "equal": lambda: torch.equal(v, v),
        "numpy": lambda: (v.numpy(), np.asarray(v)), "contains": lambda: 1.0 in v, "tensor": lambda: torch.tensor([t, t]),
    }
    for kind, read in reads.items():
        with HostReadCounter() as counter:
            out = read()
        n = len(out) if isinstance(out, tuple) else 1  # a tuple: that many reads
        assert counter.counts() == {kind: n}, (kind, str(counter))
        assert all(r.caller == "<lambda>" and __file__ in r.where for r in counter.reads)
    with HostReadCounter() as counter:  # device work only: no read
        (t + 1, t.to(torch.float64), v[0], v[torch.tensor([0, 2])], torch.where(v > 0, v, 0.0), v.sum(), torch.zeros(3).copy_(v))
    assert not counter.reads, str(counter)
    with HostReadCounter(device="cuda") as counter:  # a CUDA run counts reads of CUDA tensors only
        t.item()
    assert not counter.reads


def test_default_health_callbacks_read_what_the_docs_say(device_flag):
    # The defaults (log_interval 100, anomaly "skip"), clipping on, the dashboard drawing:
    # every optimizer step reads one value (the trainer's agreement on the skip flag); step
    # 100, the monitors' log step, also reads each window once (gradient: norms and clip
    # count together; loss). Memory, throughput and the dashboard read no tensor.
    added, steps = _reads(health_callbacks(dashboard={"enabled": True, "console": _console()}),
                          n_samples=288, batch_size=2, gradient_clip_val=1.0)
    assert steps == 108
    skip_read = Counter({("bool", "take_veto"): 1})
    assert all(added[step] == skip_read for step in range(1, steps + 1) if step != 100), added
    assert added[100] == skip_read + Counter({("tolist", "read"): 2}), added[100]


@pytest.mark.parametrize("policy, per_step, on_log_step", [
    ("warn", {}, {("float", "post_train_step"): 1}),
    ("halt", {("bool", "pre_optimizer_step"): 1}, {}),
    ("skip", {("bool", "take_veto"): 1}, {}),
])
def test_sync_budget_per_policy(policy, per_step, on_log_step, device_flag):
    monitors = [AnomalyDetectorCallback(policy, log_interval=4)]
    if policy == "skip":  # a second decision on the same step shares the one read
        monitors.append(LossMonitorCallback(log_interval=4, min_history=2, on_spike="skip"))
    added, steps = _reads(monitors, gradient_clip_val=1.0)
    for step in range(1, steps + 1):
        expected = Counter(per_step) + (Counter(on_log_step) if step % 4 == 0 else Counter())
        if policy == "skip" and step % 4 == 0:
            expected[("tolist", "read")] += 1  # the loss window, on the loss monitor's log steps
        assert added.get(step, Counter()) == expected, (step, added.get(step))


def test_on_the_cpu_the_detector_reads_the_two_values_and_sends_no_flag_to_the_agreement():
    # CPU tensors: the loss and the norm are read directly (two CPU reads, cheaper than the
    # flag's device op) and the agreement reads nothing; a NaN still skips (tested above).
    assert AnomalyDetectorCallback.reads_cpu_values
    added, steps = _reads([AnomalyDetectorCallback("skip", log_interval=1000)], gradient_clip_val=1.0)
    assert steps == 12 and all(added[s] == Counter({("item", "pre_optimizer_step"): 2}) for s in range(1, 13)), added


def test_no_reads_on_other_steps_and_one_per_log_step(device_flag):
    # Every monitor on, short intervals, memory sampled every step, top-k layer norms: no read
    # on a step that is not a log step; on one, one read per monitor that reads the device.
    monitors = health_callbacks(
        gradient={"log_interval": 5, "top_k_layers": 2}, memory={"log_interval": 5, "sample_every": 1},
        throughput={"log_interval": 5}, loss={"log_interval": 5}, anomaly={"policy": "warn", "log_interval": 5},
        dashboard={"enabled": True, "console": _console()})
    added, steps = _reads(monitors, gradient_clip_val=1.0)
    assert steps == 12 and sorted(added) == [5, 10]
    assert all(added[s] == Counter({("tolist", "read"): 2, ("float", "post_train_step"): 1}) for s in (5, 10)), added


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

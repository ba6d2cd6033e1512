"""BaseTrainer/DreamTrainer lifecycle in one process: hook order, accumulation, errors,
StopTraining, iterable loaders, logging, state."""

import contextlib
import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dream_trainer import (
    Callback,
    DeviceParameters,
    LoggingParameters,
    StopTraining,
    TrainerConfig,
    TrainingParameters,
)
from dream_trainer.testing import RecordingCallback, ToyTrainer


def make(callbacks=(), trainer_kwargs=None, **training):
    logging_params = LoggingParameters(log_every_n_steps=training.pop("log_every_n_steps", 1000), log_grad_norm=True)
    params = dict(n_epochs=1, num_sanity_val_steps=0)
    params.update(training)
    config = TrainerConfig(
        root_dir="runs",
        training_parameters=TrainingParameters(**params),
        logging_parameters=logging_params,
        device_parameters=DeviceParameters.SINGLE_DEVICE(),
        callbacks=list(callbacks),
    )
    return ToyTrainer(config, **(trainer_kwargs or {}))


# -------------------------------------------------------------------- hook order
OPT = ["pre_optimizer_step", "post_optimizer_step", "pre_optimizer_zero_grad", "post_optimizer_zero_grad"]


def micro(log=False):  # the first micro-batch of a step (accumulation): no optimizer hooks
    return ["on_step_begin", "pre_train_step", "post_train_step"]


def opt_step(log=False):  # its last: the optimizer hooks, the step's end, then its logging
    return ["pre_train_step", *OPT, "post_train_step", "on_step_end"] + (["on_log"] if log else [])


def validation(batches, log=True):
    steps = ["pre_validation_step", "post_validation_step"] * batches
    return ["pre_validation_epoch", *steps] + (["on_log"] if log else []) + ["post_validation_epoch"]


def test_hook_order_two_epochs_accumulation_and_validation():
    rec = RecordingCallback()
    # 48 train samples / batch 8 = 6 micro-batches per epoch = 3 optimizer steps (accumulation 2);
    # 16 val samples = 2 val batches; validation every 2 steps and at epoch end; log every 2 steps.
    trainer = make(
        [rec],
        trainer_kwargs=dict(n_samples=64, batch_size=8),
        n_epochs=2,
        gradient_accumulation_steps=2,
        val_every_n_steps=2,
        num_sanity_val_steps=1,
        log_every_n_steps=2,
    )
    trainer.fit()
    expected = (
        ["pre_launch", "pre_configure", "post_configure_models", "post_init_weights", "post_configure",
         "pre_setup", "post_setup", "pre_fit"]
        + validation(1, log=False)  # sanity check: not logged
        # epoch 0: steps 1, 2 (log + validation), 3; then epoch-end validation
        + ["pre_epoch", "pre_train_epoch"]
        + micro() + opt_step()
        + micro() + opt_step(log=True) + validation(2)
        + micro() + opt_step()
        + ["post_train_epoch"] + validation(2) + ["post_epoch"]
        # epoch 1: steps 4 (log + validation), 5, 6 (log + validation); epoch-end validation
        # is skipped because step 6 just validated
        + ["pre_epoch", "pre_train_epoch"]
        + micro() + opt_step(log=True) + validation(2)
        + micro() + opt_step()
        + micro() + opt_step(log=True) + validation(2)
        + ["post_train_epoch", "post_epoch", "post_fit", "on_teardown", "post_teardown"]
    )
    assert rec.hooks == expected
    counts = rec.counts()
    for hook in ("launch", "configure", "setup", "fit", "epoch", "train_epoch", "train_step",
                 "optimizer_step", "optimizer_zero_grad", "validation_epoch", "validation_step"):
        if f"pre_{hook}" in counts or f"post_{hook}" in counts:
            if hook != "launch":
                assert counts[f"pre_{hook}"] == counts[f"post_{hook}"], hook
    assert counts["pre_train_step"] == 12 and counts["pre_optimizer_step"] == 6
    assert trainer.global_step == 6 and trainer.current_epoch == 2
    # the optimizer hooks ran on the last micro-batch of each step, never while accumulating
    assert not any(c.accumulating for c in rec.calls if c.hook in OPT)
    assert [c.sanity for c in rec.calls if c.hook == "pre_validation_epoch"] == [True] + [False] * 4
    # on_log payloads: train metrics on steps 2, 4, 6; val metrics after each validation
    train_logs = [(step, m) for step, m in rec.logs if "train/loss" in m]
    assert [step for step, _ in train_logs] == [2, 4, 6]
    assert {"train/loss", "train/lr", "train/grad_norm", "train/epoch"} <= set(train_logs[0][1])
    assert all(isinstance(v, float) for _, m in rec.logs for v in m.values())


def test_accumulation_matches_one_big_batch():
    """2 micro-batches of 8 with accumulation == 1 batch of 16 (loss scaled in backward)."""
    a = make(trainer_kwargs=dict(batch_size=8), gradient_accumulation_steps=2)
    b = make(trainer_kwargs=dict(batch_size=16))
    a.fit()
    b.fit()
    assert a.global_step == b.global_step == 12
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_partial_accumulation_at_epoch_end_still_steps():
    # 6 micro-batches with accumulation 4: steps after batch 4 and after the last batch (6)
    trainer = make(trainer_kwargs=dict(n_samples=64, batch_size=8), gradient_accumulation_steps=4)
    trainer.fit()
    assert trainer.global_step == 2


def test_max_steps_and_train_steps_per_epoch():
    trainer = make(n_epochs=None, max_steps=7, train_steps_per_epoch=3)
    trainer.fit()
    assert trainer.global_step == 7 and trainer.current_epoch == 3  # 3 + 3 + 1: the third epoch ends early


def test_iterable_dataloader_without_len():
    rec = RecordingCallback()
    trainer = make([rec], trainer_kwargs=dict(iterable=True, n_samples=64, batch_size=8), n_epochs=2,
                   gradient_accumulation_steps=4)
    with pytest.raises(TypeError):
        len(trainer.configure_dataloaders()[0])
    trainer.fit()
    # 6 batches per epoch, length unknown: the look-ahead still steps on the last batch
    assert trainer.train_steps_per_epoch is None and trainer.last_epoch_batches == 6
    assert rec.counts()["pre_train_step"] == 12 and trainer.global_step == 4


def test_iterable_with_train_steps_per_epoch():
    trainer = make(trainer_kwargs=dict(iterable=True, n_samples=64, batch_size=8), n_epochs=2, train_steps_per_epoch=4)
    trainer.fit()
    assert trainer.train_steps_per_epoch == 4 and trainer.global_step == 8


def test_gradient_clipping_bounds_the_update():
    trainer = make(trainer_kwargs=dict(lr=1.0), gradient_clip_val=1e-3, n_epochs=None, max_steps=1)
    before = None

    class Snapshot(Callback):
        def pre_optimizer_step(self, model, optimizer):
            nonlocal before
            before = [p.detach().clone() for p in model.parameters()]
            grads = torch.cat([p.grad.flatten() for p in model.parameters()])
            assert grads.norm() <= 1e-3 * (1 + 1e-4)

    trainer.callbacks.add(Snapshot())
    trainer.fit()
    delta = torch.cat([(p.detach() - b).flatten() for p, b in zip(trainer.model.parameters(), before)])
    assert 0 < delta.norm() <= 1e-3 * (1 + 1e-4)  # lr 1: the step is the clipped gradient


def test_loss_falls_and_validation_metrics_are_logged():
    rec = RecordingCallback()
    trainer = make([rec], n_epochs=5, log_every_n_steps=1)
    trainer.fit()
    losses = [float(x) for x in trainer.step_losses]
    assert losses[-1] < 0.5 * losses[0]
    val = [m["val/loss"] for _, m in rec.logs if "val/loss" in m]
    assert len(val) == 5 and val[-1] < val[0]
    assert trainer.logged_metrics["val/loss"] == val[-1]


class Boom(Callback):
    critical = False

    def post_train_step(self, result, batch_idx):
        raise RuntimeError("non-critical boom")


def test_non_critical_callback_error_does_not_stop_training(caplog):
    trainer = make([Boom()])
    with caplog.at_level(logging.WARNING):
        trainer.fit()
    assert trainer.global_step == 12
    assert "non-critical boom" in caplog.text and "disabling callback 'Boom'" in caplog.text


class Interrupted(Callback):
    def __init__(self):
        self.interrupted = False
        self.post_fit_ran = False

    def on_interrupt(self, error):
        self.interrupted = True
        assert dist.is_initialized()  # the world is still up while callbacks react

    def post_fit(self):
        self.post_fit_ran = True


def test_critical_error_stops_runs_on_interrupt_and_destroys_process_group():
    class Critical(Callback):
        def post_train_step(self, result, batch_idx):
            if self.trainer.global_step == 3:
                raise ValueError("critical boom")

    watcher = Interrupted()
    trainer = make([Critical(), watcher])
    with pytest.raises(ValueError, match="critical boom"):
        trainer.fit()
    assert trainer.global_step == 3
    assert watcher.interrupted and not watcher.post_fit_ran
    assert not dist.is_initialized()


def test_stop_training_ends_fit_cleanly():
    class Stopper(Callback):
        def post_train_step(self, result, batch_idx):
            if self.trainer.global_step == 4:
                raise StopTraining("loss is low enough")

    watcher = Interrupted()
    trainer = make([Stopper(), watcher], n_epochs=3)
    trainer.fit()  # returns normally
    assert trainer.global_step == 4 and trainer.stop_reason == "loss is low enough"
    assert watcher.post_fit_ran and not watcher.interrupted
    assert not dist.is_initialized()


def test_log_dict_is_dropped_without_sync_off_log_steps():
    seen = []

    class Logs(Callback):
        def on_log(self, metrics, step):
            seen.append((step, sorted(metrics)))

    class Logging(ToyTrainer):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            self.log_dict({"train/custom": out["loss"] * 2})
            return out

    trainer = Logging(make([Logs()], log_every_n_steps=4).config)
    trainer.fit()
    custom = [step for step, keys in seen if "train/custom" in keys]
    # logged on steps 4, 8, 12 only, in the same payload as the step's own metrics
    assert custom == [4, 8, 12]
    assert all("train/loss" in keys for _, keys in seen if "train/custom" in keys)
    assert trainer.logged_metrics["train/custom"] == pytest.approx(2 * float(trainer.step_losses[-1]), rel=1e-6)


@pytest.mark.parametrize("max_steps, want", [(3, [3]), (10, [4, 8, 10]), (8, [4, 8])])
def test_the_step_that_reaches_max_steps_is_logged(max_steps, want):
    """A run shorter than its log interval, or ending between two log steps, logs its last
    step's metrics (once: max_steps on an interval is not logged twice)."""
    seen = []

    class Logs(Callback):
        def on_log(self, metrics, step):
            if "train/loss" in metrics:
                seen.append(step)

    trainer = make([Logs()], log_every_n_steps=4, n_epochs=None, max_steps=max_steps)
    trainer.fit()
    assert seen == want and trainer.global_step == max_steps
    assert trainer.logged_metrics["train/loss"] == pytest.approx(float(trainer.step_losses[-1]), rel=1e-6)


def test_state_dict_round_trip():
    a = make(n_epochs=2)
    a.fit()
    state = a.state_dict()
    b = make(n_epochs=2)
    b.world.launch()
    try:
        b.configure()
        b.load_state_dict(state)
    finally:
        b.world.teardown()
    assert b.global_step == a.global_step and b.resumed
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)


def test_training_step_must_return_a_dict():
    class Bad(ToyTrainer):
        def training_step(self, batch, batch_idx):
            super().training_step(batch, batch_idx)
            return 1.0

    with pytest.raises(TypeError, match="training_step must return a dict"):
        Bad(make().config).fit()
    assert not dist.is_initialized()


def test_missing_train_dataloader_is_a_clear_error():
    class NoData(ToyTrainer):
        def configure_dataloaders(self):
            return None

    with pytest.raises(ValueError, match="set self.train_dataloader"):
        NoData(make().config).fit()


def test_dream_trainer_requires_hooks_the_config_needs():
    from dream_trainer import DreamTrainer

    class NoCompile(ToyTrainer):
        apply_compile = DreamTrainer.apply_compile  # as if the subclass never wrote it

    built = []

    class Spy(NoCompile):
        def configure_models(self):
            built.append(True)
            super().configure_models()

    cfg = make().config
    cfg.device_parameters = DeviceParameters.SINGLE_DEVICE(compile_model=True)
    with pytest.raises(NotImplementedError, match=r"compile_model=True.*apply_compile\(\)"):
        Spy(cfg).fit()
    cfg.device_parameters = DeviceParameters.SINGLE_DEVICE(checkpoint_activations=True)
    with pytest.raises(NotImplementedError, match=r"checkpoint_activations=True.*apply_activation_checkpointing"):
        Spy(cfg).fit()
    assert built == []  # failed before building anything
    assert not dist.is_initialized()


def test_meta_tensor_left_behind_is_reported():
    class LeavesMeta(ToyTrainer):
        def init_weights(self):
            super().init_weights()
            self.model.register_buffer("stale", torch.empty(3, device="meta"))

    with pytest.raises(RuntimeError, match=r"still on the meta device: model\.stale"):
        LeavesMeta(make().config).fit()


def test_models_are_built_on_meta_and_materialized():
    devices = []

    class Spy(ToyTrainer):
        def configure_models(self):
            super().configure_models()
            devices.append(next(self.model.parameters()).device.type)

    trainer = Spy(make().config)
    trainer.fit()
    assert devices == ["meta"] and next(trainer.model.parameters()).device.type == "cpu"


def test_train_and_validation_contexts_wrap_every_step():
    events = []

    @contextlib.contextmanager
    def tag(name):
        events.append(f"enter {name}")
        yield
        events.append(f"exit {name}")

    class Contexts(Callback):
        def train_context(self):
            return tag("train")

        def validation_context(self):
            return tag("val")

    class Steps(ToyTrainer):
        def training_step(self, batch, batch_idx):
            events.append("train_step")
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch, batch_idx):
            events.append("val_step")
            return super().validation_step(batch, batch_idx)

    Steps(make([Contexts()], trainer_kwargs=dict(n_samples=32, batch_size=8), gradient_accumulation_steps=2).config,
          n_samples=32, batch_size=8).fit()
    train = ["enter train", "train_step", "exit train"]
    val = ["enter val", "val_step", "exit val"]
    assert events == train * 3 + val * 1  # 24 train samples / 8, 8 val samples / 8


def test_autocast_from_device_parameters():
    dtypes = []

    class Spy(ToyTrainer):
        def training_step(self, batch, batch_idx):
            dtypes.append(self.model(batch[0]).dtype)
            return super().training_step(batch, batch_idx)

    cfg = make().config
    cfg.device_parameters = DeviceParameters.SINGLE_DEVICE(autocast_dtype=torch.bfloat16)
    Spy(cfg).fit()
    assert set(dtypes) == {torch.bfloat16}


def test_autocast_covers_the_forward_but_not_the_backward():
    """The configured autocast wraps the training step's forward; ``self.backward`` runs the
    backward with autocast off (torch's advice: under it, eager backward ops re-dispatch
    through autocast), and a custom backward that wants it turns it on itself."""
    seen = {}

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen["forward"] = torch.is_autocast_enabled("cpu")
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen["backward"] = torch.is_autocast_enabled("cpu")
            return grad

    class Spy(ToyTrainer):
        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(Probe.apply(self.model(x)).float(), y)
            self.backward(loss)
            seen["after"] = torch.is_autocast_enabled("cpu")  # the step's context is back
            self.step(self.optimizer)
            return {"loss": loss}

    cfg = make(max_steps=1).config
    cfg.device_parameters = DeviceParameters.SINGLE_DEVICE(autocast_dtype=torch.bfloat16)
    Spy(cfg).fit()
    assert seen == {"forward": True, "backward": False, "after": True}


class _AfterTheWorld(Callback):
    """Records what it sees in the two teardown hooks; raises in post_teardown if asked."""

    def __init__(self, fail=False, critical=False):
        self.fail, self.critical, self.seen = fail, critical, []

    def on_teardown(self, status):
        self.seen.append(("on_teardown", status, self.trainer.world.torn_down_calls))

    def post_teardown(self, status):
        self.seen.append(("post_teardown", status, self.trainer.world.torn_down_calls))
        if self.fail:
            raise RuntimeError("upload failed")


def _count_teardowns(trainer):
    world = trainer.world
    world.torn_down_calls = 0
    original = world.teardown

    def teardown(*args, **kwargs):
        world.torn_down_calls += 1
        return original(*args, **kwargs)

    world.teardown = teardown


@pytest.mark.parametrize("stop", [False, True])
def test_post_teardown_runs_after_the_world_is_torn_down_on_every_path(stop):
    """An upload after the process group is gone lives in post_teardown, inside fit(): it
    runs after world.teardown(), also when the run was stopped."""
    class Stopper(Callback):
        def pre_fit(self):
            if stop:
                raise StopTraining("enough")

    after = _AfterTheWorld()
    trainer = make([Stopper(), after], max_steps=2)
    _count_teardowns(trainer)
    trainer.fit()
    status = "stopped" if stop else "completed"
    assert after.seen == [("on_teardown", status, 0), ("post_teardown", status, 1)]
    assert trainer.status == status


def test_a_critical_callback_failing_in_post_teardown_fails_the_run():
    after = _AfterTheWorld(fail=True)
    after.critical = True
    trainer = make([after], max_steps=2)
    _count_teardowns(trainer)
    with pytest.raises(RuntimeError, match="upload failed"):
        trainer.fit()
    assert trainer.status == "failed" and trainer.exit_code == 1


def test_a_non_critical_callback_failing_in_post_teardown_is_logged_not_raised(caplog):
    after = _AfterTheWorld(fail=True)
    trainer = make([after], max_steps=2)
    _count_teardowns(trainer)
    with caplog.at_level(logging.ERROR):
        trainer.fit()
    assert trainer.status == "completed"
    assert any("upload failed" in r.getMessage() or (r.exc_info and "upload failed" in str(r.exc_info[1]))
               for r in caplog.records)


def test_each_training_epoch_starts_with_every_module_in_training_mode():
    """Validation sets eval mode, and so may a callback (here one submodule, mid-epoch): the next
    epoch trains every module again. A model already training is only read (no ``train()``
    walk), and a model whose own ``train()`` leaves a module in eval keeps getting called."""

    class Freezes(Callback):
        def __init__(self):
            self.modes: list[bool] = []

        def pre_train_epoch(self):
            self.modes.append(all(m.training for m in self.trainer.model.modules()))

        def post_train_step(self, result, batch_idx):
            if self.trainer.current_epoch == 0 and batch_idx == 0:
                next(iter(self.trainer.model.children())).eval()  # one submodule, mid-epoch

    freezes = Freezes()
    trainer = make([freezes], n_epochs=3, validate_at_epoch_end=True)
    trainer.fit()
    assert freezes.modes == [True, True, True]
    assert all(m.training for m in trainer.model.modules())

    from dream_trainer.trainer.epochs import train_mode

    calls: list[int] = []

    class KeepsNormInEval(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.norm = nn.Linear(2, 2), nn.BatchNorm1d(2)

        def train(self, mode: bool = True):
            calls.append(int(mode))
            super().train(mode)
            self.norm.eval()  # a frozen norm: its statistics stay
            return self

    custom, plain = KeepsNormInEval(), nn.Sequential(nn.Linear(2, 2))
    custom.eval()  # e.g. validation: eval() is train(False)
    plain.train = lambda mode=True: calls.append(-1)  # type: ignore[method-assign]  # must not be called
    train_mode([custom, plain])
    train_mode([custom, plain])  # its norm still in eval: called again, as every epoch before
    assert calls == [0, 1, 1] and not custom.norm.training and custom.body.training


def test_a_batch_is_counted_as_it_arrived_skipped_batches_too():
    """``step_stats.samples`` counts the batch as it arrived (not what a ``pre_train_step``
    made of it), a skipped batch included; the totals sum every batch of the epoch."""
    from dream_trainer import SkipBatch

    class Crops(Callback):
        skips_batches = True

        def __init__(self):
            self.arrived: list[int] = []
            self.counted: list[tuple[int, int]] = []
            self.skipped_counted: list[int] = []

        def pre_fit(self):
            self.trainer.request_batch_counts()

        def pre_train_step(self, batch, batch_idx):
            self.arrived.append(len(batch[0]))
            if batch_idx == 1:
                raise SkipBatch("batch 1")
            return (batch[0][:1], batch[1][:1])  # what the step trains on: one sample

        def post_train_step(self, result, batch_idx):
            stats = self.trainer.step_stats
            self.counted.append((stats.samples, stats.total_samples))

        def on_step_end(self, step):
            if self.trainer.step_skipped:
                self.skipped_counted.append(self.trainer.step_stats.samples)

    crops = Crops()
    trainer = make([crops], n_epochs=1)
    trainer.fit()
    sizes = crops.arrived
    assert len(sizes) >= 3 and crops.skipped_counted == [sizes[1]]
    trained = [size for i, size in enumerate(sizes) if i != 1]
    assert [samples for samples, _ in crops.counted] == trained
    assert crops.counted[-1][1] == trainer.step_stats.total_samples == sum(sizes)


def test_batches_are_counted_only_once_something_asks_and_from_then_on():
    """Nobody asked: the loop never calls ``count_batch`` and the counts read None (not a
    silent 0). Asked at the end of step 3: counted from step 4's batch on, the world's
    totals with them on the next log step."""
    looked: list[int] = []

    def counted(callbacks=()):
        trainer = make(callbacks, log_every_n_steps=2)
        trainer.count_batch = lambda batch: (looked.append(len(batch[0])), (len(batch[0]), None))[1]
        return trainer

    quiet = counted()
    quiet.fit()
    stats = quiet.step_stats
    assert looked == [] and quiet.global_step >= 6
    assert (stats.samples, stats.total_samples, stats.world_samples) == (None, None, None)

    class AskLate(Callback):
        def __init__(self):
            self.seen: list[tuple[int, int | None, int | None]] = []

        def on_step_end(self, step):
            stats = self.trainer.step_stats
            self.seen.append((step, stats.samples, stats.world_samples))
            if step == 3:
                self.trainer.request_batch_counts()

    ask = AskLate()
    trainer = counted([ask])
    trainer.fit()
    steps = trainer.global_step
    assert len(looked) == steps - 3 and trainer.step_stats.total_samples == sum(looked)
    assert [s for _, s, _ in ask.seen] == [None] * 3 + looked
    assert ask.seen[3][2] == looked[0]  # step 4, a log step: the world's totals (one rank) refreshed

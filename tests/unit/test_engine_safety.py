"""Engine safety in one process: exit paths (on_interrupt gets the error, a failed
preemption save fails the run, on_teardown on every path, no stale per-step flags),
callback state errors, exact resume of shuffled DataLoaders, bad input caught early."""

import logging
import os
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from dream_trainer import (
    EXIT_FAILED,
    EXIT_PREEMPTED,
    Callback,
    CheckpointCallback,
    CheckpointError,
    CheckpointParameters,
    DeviceParameters,
    DreamTrainer,
    LoggingParameters,
    StopTraining,
    TrainerConfig,
    TrainingParameters,
)
from dream_trainer.testing import ToyTrainer


def config(callbacks=(), log_every=1000, root_dir="runs", **training):
    params = dict(n_epochs=1, num_sanity_val_steps=0)
    params.update(training)
    return TrainerConfig(
        root_dir=root_dir,
        run_name="r",
        training_parameters=TrainingParameters(**params),
        logging_parameters=LoggingParameters(log_every_n_steps=log_every),
        device_parameters=DeviceParameters.SINGLE_DEVICE(),
        callbacks=list(callbacks),
    )


class Ends(Callback):
    """Records on_interrupt's error and on_teardown's status."""

    def __init__(self):
        self.errors, self.statuses = [], []

    def on_interrupt(self, error):
        self.errors.append(error)

    def on_teardown(self, status):
        self.statuses.append(status)
        assert dist.is_initialized() or status == "stopped"  # before the world goes away


class At(Callback):
    """Calls `action(trainer)` at global step `step` (the hook is chosen by `at`)."""

    def __init__(self, action, step):
        self.action, self.step = action, step

    def fire(self, *args):
        if self.trainer.global_step == self.step:
            self.action(self.trainer)


def at(hook, action, step=0, critical=True):
    cls = type(f"At_{hook}", (At,), {hook: At.fire, "critical": critical})
    return cls(action, step)


def raise_(exc):
    def action(trainer):
        raise exc

    return action


# -------------------------------------------------------------------- exit paths
def test_on_interrupt_receives_the_error_and_teardown_the_status():
    ends = Ends()
    boom = ValueError("boom")
    trainer = ToyTrainer(config([at("post_train_step", raise_(boom), step=2), ends]))
    with pytest.raises(ValueError, match="boom"):
        trainer.fit()
    assert ends.errors == [boom] and ends.statuses == ["failed"] and trainer.exit_code == EXIT_FAILED == 1


def test_on_interrupt_receives_the_signal():
    ends = Ends()
    trainer = ToyTrainer(config([at("pre_train_step", lambda t: os.kill(os.getpid(), signal.SIGTERM), step=3), ends]))
    trainer.fit()
    (error,) = ends.errors
    assert error.signal == signal.SIGTERM and "SIGTERM" in error.reason
    assert trainer.status == "preempted" and ends.statuses == ["preempted"] and trainer.exit_code == EXIT_PREEMPTED


def test_a_failed_preemption_save_fails_the_run(monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    def broken(self, plan, planner):
        raise OSError("disk full (injected)")

    monkeypatch.setattr(FileSystemWriter, "write_data", broken)
    ends = Ends()
    saver = CheckpointCallback(CheckpointParameters(root_dir="ckpt", every_n_epochs=None, at_fit_end=False))
    trainer = ToyTrainer(config([at("pre_train_step", lambda t: os.kill(os.getpid(), signal.SIGTERM), step=3), ends, saver]))
    with pytest.raises(Exception, match="disk full"):
        trainer.fit()
    assert trainer.status == "failed" and trainer.exit_code == 1 != EXIT_PREEMPTED
    assert ends.statuses == ["failed"] and not dist.is_initialized()


@pytest.mark.parametrize("hook", ["pre_launch", "pre_configure", "post_setup", "pre_fit"])
def test_stop_before_the_loop_still_tears_down(hook):
    ends = Ends()
    seen = []
    trainer = ToyTrainer(config([at(hook, raise_(StopTraining("not today"))), ends]))
    trainer.step_losses = seen
    trainer.fit()
    assert trainer.status == "stopped" and trainer.stop_reason == "not today" and trainer.exit_code == 0
    assert ends.statuses == ["stopped"] and not seen  # no training step ran
    assert not dist.is_initialized()


def test_a_critical_on_teardown_failure_fails_the_run():
    trainer = ToyTrainer(config([at("on_teardown", raise_(RuntimeError("thread did not join")), step=12)]))
    with pytest.raises(RuntimeError, match="did not join"):
        trainer.fit()
    assert trainer.status == "failed" and not dist.is_initialized()


def test_stop_inside_a_step_leaves_no_stale_log_gate():
    seen = []

    class Logs(Callback):
        def on_log(self, metrics, step):
            seen.append(sorted(metrics))

        def post_fit(self):
            self.trainer.log_dict({"final/score": 1.0})

    class StopsInStep(ToyTrainer):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            if self.global_step == 2:
                assert not self.is_log_step  # a non-log step (log every 1000)
                raise StopTraining("direct")
            return out

    trainer = StopsInStep(config([Logs()]))
    trainer.fit()
    assert trainer.status == "stopped" and not trainer.is_accumulating_gradients and trainer.is_log_step
    assert ["final/score"] in seen  # logged in post_fit, not silently dropped


def test_stop_training_from_a_hook_finishes_the_step_and_stops_at_its_boundary():
    after = []

    class Later(Callback):
        def post_train_step(self, result, batch_idx):
            after.append(self.trainer.global_step)

    trainer = ToyTrainer(config([at("pre_train_step", raise_(StopTraining("enough")), step=4), Later()], n_epochs=3))
    trainer.fit()
    # The step that asked finished (its later callbacks ran too); nothing ran after it.
    assert trainer.global_step == 5 and after[-1] == 5 and trainer.stop_reason == "enough"


# -------------------------------------------------------------------- callback state
class Fragile(Callback):
    critical = False

    def __init__(self, fail_save=False, fail_load=False):
        self.fail_save, self.fail_load, self.count = fail_save, fail_load, 0

    def post_optimizer_step(self, model, optimizer):
        self.count += 1

    def state_dict(self):
        if self.fail_save:
            raise RuntimeError("cannot save")
        return {"count": self.count}

    def load_state_dict(self, state):
        if self.fail_load:
            raise RuntimeError("cannot load")
        self.count = state["count"]


def _checkpointed(callbacks, **training):
    saver = CheckpointCallback(CheckpointParameters(root_dir="ckpt", every_n_steps=3))
    trainer = ToyTrainer(config([*callbacks, saver], **training))
    trainer.fit()
    return trainer, saver


def test_non_critical_state_errors_warn_and_skip(caplog):
    with caplog.at_level(logging.WARNING):
        trainer, saver = _checkpointed([Fragile(fail_save=True)], max_steps=5)
    assert trainer.status == "completed" and saver.saved
    assert "state_dict of non-critical callback 'Fragile' failed" in caplog.text
    _checkpointed([Fragile()], max_steps=5)  # a good state at step 5 (resumed from a stateless 5)
    failing = Fragile(fail_load=True)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        trainer, saver = _checkpointed([failing], max_steps=8)
    assert trainer.status == "completed" and saver.resumed_from is not None and trainer.global_step == 8
    assert "load_state_dict of non-critical callback 'Fragile' failed" in caplog.text and failing.count == 3


class Sharded(Callback):
    """Keeps a DTensor (e.g. an EMA of a sharded model): saved in the shared copy only."""

    def post_setup(self):
        from torch.distributed.tensor import Replicate, distribute_tensor

        self.ema = distribute_tensor(torch.ones(4), self.trainer.world.get_mesh("dp"), [Replicate()])

    def state_dict(self):
        return {"ema": self.ema}

    def load_state_dict(self, state):
        self.ema = state["ema"]


def test_a_saved_callback_missing_on_resume_warns(caplog):
    _checkpointed([Fragile(), Sharded()], max_steps=4)
    with caplog.at_level(logging.WARNING):
        _, saver = _checkpointed([], max_steps=6)
    assert saver.resumed_from is not None
    assert caplog.text.count("which are not in this run") == 1  # one warning, naming both
    assert "state for callback(s) ['Fragile', 'Sharded'], which are not in this run" in caplog.text


# -------------------------------------------------------------------- resume exactness
@pytest.mark.parametrize("sampler", ["generator", "random"])
@pytest.mark.parametrize("cut", [5, 12, 20])  # mid-epoch 0, the end of epoch 0, mid-epoch 1
def test_shuffled_dataloader_resumes_exactly(sampler, cut):
    def fit(root, max_steps):
        saver = CheckpointCallback(CheckpointParameters(root_dir=root, every_n_epochs=None))
        trainer = ToyTrainer(config([saver], n_epochs=3, max_steps=max_steps), sampler=sampler, dropout=0.2)
        trainer.fit()
        return [x.item() for x in trainer.step_losses], trainer

    full, _ = fit("full", None)
    first, _ = fit("cut", cut)
    second, resumed = fit("cut", None)
    assert resumed.resumed and len(first) == cut
    assert first + second == full  # bitwise, in every later epoch too


# -------------------------------------------------------------------- bad input
class Empty(ToyTrainer):
    def configure_dataloaders(self):
        train, val = super().configure_dataloaders()
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(0, 8), torch.zeros(0, 1))), val


class EmptyIterable(ToyTrainer):
    def configure_dataloaders(self):
        class Nothing(torch.utils.data.IterableDataset):
            def __iter__(self):
                return iter(())

        return torch.utils.data.DataLoader(Nothing(), batch_size=4), None


def test_empty_training_loader_is_an_error():
    with pytest.raises(ValueError, match="training dataloader is empty"):
        Empty(config(n_epochs=2)).fit()
    with pytest.raises(ValueError, match="yielded no batches in epoch 0"):
        EmptyIterable(config(n_epochs=None, max_steps=10)).fit()  # used to loop forever


def test_unwritable_checkpoint_root_fails_before_launch(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    saver = CheckpointCallback(CheckpointParameters(root_dir=str(blocker / "ckpt")))
    trainer = ToyTrainer(config([saver]))
    with pytest.raises(CheckpointError, match="CheckpointParameters.root_dir=.*a_file/ckpt.*cannot be written"):
        trainer.fit()
    assert trainer.global_step == 0 and not trainer.named_models()  # nothing was built
    trainer = ToyTrainer(config([CheckpointCallback()], root_dir=str(blocker)))
    with pytest.raises(CheckpointError, match="TrainerConfig.root_dir"):
        trainer.fit()


class Plateau(ToyTrainer):
    def configure_schedulers(self):
        self.scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(self.optimizer, factor=0.5, patience=0, threshold=10.0)


def test_reduce_lr_on_plateau_needs_a_monitor_and_steps_on_it():
    built = []

    class Watch(Callback):
        def post_configure(self):
            built.append(True)

    with pytest.raises(ValueError, match="ReduceLROnPlateau.*scheduler_monitor"):
        Plateau(config([Watch()])).fit()
    trainer = Plateau(config(n_epochs=2, val_every_n_steps=4, scheduler_monitor="val/loss"))
    trainer.fit()
    # 24 steps: validation at 4, 8, ..., 24 (6 runs); threshold=10 (relative) makes every run
    # "no better" than the best so far (even the first: best * (1 - 10) is -inf), and
    # patience=0 halves the lr at each of the 6.
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.05 * 0.5**6)
    bad = Plateau(config(n_epochs=1, scheduler_monitor="val/nope"))
    with pytest.raises(KeyError, match="val/nope.*logged metrics"):
        bad.fit()


def test_missing_user_methods_fail_before_anything_is_built():
    built = []

    class NoOptimizer(DreamTrainer):
        def configure_models(self):
            built.append("models")
            self.model = torch.nn.Linear(2, 2)

        def configure_dataloaders(self):
            return [], None

        def training_step(self, batch, batch_idx):
            return {}

    trainer = NoOptimizer(config())
    with pytest.raises(NotImplementedError, match=r"NoOptimizer must implement configure_optimizers\(\)"):
        trainer.fit()
    assert not built and not dist.is_initialized()


def test_context_parallel_on_a_trainer_that_does_not_apply_it_is_rejected_clearly(monkeypatch):
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():  # rank 0 of a torchrun world of 2
        monkeypatch.setenv(key, value)
    params = DeviceParameters(dp_replicate=1, context_parallel=2)
    from dream_trainer.trainer.base import BaseTrainer

    class OwnLoop(BaseTrainer):  # no step API: nothing would shard the sequences
        pass

    with pytest.raises(ValueError, match=r"context_parallel=2: OwnLoop does not apply context parallelism \(DreamTrainer"):
        OwnLoop(TrainerConfig(device_parameters=params))
    assert ToyTrainer(TrainerConfig(device_parameters=params)).applies_context_parallel  # DreamTrainer does


def test_epoch_loss_is_a_running_mean():
    results = []

    class Epochs(Callback):
        def post_train_epoch(self, result):
            results.append(result)

    trainer = ToyTrainer(config([Epochs()], gradient_accumulation_steps=2))
    trainer.fit()
    (result,) = results
    assert result["batches"] == 12
    assert torch.allclose(result["loss"], torch.stack(trainer.step_losses).mean())


@pytest.mark.parametrize(
    "first", ["dream_trainer.trainer.base", "dream_trainer.protocol.base", "dream_trainer.protocol.collection", "dream_trainer.trainer"]
)
def test_shipped_callbacks_import_from_the_callbacks_package(first):
    code = (
        f"import {first}\n"
        "from dream_trainer.callbacks import CheckpointCallback, LoggerCallback, ProgressBarCallback\n"
        "import dream_trainer\n"
        "assert dream_trainer.CheckpointCallback is CheckpointCallback\n"
        "import logging; assert hasattr(logging, 'getLogger')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr

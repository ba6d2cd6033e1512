"""The seams plug-ins build on, each used as its plug-in would use it, in one process:
model-build hooks, step control, per-step telemetry, logging that never drops data, and the
event hooks. (The 2-rank versions are in tests/distributed/test_seams_distributed.py.)"""

import json
import math
import time

import pytest
import torch
from torch import nn

from dream_trainer import (
    Callback,
    CheckpointCallback,
    CheckpointParameters,
    DeviceParameters,
    DistributedWorld,
    LoggerCallback,
    LoggingParameters,
    SkipBatch,
    TrainerConfig,
    TrainingParameters,
)
from dream_trainer.testing import RecordingCallback, ToyTrainer


def config(callbacks=(), log_every=1000, device=None, **training):
    params = dict(n_epochs=1, num_sanity_val_steps=0)
    params.update(training)
    return TrainerConfig(
        run_name="r",
        training_parameters=TrainingParameters(**params),
        logging_parameters=LoggingParameters(log_every_n_steps=log_every),
        device_parameters=device or DeviceParameters.SINGLE_DEVICE(),
        callbacks=list(callbacks),
    )


# -------------------------------------------------------------------- model-build hooks
class Scaled(nn.Linear):
    """What a conversion callback (FP8, LoRA, QAT) puts in place of nn.Linear: a subclass
    with a buffer of its own."""

    def __init__(self, linear):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None)
        self.register_buffer("scale", torch.empty(()))

    def forward(self, x):
        return super().forward(x) * self.scale


class Convert(Callback[ToyTrainer]):
    def __init__(self):
        self.seen_devices, self.optimizers_then = [], None

    def post_configure_models(self, models):
        model = models["model"]
        self.seen_devices.append(next(model.parameters()).device.type)
        self.optimizers_then = list(self.trainer.named_optimizers())
        for index in (0, 2):
            model[index] = Scaled(model[index])  # built under the meta device too

    def post_init_weights(self, models):
        for module in models["model"].modules():
            if isinstance(module, Scaled):
                module.scale.fill_(1.0)


def test_model_build_hooks_replace_modules_before_the_optimizer_sees_them():
    convert = Convert()
    trainer = ToyTrainer(config([convert]))
    trainer.fit()
    assert convert.seen_devices == ["meta"] and convert.optimizers_then == []
    layers = [trainer.model[0], trainer.model[2]]
    assert all(type(m) is Scaled and m.scale.item() == 1.0 and m.scale.device.type == "cpu" for m in layers)
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert {id(p) for p in trainer.model.parameters()} == optimized  # the optimizer has the new modules
    assert trainer.step_losses[-1] < trainer.step_losses[0]  # and they train


# -------------------------------------------------------------------- step control
class VetoAt(Callback):
    vetoes_steps = True

    def __init__(self, batches):
        self.batches, self.batch = set(batches), None

    def pre_train_step(self, batch, batch_idx):
        self.batch = batch_idx

    def pre_optimizer_step(self, model, optimizer):
        return self.batch not in self.batches


def _params(trainer):
    return [p.detach().clone() for p in trainer.model.parameters()]


def test_a_vetoed_step_is_not_applied_and_does_not_count():
    seen, rec = [], RecordingCallback()

    class Watch(Callback):
        def post_train_step(self, result, batch_idx):
            seen.append((batch_idx, self.trainer.global_step, self.trainer.step_skipped, _params(self.trainer)))

    trainer = ToyTrainer(config([VetoAt({3}), Watch(), rec]))
    trainer.fit()
    (b2, s2, k2, p2), (b3, s3, k3, p3), (b4, s4, k4, _) = seen[2:5]
    assert (s2, s3, s4) == (3, 3, 4) and (k2, k3, k4) == (False, True, False)  # no increment on the veto
    assert all(torch.equal(a, b) for a, b in zip(p2, p3))  # no update
    assert trainer.skipped_steps == 1 and trainer.global_step == 11  # 12 batches, one step vetoed
    assert trainer.step_stats.skipped is None and trainer.optimizer.state_dict()["state"] == {}  # SGD: stateless
    assert rec.counts()["post_optimizer_step"] == 11 and rec.counts()["pre_optimizer_zero_grad"] == 12


def test_skip_step_if_decides_on_the_device_and_drops_the_gradients():
    class NonFinite(Callback):  # what an anomaly policy does: no host read of its own
        vetoes_steps = True

        def pre_optimizer_step(self, model, optimizer):
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            self.trainer.skip_step_if(~torch.isfinite(torch.stack([g.norm() for g in grads]).sum()), "non-finite gradients")

    class Poison(ToyTrainer):
        def training_step(self, batch, batch_idx):
            x, y = batch
            if batch_idx == 5:
                x = x * float("nan")
            return super().training_step((x, y), batch_idx)

    trainer = Poison(config([NonFinite()]))
    trainer.fit()
    assert trainer.skipped_steps == 1 and trainer.global_step == 11
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_skip_batch_skips_before_the_forward_and_drops_an_accumulation_group():
    ran = []

    class BadData(Callback):
        skips_batches = True

        def pre_train_step(self, batch, batch_idx):
            if batch_idx in (1, 6):
                raise SkipBatch(f"bad batch {batch_idx}")

    class Record(ToyTrainer):
        def training_step(self, batch, batch_idx):
            ran.append(batch_idx)
            return super().training_step(batch, batch_idx)

    trainer = Record(config([BadData()], gradient_accumulation_steps=2))
    trainer.fit()
    assert ran == [0, 2, 3, 4, 5, 7, 8, 9, 10, 11]
    # batch 1 ended the first accumulation group: that step is dropped; batch 6 began a group
    assert trainer.skipped_batches == 2 and trainer.skipped_steps == 1 and trainer.global_step == 5


def test_step_control_mistakes_are_clear_errors():
    class Undeclared(Callback):
        def pre_optimizer_step(self, model, optimizer):
            return False

    with pytest.raises(RuntimeError, match=r"\['Undeclared'\] returned False from pre_optimizer_step.*vetoes_steps = True"):
        ToyTrainer(config([Undeclared()])).fit()

    class Skips(ToyTrainer):
        def training_step(self, batch, batch_idx):
            self.skip_step("x")
            return super().training_step(batch, batch_idx)

    with pytest.raises(RuntimeError, match=r"skip_step\(\) needs vetoes_steps = True"):
        Skips(config()).fit()

    class Late(ToyTrainer):
        vetoes_steps = True

        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            self.skip_step("after the step")
            return out

    with pytest.raises(RuntimeError, match=r"no trainer.step\(optimizer\) followed"):
        Late(config()).fit()

    class UndeclaredSkip(Callback):
        def pre_train_step(self, batch, batch_idx):
            raise SkipBatch("no")

    with pytest.raises(RuntimeError, match="raised SkipBatch but does not declare skips_batches = True"):
        ToyTrainer(config([UndeclaredSkip()])).fit()


# -------------------------------------------------------------------- telemetry
class SlowData(ToyTrainer):
    """Each training batch takes 20 ms to load; the learning rate changes every step."""

    def configure_dataloaders(self):
        train, val = super().configure_dataloaders()

        def slow(batch):
            time.sleep(0.02)
            return torch.utils.data.default_collate(batch)

        train = torch.utils.data.DataLoader(train.dataset, batch_size=self.batch_size, sampler=train.sampler, collate_fn=slow)
        return train, val

    def configure_schedulers(self):
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0 / (step + 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.model(x), y)
        self.backward(loss)
        if not self.is_accumulating_gradients:  # by hand: the norm the step clips from
            grads = [p.grad for p in self.model.parameters()]
            self.hand_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
        self.step(self.optimizer)
        self.step_losses.append(loss.detach())
        return {"loss": loss}


def test_step_stats_on_a_log_step_equal_a_hand_computation():
    rows = []

    class Read(Callback):
        def pre_fit(self):
            self.trainer.request_batch_counts()

        def post_train_step(self, result, batch_idx):
            trainer = self.trainer
            if trainer.is_accumulating_gradients or not trainer.is_log_step:
                return
            stats = trainer.step_stats
            rows.append({
                "step": stats.step, "norm": float(stats.grad_norm["optimizer"]), "hand": float(trainer.hand_norm),
                "clipped": bool(stats.clipped["optimizer"]), "lr": stats.lr["optimizer"],
                "loss": float(stats.loss), "hand_loss": float(torch.stack(trainer.step_losses[-2:]).mean()),
                "samples": stats.samples, "tokens": stats.tokens, "total": stats.total_samples,
                "world": stats.world_samples, "time": stats.step_time_s, "wait": stats.data_wait_s,
                "micro": stats.micro_batches,
            })

    trainer = SlowData(config([Read()], log_every=2, gradient_accumulation_steps=2, gradient_clip_val=0.05),
                       batch_size=8)
    trainer.fit()
    assert [r["step"] for r in rows] == [2, 4, 6, 8, 10, 12]
    for r in rows:
        assert r["norm"] == pytest.approx(r["hand"], rel=1e-5) and r["clipped"] == (r["hand"] > 0.05)
        assert r["lr"] == pytest.approx(0.05 / r["step"])  # the lr the step used: LambdaLR at step-1
        assert r["loss"] == pytest.approx(r["hand_loss"], rel=1e-6) and r["micro"] == 2
        assert r["samples"] == 16 and r["tokens"] is None and r["total"] == r["world"] == 16 * r["step"]
        assert 2 * 0.02 <= r["wait"] < r["time"]  # two slow batches per step
    assert any(r["clipped"] for r in rows)


def test_lr_logged_is_the_lr_the_step_used():
    class Sched(ToyTrainer):
        def configure_schedulers(self):
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0 / (step + 1))

    rec = RecordingCallback()
    Sched(config([rec], log_every=3)).fit()
    lrs = {step: m["train/lr"] for step, m in rec.logs if "train/lr" in m}
    assert lrs == {3: pytest.approx(0.05 / 3), 6: pytest.approx(0.05 / 6), 9: pytest.approx(0.05 / 9), 12: pytest.approx(0.05 / 12)}


def test_tokens_are_counted_for_token_id_batches():
    from dream_trainer.trainer.telemetry import count_batch

    assert count_batch((torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 16, dtype=torch.long))) == (4, 64)
    assert count_batch({"x": torch.zeros(3, 8)}) == (3, None)
    assert count_batch([]) == (0, None)


# -------------------------------------------------------------------- logging
def test_a_non_numeric_metric_raises_at_the_call():
    class Bad(Callback):
        def post_train_step(self, result, batch_idx):
            self.trainer.log_dict({"train/name": "resnet"})

    with pytest.raises(TypeError, match=r"metric 'train/name'='resnet' \(str\) is not a number"):
        ToyTrainer(config([Bad()])).fit()
    with pytest.raises(TypeError, match=r"metric 'x': a tensor of shape \(2,\)"):
        ToyTrainer(config()).log_dict({"x": torch.ones(2)})


def _tensorboard(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_logging_from_every_hook_reaches_the_sinks(tmp_path):
    class Logs(Callback):
        log_every_n_steps = 3  # its own interval, not a multiple of the trainer's 5

        def __init__(self):
            super().__init__()
            self.nested = 0

        def post_train_step(self, result, batch_idx):
            self.trainer.log_scalar("train/every_step", float(self.trainer.global_step))
            if self.trainer.is_log_step and self.trainer.global_step % 3 == 0:
                self.trainer.log_scalar("cb/own_interval", self.trainer.global_step)

        def post_validation_epoch(self, result):
            self.trainer.log_scalar("val/extra", 2.0 * float(result["val/loss"]))

        def on_log(self, metrics, step):
            if "val/extra" in metrics:  # a derived metric logged from on_log itself
                self.nested += 1
                self.trainer.log_scalar("val/derived", metrics["val/extra"] + 1)

    logs = Logs()
    trainer = ToyTrainer(TrainerConfig(
        run_name="r", root_dir=str(tmp_path), device_parameters=DeviceParameters.SINGLE_DEVICE(),
        training_parameters=TrainingParameters(n_epochs=1, num_sanity_val_steps=0, val_every_n_steps=4),
        logging_parameters=LoggingParameters(log_every_n_steps=5), callbacks=[logs, LoggerCallback()]))
    trainer.fit()
    scalars = _tensorboard(trainer.run_dir / "logs")
    assert [s for s, _ in scalars["cb/own_interval"]] == [3, 6, 9, 12]
    # logged every step: sent at the log steps (3, 5, 6, 9, 10, 12) and with the next dispatch
    # after a validation run (4, 8), always the latest value
    assert scalars["train/every_step"] == [(s, float(s)) for s in (3, 4, 5, 6, 8, 9, 10, 12)]
    assert [s for s, _ in scalars["train/loss"]] == [5, 10]  # the trainer's own: its interval
    extra, derived = dict(scalars["val/extra"]), dict(scalars["val/derived"])
    assert sorted(extra) == sorted(derived) == [4, 8, 12]  # post_validation_epoch, and on_log, same step
    assert all(derived[s] == pytest.approx(extra[s] + 1) for s in extra) and logs.nested == 3
    records = [json.loads(line) for line in (trainer.run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert not any(isinstance(v, str) and not math.isnan(float(v)) for r in records for v in r.values() if isinstance(v, str))


def test_a_value_logged_on_a_non_log_step_is_sent_at_the_next_one():
    rec = RecordingCallback()

    class Once(Callback):
        def post_train_step(self, result, batch_idx):
            if self.trainer.global_step == 2:
                self.trainer.log_scalar("train/rare", 7.0)

    ToyTrainer(config([Once(), rec], log_every=5)).fit()
    assert [(s, m["train/rare"]) for s, m in rec.logs if "train/rare" in m] == [(5, 7.0)]


# -------------------------------------------------------------------- events and the world
@pytest.mark.parametrize("async_mode", ["off", "async"])
def test_checkpoint_events(tmp_path, async_mode):
    events = []

    class Events(Callback):
        def on_checkpoint_saved(self, path, step):
            events.append(("saved", path.name, step, path.is_dir()))

        def on_checkpoint_loaded(self, path, step):
            events.append(("loaded", path.name, step))

    def fit(max_steps):
        saver = CheckpointCallback(CheckpointParameters(root_dir=str(tmp_path), every_n_steps=4, every_n_epochs=None,
                                                        async_mode=async_mode))
        ToyTrainer(config([Events(), saver], max_steps=max_steps, n_epochs=None)).fit()

    fit(8)
    fit(10)
    assert events == [("saved", "step_000000004", 4, True), ("saved", "step_000000008", 8, True),
                      ("loaded", "step_000000008", 8), ("saved", "step_000000010", 10, True)]


def test_a_callback_supplies_the_world_before_launch():
    class Fallback(Callback):
        def pre_launch(self):
            self.trainer.set_world(DistributedWorld(DeviceParameters.SINGLE_DEVICE(timeout_s=7)))

    trainer = ToyTrainer(config([Fallback()], max_steps=2, device=DeviceParameters(dp_replicate=1, dp_shard="auto")))
    trainer.fit()
    assert trainer.world.device_parameters.timeout_s == 7 and trainer.global_step == 2
    with pytest.raises(TypeError, match="set_world\\(\\) takes a DistributedWorld"):
        trainer.set_world("world")


def test_a_world_sharing_its_run_resumes_from_the_newest_checkpoint_of_its_resume_roots(tmp_path, caplog):
    """The world's `resume_roots` seam: the checkpoint callback resumes (``resume_mode="last"``)
    from the newest checkpoint under any root the world names (a fault-tolerant world: every
    replica group's), its own root on a tie; a root the world refuses is an error."""
    own, peer = tmp_path / "own", tmp_path / "peer"

    def fit(root, max_steps, world_roots=None):
        class Shared(Callback):
            def pre_launch(self):
                world = DistributedWorld(DeviceParameters.SINGLE_DEVICE())
                if world_roots is not None:
                    world.resume_roots = world_roots  # this world shares the run with another
                self.trainer.set_world(world)

        saver = CheckpointCallback(CheckpointParameters(root_dir=str(root), every_n_steps=2, every_n_epochs=None))
        trainer = ToyTrainer(config([Shared(), saver], max_steps=max_steps, n_epochs=None))
        trainer.fit()
        return trainer, saver

    fit(own, 2)
    fit(peer, 6)  # the peer went on to step 6
    trainer, saver = fit(own, 8, lambda root: [peer, own])
    assert saver.resumed_from == peer / "step_000000006" and trainer.global_step == 8
    assert f"resumes from {peer / 'step_000000006'}" in caplog.text
    fit(peer, 8)
    _, saver = fit(own, 8, lambda root: [peer, own])  # a tie at step 8: its own
    assert saver.resumed_from == own / "step_000000008"

    def refuse(root):
        raise RuntimeError(f"{root} leads out of the run")

    with pytest.raises(RuntimeError, match="leads out of the run"):
        fit(own, 10, refuse)
    assert DistributedWorld(DeviceParameters.SINGLE_DEVICE()).resume_roots(own) == [own]

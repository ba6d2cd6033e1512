"""The seams on 2 gloo ranks: a module swap before fully_shard, a step veto and a skipped
batch decided on one rank only, and a world supplied by a callback."""

from pathlib import Path

import torch
from torch import nn

from dream_trainer import Callback, DeviceParameters, DistributedWorld, SkipBatch, TrainerConfig, TrainingParameters
from dream_trainer.testing import ToyTrainer, spawn_world


def _config(root, device, callbacks, **training):
    params = dict(n_epochs=1, num_sanity_val_steps=0)
    params.update(training)
    return TrainerConfig(root_dir=str(root), run_name="r", seed=3, device_parameters=device,
                         training_parameters=TrainingParameters(**params), callbacks=list(callbacks))


class FullParams(Callback):
    """The full (unsharded) parameters at the end of fit, while the process group exists."""

    def post_fit(self):
        self.params = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                       for k, v in self.trainer.model.state_dict().items()}


class Tagged(nn.Linear):
    """A conversion's replacement for nn.Linear (as FP8 or LoRA would put in place)."""

    def __init__(self, linear):
        super().__init__(linear.in_features, linear.out_features)
        self.register_buffer("gain", torch.empty(()))

    def forward(self, x):
        return super().forward(x) * self.gain


class Convert(Callback):
    def post_configure_models(self, models):
        for index in (0, 2):
            models["model"][index] = Tagged(models["model"][index])

    def post_init_weights(self, models):
        for module in models["model"].modules():
            if isinstance(module, Tagged):
                module.gain.fill_(1.0)


def _convert_then_shard(root):
    from torch.distributed.fsdp import FSDPModule

    full = FullParams()
    trainer = ToyTrainer(_config(root, DeviceParameters.FSDP(dp_shard=2), [Convert(), full]), batch_size=8)
    trainer.fit()
    sharded = trainer.fsdp_modules("model")
    return {
        "sharded": list(sharded),
        "kinds": [(isinstance(m, Tagged), isinstance(m, FSDPModule)) for m in sharded.values()],
        "first_last": (trainer.step_losses[0].item(), trainer.step_losses[-1].item()),
        "params": full.params,
    }


def test_modules_swapped_before_fully_shard_are_sharded_and_train(tmp_path):
    zero, one = spawn_world(2, _convert_then_shard, str(tmp_path), timeout=120)
    assert zero["sharded"] == ["", "0", "2"]  # the root first, in module order
    assert zero["kinds"] == [(False, True), (True, True), (True, True)]  # the swapped layers are the FSDP units
    assert zero["first_last"][1] < zero["first_last"][0]
    assert all(torch.equal(zero["params"][k], one["params"][k]) for k in zero["params"])


class VetoOnRankOne(Callback):
    vetoes_steps = True

    def pre_train_step(self, batch, batch_idx):
        self.batch = batch_idx

    def pre_optimizer_step(self, model, optimizer):
        return not (self.trainer.world.rank == 1 and self.batch == 3)


class SkipOnRankZero(Callback):
    skips_batches = True

    def pre_train_step(self, batch, batch_idx):
        if self.trainer.world.rank == 0 and batch_idx == 5:
            raise SkipBatch("rank 0 saw a corrupt batch")


def _controlled(root, which):
    callbacks = {"none": [], "veto": [VetoOnRankOne()], "skip": [SkipOnRankZero()]}[which]
    full = FullParams()
    trainer = ToyTrainer(_config(root, DeviceParameters.DDP(), [*callbacks, full]), batch_size=8)
    trainer.fit()
    return {"step": trainer.global_step, "skipped": (trainer.skipped_steps, trainer.skipped_batches),
            "params": full.params}


def test_a_veto_or_a_skip_on_one_rank_applies_on_both(tmp_path):
    for which, expected in (("veto", (1, 0)), ("skip", (1, 1))):
        zero, one = spawn_world(2, _controlled, str(tmp_path / which), which, timeout=120)
        assert zero["skipped"] == one["skipped"] == expected, which
        assert zero["step"] == one["step"] == 11, which  # 12 batches per rank, one step not taken
        assert all(torch.equal(zero["params"][k], one["params"][k]) for k in zero["params"]), which
    plain, _ = spawn_world(2, _controlled, str(tmp_path / "none"), "none", timeout=120)
    assert plain["step"] == 12 and not torch.equal(plain["params"]["0.weight"], zero["params"]["0.weight"])


class DDPFallback(Callback):
    """Supplies the world before launch: DDP instead of the configured FSDP."""

    def pre_launch(self):
        self.trainer.set_world(DistributedWorld(DeviceParameters.DDP()))


def _fallback(root):
    trainer = ToyTrainer(_config(root, DeviceParameters.FSDP(dp_shard=2), [DDPFallback()], max_steps=3), batch_size=8)
    trainer.fit()
    return type(trainer.model).__name__, trainer.fsdp_modules("model"), trainer.world.plan.data_parallel


def test_a_callback_supplies_the_world(tmp_path):
    zero, one = spawn_world(2, _fallback, str(Path(tmp_path)), timeout=120)
    assert zero == one == ("DDPSequential", {}, "ddp")  # replicated by DDP, nothing sharded


class RankFails(ToyTrainer):
    """training_step raises (as a CUDA OOM would) on one rank at one batch, once."""

    def __init__(self, config, fail=None, **kwargs):
        super().__init__(config, **kwargs)
        self.fail = fail  # (rank, batch_idx)

    def training_step(self, batch, batch_idx):
        if self.fail is not None and (self.world.rank, batch_idx) == self.fail:
            self.fail = None
            raise torch.OutOfMemoryError("CUDA out of memory (injected on one rank)")
        return super().training_step(batch, batch_idx)


class RetryOn(Callback):
    recovers_errors = True

    def __init__(self, ranks):
        self.ranks, self.errors = ranks, []

    def on_train_step_error(self, error, batch, batch_idx):
        self.errors.append((None if error is None else type(error).__name__, batch_idx))
        return self.trainer.world.rank in self.ranks


def _recovered(root, fail, retry_ranks, device="ddp"):
    retry, full = RetryOn(retry_ranks), FullParams()
    devices = {"ddp": DeviceParameters.DDP(), "fsdp": DeviceParameters.FSDP(dp_shard=2)}
    trainer = RankFails(_config(root, devices[device], [retry, full]), fail=fail, batch_size=8, dropout=0.1)
    try:
        trainer.fit()
    except Exception as exc:  # noqa: BLE001 - returned to the test
        return {"error": f"{type(exc).__name__}: {exc}", "errors": retry.errors}
    return {"step": trainer.global_step, "errors": retry.errors, "params": full.params}


def test_a_step_that_failed_on_one_rank_is_retried_on_both(tmp_path):
    clean, _ = spawn_world(2, _recovered, str(tmp_path / "clean"), None, (0, 1), timeout=120)
    zero, one = spawn_world(2, _recovered, str(tmp_path / "fail"), (1, 3), (0, 1), timeout=120)
    assert zero["errors"] == [(None, 3)] and one["errors"] == [("OutOfMemoryError", 3)]  # every rank is told
    assert zero["step"] == one["step"] == clean["step"] == 12
    for key, value in clean["params"].items():  # as if it never failed (the error came before any RNG draw)
        assert torch.equal(zero["params"][key], value) and torch.equal(one["params"][key], value), key
    # rank 0 does not recover: both ranks end (no hang), each with its own error
    zero, one = spawn_world(2, _recovered, str(tmp_path / "refused"), (1, 3), (1,), timeout=120)
    assert one["error"].startswith("OutOfMemoryError: CUDA out of memory (injected"), one
    assert zero["error"].startswith("RuntimeError: training_step failed on another rank (batch 3"), zero
    # FSDP2 communicates in the forward: refused at setup, before any step
    zero, _ = spawn_world(2, _recovered, str(tmp_path / "fsdp"), None, (0, 1), "fsdp", timeout=120)
    assert zero["error"].startswith("ValueError: callback(s) ['RetryOn'] recover failed training steps") and not zero["errors"]

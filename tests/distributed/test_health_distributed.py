"""A NaN on one rank only, under the anomaly detector's skip policy: both ranks skip that
update and stay identical (2 gloo ranks, DDP).

Two cases, with the detector reading the CPU values directly and (for the second) with the
device flag an accelerator uses: a NaN input (DDP's all-reduce spreads the NaN gradients, so both ranks see them)
and a NaN only in rank 1's loss value with finite gradients, so only rank 1 detects it
and the other rank skips because the ranks agree (without the agreement, rank 0 would
apply the update and the replicas would drift apart). On every step each rank reads one value of
the device, the skip flag, besides the CPU tensors of the trainer's collectives (the skip
agreement, the control flags: host waits for the collectives, not device syncs)."""

import pytest
import torch

from dream_trainer import Callback, DeviceParameters, TrainerConfig, TrainingParameters
from dream_trainer.callbacks import AnomalyDetectorCallback
from dream_trainer.testing import HostReadCounter, StepReads, ToyTrainer, spawn_world


class NaNOnRankOne(ToyTrainer):
    def __init__(self, config, where, **kwargs):
        super().__init__(config, **kwargs)
        self.where = where

    def training_step(self, batch, batch_idx):
        x, y = batch
        hit = self.world.rank == 1 and self.current_epoch == 0 and batch_idx == 4
        if hit and self.where == "input":
            x = x * float("nan")
        if not (hit and self.where == "loss"):
            return super().training_step((x, y), batch_idx)
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.backward(loss + float("nan"))  # a NaN value whose gradient is the finite loss's
        self.step(self.optimizer)
        return {"loss": loss}


class Params(Callback):
    def __init__(self):
        self.before = self.after = None
        self.saw_nonfinite_grad = False

    def pre_train_step(self, batch, batch_idx):
        if self.trainer.current_epoch == 0 and batch_idx == 4:
            self.before = [p.detach().clone() for p in self.trainer.model.parameters()]

    def pre_optimizer_step(self, model, optimizer):
        if self.trainer.current_epoch == 0 and self.trainer.local_batches == 5:
            self.saw_nonfinite_grad = not all(torch.isfinite(p.grad).all() for p in model.parameters())

    def post_train_step(self, result, batch_idx):
        if self.trainer.current_epoch == 0 and batch_idx == 4:
            self.after = [p.detach().clone() for p in self.trainer.model.parameters()]

    def post_fit(self):
        self.final = [p.detach().clone() for p in self.trainer.model.parameters()]


def _run(root, where, cpu_values):
    AnomalyDetectorCallback.reads_cpu_values = cpu_values  # this rank's process: its own class
    detector, params = AnomalyDetectorCallback("skip"), Params()
    # Not counted: the CPU tensors of the trainer's collectives, the DataLoader's seed (a CPU
    # generator, read when an epoch's iterator is made) and this test's own checks.
    control_plane = ("agree", "any_rank", "agreed_flags", "all_gather_object", "epoch_batches", "pre_optimizer_step")
    counter = HostReadCounter(ignore=lambda read: read.caller in control_plane)
    reads = StepReads(counter)
    config = TrainerConfig(root_dir=str(root), run_name="r", device_parameters=DeviceParameters.DDP(),
                           training_parameters=TrainingParameters(n_epochs=2, num_sanity_val_steps=0,
                                                                  validate_at_epoch_end=False),
                           callbacks=[detector, params, reads])
    trainer = NaNOnRankOne(config, where, batch_size=8)
    with counter:
        trainer.fit()
    return {"skipped": (detector.skipped_steps, trainer.skipped_steps), "events": detector.events,
            "unchanged": all(torch.equal(a, b) for a, b in zip(params.before, params.after)),
            "final": params.final, "step": trainer.global_step, "nonfinite_grad": params.saw_nonfinite_grad,
            "reads": {step: reads.kinds(step) for step in range(1, trainer.global_step + 1)}}


@pytest.mark.parametrize("where, cpu_values", [("input", True), ("loss", True), ("loss", False)])
def test_a_nan_on_one_rank_is_skipped_on_both(tmp_path, where, cpu_values):
    # cpu_values: the detector reads the loss and the norm (CPU tensors) and vetoes on the
    # host; else the accelerator's way, a device flag read at the agreement.
    zero, one = spawn_world(2, _run, str(tmp_path), where, cpu_values, timeout=120)
    if where == "loss":  # rank 0 saw nothing wrong: it skipped only because the ranks agreed
        assert not zero["nonfinite_grad"] and not one["nonfinite_grad"]
    else:
        assert zero["nonfinite_grad"] and one["nonfinite_grad"]
    assert zero["skipped"] == one["skipped"] == (1, 1) and zero["events"] == one["events"] == [(5, 4)]
    assert zero["unchanged"] and one["unchanged"] and zero["step"] == one["step"] == 23
    assert all(torch.equal(a, b) and torch.isfinite(a).all() for a, b in zip(zero["final"], one["final"]))
    # The flag: one read per optimizer step; step 5 ran twice (skipped, then taken). The CPU
    # values are read in `pre_optimizer_step` (not counted here): no other read.
    flag = [] if cpu_values else [("bool", "take_veto")]
    assert zero["reads"] == one["reads"] == {s: flag * (2 if s == 5 else 1) for s in range(1, 24)}, zero["reads"]

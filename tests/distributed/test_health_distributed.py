"""A NaN on one rank only, under the anomaly detector's skip policy: both ranks skip that
update and stay identical (2 gloo ranks, DDP)."""

import torch

from dream_trainer import Callback, DeviceParameters, TrainerConfig, TrainingParameters
from dream_trainer.callbacks import AnomalyDetectorCallback
from dream_trainer.testing import ToyTrainer, spawn_world


class NaNOnRankOne(ToyTrainer):
    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.world.rank == 1 and self.current_epoch == 0 and batch_idx == 4:
            x = x * float("nan")
        return super().training_step((x, y), batch_idx)


class Params(Callback):
    def __init__(self):
        self.before = self.after = None

    def pre_train_step(self, batch, batch_idx):
        if self.trainer.current_epoch == 0 and batch_idx == 4:
            self.before = [p.detach().clone() for p in self.trainer.model.parameters()]

    def post_train_step(self, result, batch_idx):
        if self.trainer.current_epoch == 0 and batch_idx == 4:
            self.after = [p.detach().clone() for p in self.trainer.model.parameters()]

    def post_fit(self):
        self.final = [p.detach().clone() for p in self.trainer.model.parameters()]


def _run(root):
    detector, params = AnomalyDetectorCallback("skip"), Params()
    config = TrainerConfig(root_dir=str(root), run_name="r", device_parameters=DeviceParameters.DDP(),
                           training_parameters=TrainingParameters(n_epochs=2, num_sanity_val_steps=0),
                           callbacks=[detector, params])
    trainer = NaNOnRankOne(config, batch_size=8)
    trainer.fit()
    return {"skipped": (detector.skipped_steps, trainer.skipped_steps), "events": detector.events,
            "unchanged": all(torch.equal(a, b) for a, b in zip(params.before, params.after)),
            "final": params.final, "step": trainer.global_step}


def test_a_nan_on_one_rank_is_skipped_on_both(tmp_path):
    zero, one = spawn_world(2, _run, str(tmp_path), timeout=120)
    assert zero["skipped"] == one["skipped"] == (1, 1) and zero["events"] == one["events"] == [(5, 4)]
    assert zero["unchanged"] and one["unchanged"] and zero["step"] == one["step"] == 23
    assert all(torch.equal(a, b) and torch.isfinite(a).all() for a, b in zip(zero["final"], one["final"]))

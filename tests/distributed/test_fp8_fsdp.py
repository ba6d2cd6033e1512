"""Float8 with FSDP2 on 2 gloo ranks (float8 all-gather, scales precomputed after each step)
against one process on the same global batches."""

import pytest
import torch
from torch import nn

from dream_trainer import DeviceParameters, TrainerConfig, TrainingParameters
from dream_trainer.testing import ToyTrainer, spawn_world

pytest.importorskip("torchao")


class Wide(ToyTrainer):
    def configure_models(self):
        self.model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 16))

    def apply_fully_shard(self, fsdp_config):
        from torch.distributed.fsdp import fully_shard

        for index in (0, 2, 4):
            fully_shard(self.model[index], **fsdp_config)
        fully_shard(self.model, **fsdp_config)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return super().training_step((x, y.expand(-1, 16)), batch_idx)


def _run(root, device_parameters, batch_size):
    from dream_trainer.callbacks import Fp8Quantization

    fp8 = Fp8Quantization()
    config = TrainerConfig(root_dir=str(root), run_name="r", seed=2, device_parameters=device_parameters,
                           training_parameters=TrainingParameters(n_epochs=1, num_sanity_val_steps=0), callbacks=[fp8])
    trainer = Wide(config, in_features=64, batch_size=batch_size)
    trainer.fit()
    return {"losses": torch.stack(trainer.step_losses), "converted": fp8.converted["model"],
            "all_gather": bool(fp8._precompute) if hasattr(fp8, "_precompute") else None}


def test_float8_fsdp2_matches_one_process(tmp_path):
    zero, one = spawn_world(2, _run, str(tmp_path / "two"), DeviceParameters.FSDP(dp_shard=2), 8, timeout=180)
    single = _run(tmp_path / "one", DeviceParameters.SINGLE_DEVICE(), 16)
    assert zero["converted"] == single["converted"] == ["0", "2"]  # the 128x16 head stays high precision
    assert zero["all_gather"] and not single["all_gather"]
    # The mean over the two ranks' halves is the one process's loss on the whole batch, up to
    # float8 rounding: activations are scaled per rank (its half of the batch), not per batch.
    torch.testing.assert_close((zero["losses"] + one["losses"]) / 2, single["losses"], atol=2e-3, rtol=2e-2)

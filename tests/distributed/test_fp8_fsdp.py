"""Float8 with FSDP2 on 2 gloo ranks (float8 all-gather, scales precomputed after each step)
against one process on the same global batches; beside it a GPT-2-style model (Conv1D, no
nn.Linear) that converts nothing and so gets no float8 all-gather and no scale precompute."""

import pytest
import torch
from torch import nn

from dream_trainer import DeviceParameters, TrainerConfig, TrainingParameters
from dream_trainer.testing import ToyTrainer, spawn_world
from dream_trainer.testing.toy import copy_full_
from tests.unit.test_fp8 import Gpt2Mlp

pytest.importorskip("torchao")


class Wide(ToyTrainer):
    def configure_models(self):
        self.model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 16))
        self.gpt2 = Gpt2Mlp(64)

    def init_weights(self):
        super().init_weights()
        g = torch.Generator().manual_seed(1)
        for param in self.gpt2.parameters():
            copy_full_(param, torch.empty(param.shape).uniform_(-0.1, 0.1, generator=g))

    def apply_fully_shard(self, fsdp_config):
        from torch.distributed.fsdp import fully_shard

        for module in (self.model[0], self.model[2], self.model[4], self.gpt2.c_fc, self.gpt2.c_proj):
            fully_shard(module, **fsdp_config)
        fully_shard(self.model, **fsdp_config)
        fully_shard(self.gpt2, **fsdp_config)

    def configure_optimizers(self):
        self.optimizer = torch.optim.SGD([*self.model.parameters(), *self.gpt2.parameters()], lr=self.lr)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.model(x), y.expand(-1, 16)) + nn.functional.mse_loss(self.gpt2(x), y)
        self.backward(loss)
        self.step(self.optimizer)
        self.step_losses.append(loss.detach())
        return {"loss": loss}

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return {"loss": nn.functional.mse_loss(self.model(x), y.expand(-1, 16))}


def _run(root, device_parameters, batch_size):
    from dream_trainer.callbacks import Fp8QuantizationCallback

    fp8 = Fp8QuantizationCallback(display=False)
    config = TrainerConfig(root_dir=str(root), run_name="r", seed=2, device_parameters=device_parameters,
                           training_parameters=TrainingParameters(n_epochs=1, num_sanity_val_steps=0), callbacks=[fp8])
    trainer = Wide(config, in_features=64, batch_size=batch_size)
    trainer.fit()
    precomputed = [name for name, model in trainer.named_models().items() if any(model is m for m in fp8._precompute)]
    return {"losses": torch.stack(trainer.step_losses), "converted": fp8.converted, "float8": trainer.float8,
            "precomputed": precomputed}


def test_float8_fsdp2_matches_one_process(tmp_path):
    zero, one = spawn_world(2, _run, str(tmp_path / "two"), DeviceParameters.FSDP(dp_shard=2), 8, timeout=240)
    single = _run(tmp_path / "one", DeviceParameters.SINGLE_DEVICE(), 16)
    # the 128x16 head stays high precision; GPT-2's Conv1D layers are not nn.Linear
    assert zero["converted"] == single["converted"] == {"model": ["0", "2"], "gpt2": []}
    assert zero["float8"] == single["float8"] == {"model": "tensorwise"}  # gpt2 is not float8
    assert zero["precomputed"] == ["model"] and single["precomputed"] == []  # float8 all-gather: sharded float8 only
    # The mean over the two ranks' halves is the one process's loss on the whole batch, up to
    # float8 rounding: activations are scaled per rank (its half of the batch), not per batch.
    torch.testing.assert_close((zero["losses"] + one["losses"]) / 2, single["losses"], atol=2e-3, rtol=2e-2)

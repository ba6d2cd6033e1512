"""The device side of the step path, as far as a CPU shows it: batches are left where they are
on the CPU (no copy, no structure rebuilt), optimizers are made fused only for CUDA parameters
and only where the user chose nothing, the token loader pins only for a CUDA world, and
``DeviceParameters.fused_optimizers`` is checked. The CUDA side (side-stream copies, pinned
batches, fused AdamW, no sync between log steps) is the cuda lane's (tests/cuda)."""

import numpy as np
import pytest
import torch
from torch import nn

from dream_trainer import DeviceParameters, TrainerConfig, TrainingParameters
from dream_trainer.data import TokenLoader
from dream_trainer.data.tokens import write_tokens
from dream_trainer.testing import ToyTrainer
from dream_trainer.trainer.fused import prefer_fused
from dream_trainer.world.transfer import BatchTransfer


def test_on_the_cpu_batches_stay_as_they_are():
    transfer = BatchTransfer()
    batch = {"x": torch.ones(2, 3), "ids": [torch.arange(4), "text"]}
    assert transfer(batch) is batch  # before start: nothing to do
    transfer.start(torch.device("cpu"))
    assert transfer(batch) is batch and transfer.copies == 0 and transfer.pageable_bytes == 0


def test_a_trainer_moves_its_batches_through_its_worlds_transfer():
    config = TrainerConfig(device_parameters=DeviceParameters.SINGLE_DEVICE(),
                           training_parameters=TrainingParameters(n_epochs=1, num_sanity_val_steps=0))
    trainer = ToyTrainer(config)
    trainer.fit()
    assert trainer.world.transfer.device == torch.device("cpu") and trainer.world.transfer.copies == 0


def test_optimizers_of_cpu_parameters_are_left_as_built():
    """(A user's own choice of fused/foreach on CUDA is kept: the cuda lane checks it.)"""
    model = nn.Linear(4, 4)
    for opt in (torch.optim.AdamW(model.parameters()), torch.optim.SGD(model.parameters(), lr=0.1),
                torch.optim.RMSprop(model.parameters())):
        assert not prefer_fused(opt) and opt.param_groups[0].get("fused") in (None, False)
    trainer = ToyTrainer(TrainerConfig(device_parameters=DeviceParameters.SINGLE_DEVICE(),
                                       training_parameters=TrainingParameters(n_epochs=1, num_sanity_val_steps=0)))
    trainer.fit()
    assert trainer.optimizer.param_groups[0]["fused"] is None  # SGD on the CPU: torch's own default


def test_fused_optimizers_is_a_flag():
    assert DeviceParameters().fused_optimizers is True
    with pytest.raises(TypeError, match=r"DeviceParameters.fused_optimizers='no' is invalid: expected True or False"):
        DeviceParameters(fused_optimizers="no")


def test_the_token_loader_pins_only_for_a_cuda_world(tmp_path):
    path = tmp_path / "t.tokens"
    write_tokens(path, [np.arange(1000) % 200])

    class World:
        dp_rank, dp_size, device = 0, 1, torch.device("cpu")

    loader = TokenLoader(path, 8, 4, world=World())
    assert loader.pin_memory is False
    x, y = next(iter(loader))
    assert not x.is_pinned() and torch.equal(x[:, 1:], y[:, :-1])
    World.device = torch.device("cuda", 0)
    assert TokenLoader(path, 8, 4, world=World()).pin_memory is True  # (pinning itself needs a GPU: the cuda lane)
    assert TokenLoader(path, 8, 4, world=World(), pin_memory=False).pin_memory is False

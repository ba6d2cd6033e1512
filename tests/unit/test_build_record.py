"""`BuildRecord` on its own, and the world's seams for the run's files (a world that shares
the run: its own subdirectory and checkpoint interval), followed by the trainer and the
checkpoint callback without either writing the other's fields."""

import pytest
import torch
from torch import nn

from dream_trainer import (
    Callback,
    CheckpointCallback,
    CheckpointParameters,
    DeviceParameters,
    DistributedWorld,
    TrainerConfig,
    TrainingParameters,
    list_checkpoints,
)
from dream_trainer.testing import ToyTrainer
from dream_trainer.trainer.build_record import BuildRecord, CompiledModule


def test_compiled_regions_are_found_with_their_options():
    record = BuildRecord()
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    record.compile_options(model[0], {"backend": "eager"})
    model[0].compile(backend="eager")  # lazily: nothing is compiled until it is called
    model[2] = torch.compile(model[2], backend="eager")
    record.record_compiled({"net": model})
    assert record.compiled == {"net.0": CompiledModule(model[0], {"backend": "eager"}),
                               "net.2": CompiledModule(model[2]._orig_mod, None)}


def test_float8_and_compile_time_are_recorded_through_checked_methods():
    record = BuildRecord()
    assert record.total_compile_time_s is None  # nobody measured it
    record.record_float8("model", "rowwise")
    record.add_compile_time("model.0", 1.5)
    record.add_compile_time("model.0", 0.5)
    record.add_compile_time("model.1", 1.0)
    assert record.float8 == {"model": "rowwise"} and record.compile_time_s == {"model.0": 2.0, "model.1": 1.0}
    assert record.total_compile_time_s == 3.0
    with pytest.raises(ValueError, match="expected seconds >= 0"):
        record.add_compile_time("model.0", float("nan"))
    with pytest.raises(TypeError, match="model name and a recipe"):
        record.record_float8("model", None)


class SharedRunWorld(DistributedWorld):
    """A world that is one of several sharing a run (what a fault-tolerant replica group is)."""

    run_subdirectory = "member_3"
    checkpoint_interval = 2


class UseWorld(Callback):
    def pre_launch(self):
        self.trainer.set_world(SharedRunWorld(self.trainer.world.device_parameters))


def _config(tmp_path, every=None, explicit=True):
    checkpoint = CheckpointParameters(root_dir=str(tmp_path / "shared") if explicit else None, every_n_steps=every,
                                      keep_last=None, every_n_epochs=None, at_fit_end=False)
    return TrainerConfig(root_dir=str(tmp_path / "runs"), run_name="r", device_parameters=DeviceParameters.SINGLE_DEVICE(),
                         training_parameters=TrainingParameters(max_steps=7, num_sanity_val_steps=0),
                         callbacks=[UseWorld(), CheckpointCallback(checkpoint)])


@pytest.mark.parametrize("explicit", [True, False])
def test_the_run_directory_and_checkpoints_follow_the_world(tmp_path, explicit):
    trainer = ToyTrainer(_config(tmp_path, explicit=explicit))
    trainer.fit()
    checkpoint = trainer.callbacks["CheckpointCallback"]
    assert trainer.run_dir == tmp_path / "runs" / "default" / "r" / "member_3"
    expected_root = tmp_path / "shared" / "member_3" if explicit else trainer.run_dir / "checkpoints"
    assert checkpoint.root == expected_root and checkpoint.every_n_steps == 2
    assert [info.step for info in list_checkpoints(expected_root)] == [2, 4, 6]  # the world's interval
    assert checkpoint.params.every_n_steps is None  # its parameters were not rewritten


def test_a_checkpoint_schedule_that_contradicts_the_world_fails(tmp_path):
    with pytest.raises(ValueError, match="checkpoint_interval=2 but CheckpointParameters.every_n_steps=3"):
        ToyTrainer(_config(tmp_path, every=3)).fit()


def test_compile_module_compiles_torchs_own_modules_too():
    """``module.compile()`` compiles nothing for a module whose forward is torch's own
    (dynamo skips that top frame, without a word): the ToyTrainer's nn.Linear layers, a plain
    nn.Sequential. `compile_module` compiles them; each region captures its graph (the
    "eager" backend: no code generated)."""
    from torch._dynamo.utils import counters

    class Layers(ToyTrainer):  # what ToyTrainer.apply_compile does, with the eager backend
        def apply_compile(self):
            for i in (0, 2):
                self.compile_module(self.model[i], backend="eager")

    class Whole(ToyTrainer):
        def apply_compile(self):
            self.compile_module(self.model, backend="eager")  # the nn.Sequential itself

    for trainer_cls, regions in ((Layers, ["model.0", "model.2"]), (Whole, ["model"])):
        torch._dynamo.reset()
        counters.clear()
        trainer = trainer_cls(TrainerConfig(device_parameters=DeviceParameters.SINGLE_DEVICE(compile_model=True),
                                            training_parameters=TrainingParameters(n_epochs=1, num_sanity_val_steps=0)))
        trainer.fit()
        assert list(trainer.compiled_modules) == regions
        assert counters["stats"]["unique_graphs"] >= len(regions), dict(counters["stats"])  # was 0
    torch._dynamo.reset()

"""The trainer as components: a small instance dictionary, a state dict composed of its
components' states, and components that round-trip their own state through it."""

from __future__ import annotations

from dream_trainer import DeviceParameters, DreamTrainer, TrainerConfig, TrainingParameters
from dream_trainer.testing import ToyTrainer
from dream_trainer.trainer.data_position import DataPosition
from dream_trainer.trainer.model_facts import ModelFacts
from dream_trainer.trainer.step_path import StepPath

STATE = {  # what a bare DreamTrainer holds, and why
    "config", "world", "callbacks",  # configuration and the two collaborators
    "global_step", "current_epoch", "local_batches", "_last_val_step",  # counters
    "status", "stop_reason", "resumed", "run_name", "seed",  # the run
    "is_accumulating_gradients", "is_last_batch", "validating", "sanity_checking",  # loop flags callbacks read
    "control", "metric_log", "stepper", "data_position", "model_facts", "build", "state", "goodput",  # components
    "pipeline_runtime", "context_parallel",  # DreamTrainer's parallelism: pipeline stages, sequence sharding
}


def test_a_bare_trainer_holds_counters_flags_config_world_callbacks_and_components(tmp_path):
    trainer = DreamTrainer(TrainerConfig(root_dir=str(tmp_path), device_parameters=DeviceParameters.SINGLE_DEVICE()))
    assert set(vars(trainer)) == STATE
    assert len(STATE) <= 26
    assert isinstance(trainer.step_path, StepPath) and trainer.step_stats is trainer.step_path.stats
    assert isinstance(trainer.data_position, DataPosition) and isinstance(trainer.model_facts, ModelFacts)
    assert trainer.training_parameters is trainer.config.training_parameters


def test_the_state_dict_is_the_composition_of_the_components_states(tmp_path):
    trainer = ToyTrainer(TrainerConfig(
        root_dir=str(tmp_path), device_parameters=DeviceParameters.SINGLE_DEVICE(),
        training_parameters=TrainingParameters(n_epochs=1, train_steps_per_epoch=3, num_sanity_val_steps=0)))
    trainer.fit()
    trainer.step_path.skipped_steps, trainer.step_path.skipped_batches = 2, 1  # as if vetoes had happened
    state = trainer.state_dict()
    assert set(state) == {"trainer", "models", "optimizers", "schedulers", "callbacks", "ranks", "goodput"}
    counters = state["trainer"]
    assert {k: counters[k] for k in trainer.step_path.state_dict()} == trainer.step_path.state_dict()
    assert counters["epoch_complete"] is trainer.data_position.epoch_complete is False  # fit() moved to epoch 1
    # Optimizer state by parameter name (DCP's flattened form: param_groups.<name>.lr), for
    # checkpoints and heals alike.
    optimizer = state["optimizers"]["optimizer"]
    named = {k.removeprefix("param_groups.").rsplit(".", 1)[0] for k in optimizer if k.startswith("param_groups.")}
    assert named == {n for n, _ in trainer.model.named_parameters()}

    other = ToyTrainer(trainer.config)
    other.load_state_dict(state)
    assert other.step_path.state_dict() == {"skipped_steps": 2, "skipped_batches": 1}
    assert (other.global_step, other.current_epoch, other.local_batches) == (3, 1, 0)
    trainer.data_position.epoch_complete = True  # saved after an epoch's last hooks: the resume starts the next
    other.load_state_dict(trainer.state_dict())
    assert (other.current_epoch, other.local_batches) == (2, 0)


def test_a_plug_in_replaces_a_model_through_the_trainer_s_seam(tmp_path):
    """A conversion that returns a new module puts it in place with `replace_model`
    (float8 does), which refuses an unknown name or a non-module."""
    import pytest
    import torch

    trainer = DreamTrainer(TrainerConfig(root_dir=str(tmp_path), device_parameters=DeviceParameters.SINGLE_DEVICE()))
    trainer.model = torch.nn.Linear(2, 2)
    new = torch.nn.Sequential(torch.nn.Linear(2, 2))
    trainer.replace_model("model", new)
    assert trainer.model is new and trainer.named_models() == {"model": new}
    with pytest.raises(KeyError, match="no model named 'head'"):
        trainer.replace_model("head", new)
    with pytest.raises(TypeError, match="takes an nn.Module"):
        trainer.replace_model("model", "not a module")


def test_the_trainer_is_one_chain_without_mixins_and_its_package_has_no_type_ignore():
    from pathlib import Path

    import dream_trainer.trainer

    assert [k.__name__ for k in DreamTrainer.__mro__] == ["DreamTrainer", "BaseTrainer", "AbstractTrainer", "ABC", "object"]
    root = Path(dream_trainer.trainer.__file__).parent
    ignores = [f"{path.name}:{number}" for path in sorted(root.glob("*.py"))
               for number, line in enumerate(path.read_text().splitlines(), 1) if "type: ignore" in line]
    assert not ignores, ignores  # a protocol or a component replaces each

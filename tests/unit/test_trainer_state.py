"""`TrainerState`: the trainer's state is a registry of torch ``Stateful`` parts, a
checkpoint load enters it once, and a checkpoint holding optimizer state in DCP's grouped
form is refused, then migrated offline and resumed exactly."""

import inspect
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.stateful import Stateful

from dream_trainer import CheckpointCallback, CheckpointError, DeviceParameters, TrainerConfig, TrainingParameters
from dream_trainer.checkpoint import META_FILE, grouped_optimizer_state, list_checkpoints
from dream_trainer.testing import ToyTrainer
from dream_trainer.trainer.data_position import DataPosition
from dream_trainer.trainer.state import (
    CallbacksState,
    DataPositionState,
    ModelsState,
    OptimizersState,
    Progress,
    RankState,
    SchedulersState,
    TrainerState,
)
from dream_trainer.trainer.goodput import GoodputLedger
from tests.unit.test_checkpoint import Counter, losses, run


def _trainer(tmp_path):
    return ToyTrainer(TrainerConfig(
        root_dir=str(tmp_path), device_parameters=DeviceParameters.SINGLE_DEVICE(),
        training_parameters=TrainingParameters(n_epochs=1, train_steps_per_epoch=5, num_sanity_val_steps=0)))


def test_the_trainer_state_is_a_registry_of_torch_statefuls(tmp_path):
    trainer = _trainer(tmp_path)
    state = trainer.state
    assert isinstance(state, TrainerState) and isinstance(state, Stateful)
    assert list(state.parts) == ["trainer", "models", "optimizers", "schedulers", "callbacks", "ranks", "goodput"]
    kinds = (Progress, ModelsState, OptimizersState, SchedulersState, CallbacksState, RankState, GoodputLedger)
    assert [type(part) for part in state.parts.values()] == list(kinds)
    assert all(isinstance(part, Stateful) for part in state.parts.values())
    assert isinstance(state.data, Stateful) and isinstance(state.data, DataPositionState)
    trainer.fit()
    composed = trainer.state_dict()
    # Each part gives its own key of the state dict (the ranks part: this rank's entry).
    assert set(composed["models"]) == set(state.models.state_dict()) == {"model"}
    assert composed["trainer"]["global_step"] == state.progress.state_dict()["global_step"] == 5
    assert list(composed["ranks"]) == list(state.ranks.state_dict()) == [state.ranks.key] == ["rank0"]


def test_the_data_position_is_a_stateful_whose_state_dict_takes_no_arguments(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.fit()
    data = trainer.state.data
    assert list(inspect.signature(data.state_dict).parameters) == []
    assert not hasattr(DataPosition, "state_dict")  # its own methods take the loader: not a Stateful's
    position = data.state_dict()  # the trainer's loader and counters: a plain DataLoader, its epoch done
    assert set(position) == {"epoch_start", "generators"} and position["epoch_start"] is None
    trainer.local_batches = 3  # batches of an unfinished epoch consumed: its start is saved
    trainer.data_position.epoch_complete = False
    assert data.state_dict()["epoch_start"] is not None


def test_a_checkpoint_load_enters_the_trainer_state_once(monkeypatch):
    _, saver = run(max_steps=5, callbacks=[Counter()])
    calls: dict[str, int] = {}

    def counted(cls, name):
        method = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            calls[f"{cls.__name__}.{name}"] = calls.get(f"{cls.__name__}.{name}", 0) + 1
            return method(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, wrapper)

    for cls in (TrainerState, Progress, ModelsState, OptimizersState, SchedulersState, CallbacksState, RankState):
        counted(cls, "load_state_dict")
    counted(TrainerState, "state_dict")
    counted(CallbacksState, "_take")
    load = CheckpointCallback.load
    during: dict[str, int] = {}

    def measured(self, path):  # what the load alone asks of the trainer's state
        calls.clear()
        load(self, path)
        during.update(calls)

    monkeypatch.setattr(CheckpointCallback, "load", measured)
    counter = Counter()
    trainer, loader = run(max_steps=6, callbacks=[counter])
    assert loader.resumed_from == saver.saved[-1] and trainer.global_step == 6 and counter.count == 6
    # The template (its state) and the restore, nothing else: each callback asked once.
    assert during == {"TrainerState.state_dict": 1, "CallbacksState._take": 1,
                     **{f"{cls.__name__}.load_state_dict": 1 for cls in (TrainerState, Progress, ModelsState,
                        OptimizersState, SchedulersState, CallbacksState, RankState)}}


# ------------------------------------------------------------------ grouped optimizer state
def _with_adam(self):
    self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-2)  # state per parameter: moments, steps


def _regroup(trainer, path: Path) -> None:
    """Rewrite the checkpoint at `path` as dream_trainer saved it before optimizer state was
    keyed per parameter name: everything as it is, the optimizer state in DCP's grouped form
    (``param_groups.0.params``), made by torch's helpers from the checkpoint's own state."""
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from dream_trainer.checkpoint import _dcp_load, match_template

    state = match_template(path, trainer.state_dict(), strict=True)
    _dcp_load(state, path)
    set_optimizer_state_dict(trainer.model, trainer.optimizer, state["optimizers"]["optimizer"],
                             options=StateDictOptions(flatten_optimizer_state_dict=True))
    state["optimizers"]["optimizer"] = get_optimizer_state_dict(
        trainer.model, trainer.optimizer, options=StateDictOptions(flatten_optimizer_state_dict=False))
    meta = (path / META_FILE).read_text()
    shutil.rmtree(path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    (path / META_FILE).write_text(meta)


def test_a_grouped_checkpoint_is_refused_then_migrated_offline_and_resumes_exactly(monkeypatch):
    monkeypatch.setattr(ToyTrainer, "configure_optimizers", _with_adam)
    full, _ = run(root_dir="full", every_n_steps=5)
    first, saver = run(max_steps=7, every_n_steps=5)
    path = saver.saved[-1]
    _regroup(first, path)
    assert grouped_optimizer_state(path) == ["optimizer"]
    expected = rf"optimizer\(s\) 'optimizer' grouped by param group.*python -m dream_trainer\.migrate {re.escape(str(path))}"
    with pytest.raises(CheckpointError, match=expected):
        run(every_n_steps=5)  # refused before anything is loaded

    done = subprocess.run([sys.executable, "-m", "dream_trainer.migrate", "ckpt"], capture_output=True, text=True,
                          timeout=120)  # no --trust: nothing is unpickled
    assert done.returncode == 0, done.stderr
    assert f"{path}: migrated: optimizer state keyed per parameter name" in done.stdout
    assert f"{saver.saved[0]}: already in format 2" in done.stdout  # step 5: flattened already
    assert grouped_optimizer_state(path) == [] and path.with_name(f"{path.name}.grouped").is_dir()
    assert [info.step for info in list_checkpoints("ckpt")] == [5, 7]  # the original is not listed
    assert json.loads((path / META_FILE).read_text())["step"] == 7

    second, loader = run(every_n_steps=5)
    assert loader.resumed_from == path
    assert losses(first) + losses(second) == losses(full)  # bitwise, step by step
    for a, b in zip(full.model.parameters(), second.model.parameters()):
        assert torch.equal(a, b)

"""Checkpoints cannot run code: crafted payloads in every place state is stored are refused
(and their command never runs), registered types round-trip, a dream_trainer 0.1
checkpoint is refused and then migrated once, and names read back stay inside the roots."""

import dataclasses
import enum
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dream_trainer import (
    Callback,
    CheckpointCallback,
    CheckpointError,
    CheckpointParameters,
    DeviceParameters,
    TrainerConfig,
    TrainingParameters,
    list_checkpoints,
)
from dream_trainer.checkpoint import META_FILE
from dream_trainer.serialization import UnsafeStateError, allow_types, check_storable, dumps, loads
from dream_trainer.testing import ToyTrainer
from tests.unit.test_checkpoint import Counter  # a callback with state

FIXTURE = Path(__file__).parent.parent / "fixtures" / "legacy_v0_1"
MARKER = "payload-ran"  # the directory a payload would create (relative: each test has its own cwd)


class Payload:
    """What an attacker stores: unpickling it calls os.mkdir(MARKER)."""

    def __reduce__(self):
        return (os.mkdir, (os.path.abspath(MARKER),))


def run(root="ckpt", max_steps=None, callbacks=(), resume_mode="last", every_n_steps=7):
    cb = CheckpointCallback(CheckpointParameters(root_dir=str(root), every_n_steps=every_n_steps, resume_mode=resume_mode))
    config = TrainerConfig(
        root_dir="runs", run_name="r", device_parameters=DeviceParameters.SINGLE_DEVICE(),
        training_parameters=TrainingParameters(n_epochs=2, max_steps=max_steps, val_every_n_steps=4, num_sanity_val_steps=1),
        callbacks=[*callbacks, cb],
    )
    trainer = ToyTrainer(config, shuffle=True, dropout=0.2, hidden=16)
    trainer.fit()
    return trainer, cb


# ------------------------------------------------------------------ the format itself
def test_loads_refuses_payloads_and_bare_pickles():
    assert loads(dumps({"a": [1, (2.5, "x")], "t": torch.ones(2), "b": b"\x00"}, "s"), "s")["a"] == [1, (2.5, "x")]
    buffer = io.BytesIO()
    torch.save({"state": Payload()}, buffer)  # what check_storable keeps our own saves from writing
    with pytest.raises(UnsafeStateError, match=r"the data position asks for posix\.mkdir.*nothing it names was executed"):
        loads(buffer.getvalue(), "the data position")
    with pytest.raises(UnsafeStateError, match=r"bare pickle.*never unpickled.*migrate"):
        loads(pickle.dumps({"state": Payload()}), "the data position")
    with pytest.raises(CheckpointError, match="damaged"):
        loads(b"PK\x03\x04 truncated", "the data position")
    assert not os.path.exists(MARKER)


def test_saving_what_could_not_be_loaded_fails_at_the_save():
    with pytest.raises(UnsafeStateError, match=r"callback state\['Bad'\]\['when'\] is a .*\.Phase.*allow_types\(Phase\)"):
        check_storable({"Bad": {"when": Phase.WARMUP}}, "callback state")
    import subprocess as sp

    with pytest.raises(ValueError, match=r"allow_types\(subprocess\.Popen\): classes from 'subprocess' are never allowed"):
        allow_types(sp.Popen)
    with pytest.raises(TypeError, match=r"expected a class, got builtin_function_or_method"):
        allow_types(os.system)


# ------------------------------------------------------------------ crafted checkpoints
def _craft(path: Path, key_prefix: str, callbacks=()) -> str:
    """Rewrite the checkpoint at `path` as an attacker would: the same keys, with the first
    non-tensor value under `key_prefix` replaced by a payload. Returns the key."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from dream_trainer.checkpoint import _dcp_load, match_template

    trainer, _ = run(root="scratch", max_steps=1, callbacks=callbacks)  # a template of the same run
    template = match_template(path, trainer.state_dict(), strict=True)
    _dcp_load(template, path)
    flat, _ = flatten_state_dict(template)
    key = next(k for k, v in flat.items() if k.startswith(key_prefix) and not isinstance(v, torch.Tensor))
    if isinstance(flat[key], bytes):  # our own bytes entries: a payload in their format
        buffer = io.BytesIO()
        torch.save(Payload(), buffer)
        flat[key] = buffer.getvalue()
    else:
        flat[key] = Payload()
    meta = json.loads((path / META_FILE).read_text())
    shutil.rmtree(path)
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(flat, checkpoint_id=str(path), no_dist=True)
    (path / META_FILE).write_text(json.dumps(meta))
    return key


@pytest.mark.parametrize("prefix", [
    "callbacks.Counter.",  # a callback's shared state
    "ranks.rank0.callbacks",  # per-rank callback state
    "ranks.rank0.data",  # per-rank data position
    "ranks.rank0.rng.",  # per-rank RNG state
    "optimizers.",  # optimizer state (hyperparameters are non-tensor values, as are schedulers' states)
    "trainer.callbacks",  # the list of saved callbacks
])
def test_a_crafted_checkpoint_is_refused_and_runs_nothing(prefix):
    _, saver = run(max_steps=7, callbacks=[Counter()])
    path = saver.saved[-1]
    key = _craft(path, prefix, callbacks=[Counter()])
    assert not os.path.exists(MARKER)  # crafting it ran nothing either
    with pytest.raises(UnsafeStateError, match=r"posix\.mkdir.*nothing it names was executed") as info:
        run(max_steps=10, callbacks=[Counter()], resume_mode=str(path))
    assert str(path) in str(info.value), key
    assert not os.path.exists(MARKER), f"the payload in {key} ran"


def test_crafted_dcp_metadata_is_refused():
    _, saver = run(max_steps=7)
    path = saver.saved[-1]
    (path / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(UnsafeStateError, match=r"\.metadata asks for posix\.mkdir"):
        run(max_steps=10, resume_mode=str(path))
    assert not os.path.exists(MARKER)


# ------------------------------------------------------------------ registered types
class Phase(enum.Enum):
    WARMUP = "warmup"
    STABLE = "stable"


@dataclasses.dataclass
class Window:
    start: int
    values: list


class Scheduled(Callback):
    """Keeps an enum and a dataclass in its state: allowed through safe_types."""

    safe_types = (Phase, Window)

    def __init__(self):
        self.phase, self.window = Phase.WARMUP, Window(0, [])

    def post_optimizer_step(self, model, optimizer):
        self.window.values.append(self.trainer.global_step)
        if len(self.window.values) >= 5:
            self.phase = Phase.STABLE

    def state_dict(self):
        return {"phase": self.phase, "window": self.window}

    def load_state_dict(self, state):
        self.phase, self.window = state["phase"], state["window"]


def test_registered_types_round_trip():
    first = Scheduled()
    _, saver = run(max_steps=7, callbacks=[first])
    assert first.phase is Phase.STABLE
    resumed = Scheduled()
    trainer, _ = run(max_steps=8, callbacks=[resumed], resume_mode=str(saver.saved[-1]))
    assert trainer.global_step == 8
    assert resumed.phase is Phase.STABLE and isinstance(resumed.window, Window)
    assert resumed.window.values == first.window.values + [7]


# ------------------------------------------------------------------ dream_trainer 0.1 checkpoints
def test_a_v0_1_checkpoint_is_refused_then_migrated_once_and_resumes_exactly():
    shutil.copytree(FIXTURE / "step_000000007", "old/step_000000007")
    reference = json.loads((FIXTURE / "reference.json").read_text())
    with pytest.raises(UnsafeStateError, match=r"written by dream_trainer 0\.1.*python -m dream_trainer\.migrate "
                                               r"old/step_000000007 --trust"):
        run(root="old", callbacks=[Counter()])
    cli = [sys.executable, "-m", "dream_trainer.migrate", "old"]
    refused = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "add --trust" in refused.stderr and not Path("old/step_000000007.v0_1").exists()
    done = subprocess.run([*cli, "--trust"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "old/step_000000007: migrated" in done.stdout
    assert Path("old/step_000000007.v0_1").is_dir()  # the original, kept (and not listed)
    assert [info.step for info in list_checkpoints("old")] == [7]
    counter = Counter()
    trainer, saver = run(root="old", callbacks=[counter])
    assert saver.resumed_from == Path("old/step_000000007")
    # The reference was computed on the machine that made the fixture: another CPU's kernels
    # sum in another order (a few ulp apart: 0.35426247 against 0.35426250 was seen), so it is
    # compared within float32 rounding. A wrong data position, RNG or optimizer state would
    # move them by far more than that.
    torch.testing.assert_close(torch.stack(trainer.step_losses).cpu(), torch.tensor(reference["losses"][7:]),
                               rtol=1e-5, atol=0.0)
    assert counter.count == reference["counter"]
    from safetensors.torch import load_file

    for name, value in load_file(str(FIXTURE / "final.safetensors")).items():
        torch.testing.assert_close(trainer.model.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)
    again = subprocess.run([*cli, "--trust"], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "already in format 2" in again.stdout


# ------------------------------------------------------------------ names read back
def test_checkpoints_read_back_stay_inside_the_root(tmp_path, caplog):
    _, saver = run(root="outside", max_steps=7)
    Path("ckpt").mkdir()
    os.symlink(Path("outside/step_000000007").resolve(), "ckpt/step_000000007")  # a link out of the root
    assert list_checkpoints("ckpt") == []
    assert "outside the checkpoint root" in caplog.text
    forged = Path("ckpt2/step_000000003")
    shutil.copytree(saver.saved[-1], forged)  # step 7's files under step 3's name
    assert list_checkpoints("ckpt2") == []
    assert "does not match the directory name" in caplog.text


def test_run_names_read_back_from_the_environment_are_checked(monkeypatch):
    from dream_trainer.run_identity import RunIdentity

    monkeypatch.setenv("DREAM_TRAINER_RUN_NAME", "../../etc")
    with pytest.raises(ValueError, match=r"\$DREAM_TRAINER_RUN_NAME='\.\./\.\./etc' is invalid"):
        RunIdentity.from_env()
    monkeypatch.setenv("DREAM_TRAINER_RUN_NAME", "ok")
    monkeypatch.setenv("DREAM_TRAINER_EXPERIMENT", "..")
    with pytest.raises(ValueError, match=r"\$DREAM_TRAINER_EXPERIMENT='\.\.' is invalid"):
        RunIdentity.from_env()

"""`RunRecordCallback` compares a resumed run's config with its record when the checkpoint
callback will resume, looking in exactly the roots that callback resumes from: under an
explicit checkpoint root, the world's own directory (`run_subdirectory`, a fault-tolerant
replica group's) and the roots of the worlds sharing the run (`resume_roots`)."""

from dataclasses import dataclass, field

import pytest

from dream_trainer import (
    Callback,
    CheckpointCallback,
    CheckpointError,
    CheckpointParameters,
    DeviceParameters,
    DistributedWorld,
    LoggingParameters,
    TrainerConfig,
    TrainingParameters,
)
from dream_trainer.callbacks import RunRecordCallback
from dream_trainer.config_files import FIXED_ON_RESUME
from dream_trainer.testing import ToyTrainer


@dataclass(kw_only=True)
class ShapedConfig(TrainerConfig):
    """A config with a field no resume may change.

    Attributes:
        width: the model's width (fixed on resume).
    """

    width: int = field(default=8, metadata=FIXED_ON_RESUME)


class ReplicaGroupWorld(Callback):
    """Supplies a world that is one of several sharing the run (as a fault-tolerant one)."""

    def __init__(self, peer_roots=None):
        self.peer_roots = peer_roots

    def pre_launch(self):
        world = DistributedWorld(DeviceParameters.SINGLE_DEVICE())
        world.run_subdirectory = "replica_group_0"
        if self.peer_roots is not None:
            peers = self.peer_roots
            world.resume_roots = lambda root: [root, *peers]
        self.trainer.set_world(world)


def _fit(tmp_path, ckpt_root, width, max_steps, peer_roots=None, saver_class=CheckpointCallback):
    saver = saver_class(CheckpointParameters(root_dir=str(ckpt_root), every_n_steps=2, every_n_epochs=None))
    record = RunRecordCallback(argv=[])
    config = ShapedConfig(
        width=width, run_name="r", root_dir=str(tmp_path / "runs"),
        training_parameters=TrainingParameters(max_steps=max_steps, n_epochs=None, num_sanity_val_steps=0),
        logging_parameters=LoggingParameters(log_every_n_steps=1000),
        device_parameters=DeviceParameters.SINGLE_DEVICE(),
        callbacks=[ReplicaGroupWorld(peer_roots), saver, record],
    )
    trainer = ToyTrainer(config)
    trainer.fit()
    return trainer, saver, record


def test_a_resume_under_an_explicit_root_and_a_run_subdirectory_is_checked(tmp_path):
    ckpt = tmp_path / "ckpt"
    trainer, saver, record = _fit(tmp_path, ckpt, width=8, max_steps=2)
    assert [p.parent for p in saver.saved] == [ckpt / "replica_group_0"]  # not directly under the root
    assert record.warnings == [] and (trainer.run_dir / "run.json").is_file()

    trainer, saver, record = _fit(tmp_path, ckpt, width=8, max_steps=4)
    assert saver.resumed_from == ckpt / "replica_group_0" / "step_000000002"
    assert any("max_steps: 2 -> 4" in warning for warning in record.warnings), record.warnings

    with pytest.raises(CheckpointError, match=r"width: 8 -> 16"):
        _fit(tmp_path, ckpt, width=16, max_steps=6)


def test_a_resume_from_a_peer_worlds_root_is_checked(tmp_path):
    """The only checkpoint is another replica group's (the world's `resume_roots` name it):
    the checkpoint callback resumes from it, so the record is compared."""
    peer = tmp_path / "peer"
    _fit(tmp_path, peer, width=8, max_steps=2)  # writes run.json and peer/replica_group_0/step_2
    trainer, saver, record = _fit(tmp_path, tmp_path / "own", width=8, max_steps=4,
                                  peer_roots=[peer / "replica_group_0"])
    assert saver.resumed_from == peer / "replica_group_0" / "step_000000002"
    assert any("max_steps: 2 -> 4" in warning for warning in record.warnings), record.warnings


@pytest.mark.parametrize("mode", ["last", "best", None])
def test_the_checkpoint_callback_says_where_it_resumes_from(tmp_path, mode):
    """`CheckpointCallback.resume_roots()`, what the run record checks, is where the
    callback resumes: under an explicit root the world's own directory, with "last" the
    peers' roots too (a resume from a peer's newer checkpoint: see above), with "best" its
    own root only, without a resume none."""
    ckpt, peer = tmp_path / "ckpt", tmp_path / "peer" / "replica_group_1"
    saver = CheckpointCallback(CheckpointParameters(root_dir=str(ckpt), resume_mode=mode, every_n_steps=2,
                                                    every_n_epochs=None, monitor="train/loss"))
    record = RunRecordCallback(argv=[])
    config = ShapedConfig(
        run_name="r", root_dir=str(tmp_path / "runs"),
        training_parameters=TrainingParameters(max_steps=2, n_epochs=None, num_sanity_val_steps=0),
        logging_parameters=LoggingParameters(log_every_n_steps=1000),
        device_parameters=DeviceParameters.SINGLE_DEVICE(),
        callbacks=[ReplicaGroupWorld([peer]), saver, record],
    )
    ToyTrainer(config).fit()
    own = ckpt / "replica_group_0"
    assert saver.root == own
    assert saver.resume_roots() == {"last": [own, peer], "best": [own], None: []}[mode]

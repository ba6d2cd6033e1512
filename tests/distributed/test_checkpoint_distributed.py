"""Checkpoints across processes: exact resume on 2 FSDP2 ranks, resharding 2 -> 1 and
1 -> 2 ranks, SIGTERM on one rank (both stop at the same step), and kill -9 during a save
(the previous checkpoint stays complete and resumable)."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

from dream_trainer import (
    Callback,
    CheckpointCallback,
    CheckpointParameters,
    DeviceParameters,
    TrainerConfig,
    TrainingParameters,
    list_checkpoints,
)
from dream_trainer.testing import ToyTrainer, spawn_world

ATOL, RTOL = 1e-5, 1e-4  # 1 vs 2 ranks: the same math in another reduction order


class SignalAt(Callback):
    """Sends SIGTERM to its own process before step `step` on rank `rank`."""

    def __init__(self, step, rank):
        self.step, self.rank = step, rank

    def pre_train_step(self, batch, batch_idx):
        if self.trainer.global_step == self.step and self.trainer.world.rank == self.rank:
            os.kill(os.getpid(), signal.SIGTERM)


def _fit(root, device_parameters, batch_size, max_steps=None, callbacks=(), every=4, resume="last"):
    checkpoint = CheckpointCallback(CheckpointParameters(root_dir=str(root), every_n_steps=every, resume_mode=resume))
    config = TrainerConfig(
        root_dir=str(root / "runs"),
        run_name="r",
        seed=3,
        device_parameters=device_parameters,
        training_parameters=TrainingParameters(n_epochs=2, max_steps=max_steps, num_sanity_val_steps=0, val_every_n_steps=5),
        callbacks=[*callbacks, checkpoint],
    )
    trainer = ToyTrainer(config, batch_size=batch_size, shuffle=True)
    trainer.fit()
    return {
        "losses": [x.item() for x in trainer.step_losses],
        "status": trainer.status,
        "step": trainer.global_step,
        "resumed_from": str(checkpoint.resumed_from),
        "saved": [p.name for p in checkpoint.saved],
    }


def _fsdp(root, max_steps=None, signal_at=None, resume="last"):
    callbacks = [SignalAt(*signal_at)] if signal_at else []
    return _fit(Path(root), DeviceParameters.FSDP(dp_shard=2), 8, max_steps, callbacks, resume=resume)


def _single(root, max_steps=None, resume="last"):
    return _fit(Path(root), DeviceParameters.SINGLE_DEVICE(), 16, max_steps, resume=resume)


def test_fsdp2_exact_resume_and_preemption_on_two_ranks(tmp_path):
    full = spawn_world(2, _fsdp, str(tmp_path / "full"))
    first = spawn_world(2, _fsdp, str(tmp_path / "cut"), 7)
    second = spawn_world(2, _fsdp, str(tmp_path / "cut"))
    for rank in range(2):
        assert second[rank]["resumed_from"].endswith("step_000000007")
        assert first[rank]["losses"] + second[rank]["losses"] == full[rank]["losses"]  # bitwise
    # SIGTERM reaches rank 1 only (before step 10). Step 10 validates (val_every_n_steps=5),
    # and the check after a validation run is blocking (the run already synchronized): both
    # ranks stop at step 10. (Between plain steps the check is non-blocking, one step late.)
    stopped = spawn_world(2, _fsdp, str(tmp_path / "sig"), None, (9, 1))
    assert [r["status"] for r in stopped] == ["preempted", "preempted"]
    assert stopped[0]["step"] == stopped[1]["step"] == 10 and stopped[0]["saved"][-1] == "step_000000010"
    resumed = spawn_world(2, _fsdp, str(tmp_path / "sig"))
    for rank in range(2):
        assert stopped[rank]["losses"] + resumed[rank]["losses"] == full[rank]["losses"]


def _close(a, b):
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=ATOL, rtol=RTOL)


def test_reshard_two_ranks_to_one_and_back(tmp_path):
    """A checkpoint of 2 FSDP2 ranks continues in 1 process (and the reverse) with the
    losses of an uninterrupted run on the same global batches."""
    full = _single(tmp_path / "full")
    two = spawn_world(2, _fsdp, str(tmp_path / "two"), 7)
    one = _single(tmp_path / "two")
    assert one["resumed_from"].endswith("step_000000007") and one["step"] == 24
    _close([(a + b) / 2 for a, b in zip(two[0]["losses"], two[1]["losses"])], full["losses"][:7])  # rank means
    _close(one["losses"], full["losses"][7:])

    _single(tmp_path / "one", 9)
    back = spawn_world(2, _fsdp, str(tmp_path / "one"))
    assert back[0]["resumed_from"].endswith("step_000000009")
    halves = [(a + b) / 2 for a, b in zip(back[0]["losses"], back[1]["losses"])]
    _close(halves, full["losses"][9:])


KILLED_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from torch.distributed.checkpoint import FileSystemWriter
    from dream_trainer import CheckpointCallback, CheckpointParameters, DeviceParameters, TrainerConfig, TrainingParameters
    from dream_trainer.testing import ToyTrainer

    root = Path(sys.argv[1])
    write = FileSystemWriter.write_data
    saves = []

    def slow_write(self, plan, planner):
        saves.append(1)
        if len(saves) == 2:  # the second save: part of the data written, then stuck
            (root / "in_second_save").touch()
            time.sleep(120)
        return write(self, plan, planner)

    FileSystemWriter.write_data = slow_write
    checkpoint = CheckpointCallback(CheckpointParameters(root_dir=str(root / "ckpt"), every_n_steps=3))
    config = TrainerConfig(root_dir=str(root / "runs"), run_name="r", device_parameters=DeviceParameters.SINGLE_DEVICE(),
                           training_parameters=TrainingParameters(n_epochs=2, num_sanity_val_steps=0), callbacks=[checkpoint])
    ToyTrainer(config, shuffle=True).fit()
    """
)


def test_kill_9_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SCRIPT, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "in_second_save").exists():
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "the child never reached its second save"
            time.sleep(0.05)
        proc.kill()  # SIGKILL mid-save: no handler, no cleanup
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    root = tmp_path / "ckpt"
    assert (root / ".staging-step_000000006").is_dir()
    assert [i.step for i in list_checkpoints(root)] == [3]  # the interrupted save is invisible

    checkpoint = CheckpointCallback(CheckpointParameters(root_dir=str(root), every_n_steps=3))
    config = TrainerConfig(root_dir=str(tmp_path / "runs"), run_name="r", device_parameters=DeviceParameters.SINGLE_DEVICE(),
                           training_parameters=TrainingParameters(n_epochs=2, num_sanity_val_steps=0), callbacks=[checkpoint])
    trainer = ToyTrainer(config, shuffle=True)
    trainer.fit()
    assert checkpoint.resumed_from == root / "step_000000003" and trainer.global_step == 24
    assert not (root / ".staging-step_000000006").exists()
    assert list_checkpoints(root)[-1].step == 24


def _resume_twice_logged(root):
    """`_fsdp` resuming (to step 8), with the warnings this rank logged; then, with each
    rank's own shard of every checkpoint damaged, the error of a second resume."""
    import logging

    from dream_trainer import CheckpointError

    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("dream_trainer").addHandler(handler)
    first = {**_fsdp(root, 8), "warnings": list(warnings)}
    for path in Path(root).glob("step_*"):  # this rank's own shard: no other rank writes it
        with open(path / f"__{os.environ['RANK']}_0.distcp", "r+b") as handle:
            handle.truncate(10)
    try:
        _fsdp(root, 9)
    except CheckpointError as exc:
        return first, str(exc)
    return first, None


def _flip_middle(file):
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x10
    file.write_bytes(bytes(data))


def test_two_ranks_agree_to_skip_a_checkpoint_only_one_rank_found_damaged(tmp_path):
    """The ranks share the checksums of a resume's verification: a byte flipped in rank 0's
    shard of the newest checkpoint is seen by rank 1 alone, and both ranks resume from the
    checkpoint before it. With none intact, both refuse, naming each; neither hangs."""
    import json

    from dream_trainer.checkpoint_manifest import checksum_share

    spawn_world(2, _fsdp, str(tmp_path), 7)  # checkpoints at steps 4 and 7
    newest, older = tmp_path / "step_000000007", tmp_path / "step_000000004"
    files = json.loads((newest / "manifest.json").read_text())["files"]
    assert [rank for rank in range(2) if "__0_0.distcp" in checksum_share(files, "all", rank, 2, 7)] == [1]
    _flip_middle(newest / "__0_0.distcp")  # the same size: only its checksum tells
    (first, refused), (first_1, refused_1) = spawn_world(2, _resume_twice_logged, str(tmp_path))
    for result in (first, first_1):
        assert result["resumed_from"] == str(older) and result["step"] == 8
    damaged = [w for w in first["warnings"] if "is damaged, not resuming from it" in w]
    assert len(damaged) == 1 and str(newest) in damaged[0]
    assert "__0_0.distcp: bytes changed: crc32" in damaged[0] and damaged[0].endswith("(found by rank 1)")
    assert not [w for w in first_1["warnings"] if "damaged" in w]  # said once, by rank 0
    for error in (refused, refused_1):  # every checkpoint damaged: both ranks refuse
        assert error is not None and "no intact checkpoint to resume from: all 3 checkpoint(s) are damaged" in error
        assert f"{newest}: __0_0.distcp: " in error, error
        assert re.search(rf"{older}: (.*; )?__1_0\.distcp: truncated", error), error

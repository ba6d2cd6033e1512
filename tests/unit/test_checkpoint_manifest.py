"""Crash-consistent checkpoints: the manifest of checksums written before the commit, its
verification on resume (damaged newest checkpoint: named, and the one before it resumed;
none intact: refused), kills at several points of a save, and the ``verify`` command."""

import json
import logging
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import pytest
import torch

from dream_trainer import (
    CheckpointCallback,
    CheckpointError,
    CheckpointParameters,
    DeviceParameters,
    TrainerConfig,
    TrainingParameters,
)
from dream_trainer.checkpoint_manifest import MANIFEST_FILE, PART_PREFIX, checksum_share, verify_checkpoint
from dream_trainer.testing import ToyTrainer

ROOT = Path("ckpt")


def run(max_steps=None, every_n_steps=3, **checkpoint):
    """A real trainer with a checkpoint callback; 24 steps in all (2 epochs of 12)."""
    checkpoint.setdefault("root_dir", str(ROOT))
    cb = CheckpointCallback(CheckpointParameters(every_n_steps=every_n_steps, **checkpoint))
    config = TrainerConfig(
        root_dir="runs", run_name="r", device_parameters=DeviceParameters.SINGLE_DEVICE(), callbacks=[cb],
        training_parameters=TrainingParameters(n_epochs=2, max_steps=max_steps, num_sanity_val_steps=0),
    )
    trainer = ToyTrainer(config, shuffle=True, dropout=0.2)
    trainer.fit()
    return trainer, cb


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints at steps 3, 6 and 7 of one run, and its final first-layer weight (step 7's)."""
    where = tmp_path_factory.mktemp("saved")
    cwd = os.getcwd()
    os.chdir(where)
    try:
        trainer, cb = run(max_steps=7)
    finally:
        os.chdir(cwd)
    assert [p.name for p in cb.saved] == ["step_000000003", "step_000000006", "step_000000007"]
    return where / ROOT, trainer.model[0].weight.detach().clone()


@pytest.fixture
def root(saved):
    shutil.copytree(saved[0], ROOT)
    return ROOT


def _shard(path):
    return next(path.glob("*.distcp"))


def _flip_inside(file, needle):
    """Flip one byte in the middle of `needle` (a tensor's bytes) inside `file`."""
    data = bytearray(file.read_bytes())
    at = data.find(needle)
    assert at >= 0 and data.find(needle, at + 1) < 0, "the tensor's bytes are not in the file once"
    data[at + len(needle) // 2] ^= 0x10
    file.write_bytes(bytes(data))


def test_the_manifest_lists_every_file_with_its_size_and_crc32(root):
    for path in sorted(root.iterdir()):
        manifest = json.loads((path / MANIFEST_FILE).read_text())
        files = {p.name for p in path.iterdir()} - {MANIFEST_FILE}
        assert set(manifest["files"]) == files == {".metadata", "dream_trainer.json", "__0_0.distcp"}
        for name, entry in manifest["files"].items():
            data = (path / name).read_bytes()
            assert entry == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
        assert not list(path.glob(f"{PART_PREFIX}*"))  # merged, then removed
        assert verify_checkpoint(path) == []


@pytest.mark.parametrize("async_mode", ["async", "async_pinned"])
def test_async_saves_hash_in_the_background_and_verify(async_mode):
    _, cb = run(max_steps=4, async_mode=async_mode)
    assert [p.name for p in cb.saved] == ["step_000000003", "step_000000004"]
    for path in cb.saved:
        assert verify_checkpoint(path) == [] and (path / MANIFEST_FILE).is_file()
    trainer, again = run(max_steps=6, async_mode=async_mode)
    assert again.resumed_from == cb.saved[-1] and trainer.global_step == 6


def test_flipped_tensor_bytes_fall_back_to_the_previous_checkpoint(root, saved, caplog):
    newest = root / "step_000000007"
    weight = saved[1]
    _flip_inside(_shard(newest), weight.numpy().tobytes())
    problems = verify_checkpoint(newest)
    assert len(problems) == 1 and problems[0].startswith("__0_0.distcp: bytes changed: crc32 ")
    with caplog.at_level(logging.WARNING):
        trainer, cb = run(max_steps=9)
    assert cb.resumed_from == root / "step_000000006" and trainer.global_step == 9
    assert f"checkpoint {newest} is damaged, not resuming from it: __0_0.distcp: bytes changed" in caplog.text
    assert f"resuming from {root / 'step_000000006'}, the next intact checkpoint" in caplog.text
    # The damage is inside tensor data: without verification it loads without a word.
    trainer, cb = run(max_steps=7, root_dir="elsewhere", resume_mode=str(newest), verify="off")
    loaded = trainer.model[0].weight.detach()
    assert cb.resumed_from == newest and loaded.shape == weight.shape and not torch.equal(loaded, weight)
    assert (loaded != weight).sum() == 1


def _truncate(path):
    shard = _shard(path)
    with open(shard, "r+b") as handle:
        handle.truncate(shard.stat().st_size // 2)


def _garble_metadata(path):
    (path / ".metadata").write_bytes(b"not a pickle")


def _drop_metadata(path):
    (path / ".metadata").unlink()


def _flip_metadata(path):
    data = bytearray((path / ".metadata").read_bytes())
    data[len(data) // 2] ^= 0x01
    (path / ".metadata").write_bytes(bytes(data))


def _unsafe_metadata(path):
    (path / ".metadata").write_bytes(pickle.dumps(os.getpid))  # a restricted unpickler refuses it


def _garble_meta_json(path):
    (path / "dream_trainer.json").write_text('{"step": 5, "epoch": 0}')


@pytest.mark.parametrize("damage, why", [
    (_truncate, r"__0_0\.distcp: truncated: \d+ bytes, the manifest says \d+"),
    (_garble_metadata, r"\.metadata: truncated: 12 bytes, the manifest says \d+; \.metadata: unreadable \(Unpickling"),
    (_drop_metadata, r"\.metadata: missing"),
    (_unsafe_metadata, r"\.metadata: refused: .*posix\.getpid.*; \.metadata: truncated: \d+ bytes, the manifest"),
    (_flip_metadata, r"\.metadata: bytes changed: crc32 \w{8}, the manifest says \w{8}"),
    (_garble_meta_json, r"dream_trainer\.json: truncated: \d+ bytes, the manifest says \d+"),
])
def test_a_damaged_newest_checkpoint_is_named_and_the_previous_one_resumed(root, damage, why, caplog):
    newest = root / "step_000000007"
    damage(newest)
    with caplog.at_level(logging.WARNING):
        trainer, cb = run()
    assert cb.resumed_from == root / "step_000000006" and trainer.global_step == 24
    warnings = [r.getMessage() for r in caplog.records if "is damaged, not resuming from it" in r.getMessage()]
    assert len(warnings) == 1 and str(newest) in warnings[0], caplog.text
    assert re.search(why, warnings[0]), warnings[0]


def test_a_metadata_written_to_run_code_is_refused_not_skipped(root):
    """Damage is skipped; a ``.metadata`` the manifest vouches for that asks to run code was
    written so (crafted, manifest and all): the resume is refused, nothing is run."""
    from dream_trainer import UnsafeStateError
    from dream_trainer.checkpoint_manifest import write_manifest

    newest = root / "step_000000007"
    _unsafe_metadata(newest)
    (newest / MANIFEST_FILE).unlink()
    write_manifest(newest)
    with pytest.raises(UnsafeStateError, match=rf"checkpoint {newest}: .*posix\.getpid"):
        run()


def test_no_intact_checkpoint_refuses_naming_each(root):
    for path in sorted(root.iterdir()):
        _truncate(path)
    with pytest.raises(CheckpointError, match=r"no intact checkpoint to resume from: all 3 checkpoint\(s\) are damaged") as error:
        run()
    for path in sorted(root.iterdir()):
        assert f"{path}: __0_0.distcp: truncated" in str(error.value)
    # A checkpoint named by path is not replaced by another: its damage is the error.
    with pytest.raises(CheckpointError, match=rf"cannot load checkpoint {root / 'step_000000003'}: it is damaged: "
                                              r"__0_0\.distcp: truncated: \d+ bytes, the manifest says \d+"):
        run(resume_mode=str(root / "step_000000003"))


def test_a_checkpoint_without_manifest_loads_with_one_warning(root, caplog):
    newest = root / "step_000000007"
    (newest / MANIFEST_FILE).unlink()  # as saved before checksums were kept
    with caplog.at_level(logging.WARNING):
        _, cb = run(max_steps=8, every_n_steps=None, every_n_epochs=None, at_fit_end=False)
        _, again = run(max_steps=8, every_n_steps=None, every_n_epochs=None, at_fit_end=False)
    assert cb.resumed_from == again.resumed_from == newest
    assert caplog.text.count(f"checkpoint {newest} has no {MANIFEST_FILE}") == 1  # once, not per resume
    _truncate(newest)  # its structure is still checked: .metadata names more bytes than there are
    assert verify_checkpoint(newest)[0].startswith("__0_0.distcp: truncated: ")


def test_sampled_checks_every_size_and_a_share_of_the_checksums(root, saved):
    names = [".metadata", "dream_trainer.json"] + [f"__{r}_0.distcp" for r in range(20)]
    shares = [checksum_share(names, "sampled", rank, 3, seed=7) for rank in range(3)]
    union = set().union(*shares)
    assert sum(map(len, shares)) == len(union)  # each file hashed by one rank
    assert {".metadata", "dream_trainer.json"} <= union and len(union - {".metadata", "dream_trainer.json"}) == 3
    assert union == set().union(*(checksum_share(names, "sampled", r, 3, seed=7) for r in range(3)))  # same on every rank
    assert set().union(*(checksum_share(names, "all", r, 3, seed=7) for r in range(3))) == set(names)
    newest = root / "step_000000007"
    _flip_inside(_shard(newest), saved[1].numpy().tobytes())
    # one data file: it is always the sampled one
    assert verify_checkpoint(newest, "sampled")[0].startswith("__0_0.distcp: bytes changed")
    _truncate(newest)
    assert verify_checkpoint(newest, "sampled")[0].startswith("__0_0.distcp: truncated")
    assert verify_checkpoint(newest, "off") == []
    with pytest.raises(ValueError, match=r"verify='some' is invalid: expected one of 'all', 'sampled', 'off'"):
        verify_checkpoint(newest, "some")
    with pytest.raises(ValueError, match=r"CheckpointParameters\.verify='some' is invalid"):
        CheckpointParameters(verify="some")


def test_the_verify_command_exit_codes(root, capsys):
    from dream_trainer.checkpoint_manifest import main

    assert main(["verify", str(root)]) == 0
    out = capsys.readouterr().out
    assert out.count("OK ") == 3 and "DAMAGED" not in out
    assert main(["verify", str(root / "step_000000007"), "--sampled"]) == 0
    assert capsys.readouterr().out.startswith(f"OK      {root / 'step_000000007'} (crc32 sampled)")
    for args in [["verify"], ["check", str(root)], ["verify", "nowhere"], ["verify", "runs"], ["verify", "-x", "ckpt"]]:
        assert main(args) == 2, args
        assert "usage: python -m dream_trainer.checkpoint verify" in capsys.readouterr().err, args
    _truncate(root / "step_000000006")
    # the module's entry point, as a user runs it
    bad = subprocess.run([sys.executable, "-m", "dream_trainer.checkpoint", "verify", str(root)], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 1, bad.stderr
    assert f"DAMAGED {root / 'step_000000006'}\n  __0_0.distcp: truncated" in bad.stdout
    assert bad.stdout.count("OK ") == 2


KILLED = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import dream_trainer.checkpoint as checkpoint
    from dream_trainer import CheckpointCallback, CheckpointParameters, DeviceParameters, TrainerConfig, TrainingParameters
    from dream_trainer.testing import ToyTrainer

    where, point = Path(sys.argv[1]), sys.argv[2]
    where.mkdir(parents=True)
    write_manifest, commits = checkpoint.write_manifest, []

    def stop_here():  # the parent sees the marker and kills this process
        (where / "stopped").touch()
        time.sleep(120)

    def manifest(staging):
        commits.append(staging)
        if len(commits) == 2 and point == "before_manifest":
            stop_here()
        written = write_manifest(staging)
        if len(commits) == 2 and point == "before_rename":
            stop_here()
        return written

    checkpoint.write_manifest = manifest
    cb = CheckpointCallback(CheckpointParameters(root_dir=str(where / "ckpt"), every_n_steps=3))
    config = TrainerConfig(root_dir=str(where / "runs"), run_name="r", device_parameters=DeviceParameters.SINGLE_DEVICE(),
                           training_parameters=TrainingParameters(n_epochs=2, num_sanity_val_steps=0), callbacks=[cb])
    ToyTrainer(config, shuffle=True, dropout=0.2).fit()
    """
)


POINTS = {
    "before_manifest": 3,  # every rank's shards and .metadata written, the manifest not yet
    "before_rename": 3,  # the manifest written and synced, not yet committed
}


def test_a_kill_at_each_point_of_a_save_resumes_from_the_last_complete_checkpoint(tmp_path):
    """A child trainer stops at a point of its second save (step 6) and is killed there
    (SIGKILL: no handler, no cleanup); a new run resumes from the last committed one. (A kill
    after the rename leaves a committed checkpoint, which the other tests damage.)"""
    logs = {point: open(tmp_path / f"{point}.log", "wb") for point in POINTS}  # a pipe could fill and block it
    procs = {point: subprocess.Popen([sys.executable, "-c", KILLED, str(tmp_path / point), point], stdout=logs[point],
                                     stderr=subprocess.STDOUT) for point in POINTS}
    try:
        deadline = time.monotonic() + 150
        for point, proc in procs.items():  # they run at once
            while not (tmp_path / point / "stopped").exists():
                assert proc.poll() is None, (tmp_path / f"{point}.log").read_text()
                assert time.monotonic() < deadline, f"the child never reached {point} of its second save"
                time.sleep(0.05)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
    finally:
        for point, proc in procs.items():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=60)
            logs[point].close()
    for point, resumes_from in POINTS.items():
        root = tmp_path / point / "ckpt"
        staging = root / ".staging-step_000000006"
        assert staging.is_dir() and (staging / ".metadata").is_file(), point
        assert (staging / MANIFEST_FILE).is_file() == (point == "before_rename")
        if point == "before_rename":
            assert verify_checkpoint(staging) == []  # complete, but never committed: not listed
        trainer, cb = run(root_dir=str(root))
        assert cb.resumed_from == root / f"step_{resumes_from:09d}" and trainer.global_step == 24, point
        assert not staging.exists()

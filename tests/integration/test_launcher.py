"""The self-spawning launcher (``entrypoint`` with ``--nproc 2``) as a user runs it: a
SIGTERM to the launcher preempts both ranks, which checkpoint and exit 75 — and so does the
launcher, without killing the slower rank while it is still finishing; a failed rank makes
the launcher exit with its status, promptly. The statuses hold however the script is
written: with ``raise SystemExit(entrypoint(main).exit_code)``, with a bare
``entrypoint(main)``, and with a ``main`` that catches the failure and returns nothing."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from dream_trainer import (Callback, CheckpointCallback, CheckpointParameters, DeviceParameters,
                               TrainerConfig, TrainingParameters, entrypoint)
    from dream_trainer.testing import ToyTrainer

    ROOT = Path(sys.argv[1])
    MODE = sys.argv[2]
    STYLE = sys.argv[3]  # how the script ends: "wrapped", "bare" or "swallow"

    class Script(Callback):
        def post_train_step(self, result, batch_idx):
            rank, step = self.trainer.world.rank, self.trainer.global_step
            if step == 1:
                (ROOT / f"pid{rank}").write_text(str(os.getpid()))
            if rank == 0 and step == 2:
                (ROOT / "started").write_text("")
            if MODE == "fail" and rank == 1 and step == 3:
                raise RuntimeError("rank 1 broke")
            time.sleep(0.05)  # slow enough for the test to signal mid-run

        def on_teardown(self, status):
            if self.trainer.world.rank == 0:  # rank 1 exits 75 first; rank 0 must not be killed
                time.sleep(2.0)
                (ROOT / f"rank0_{status}").write_text("")

    def main():
        saver = CheckpointCallback(CheckpointParameters(root_dir=str(ROOT / "ckpt"), every_n_epochs=None,
                                                        at_fit_end=False))
        config = TrainerConfig(root_dir=str(ROOT / "runs"), run_name="r", device_parameters=DeviceParameters.DDP(),
                               training_parameters=TrainingParameters(n_epochs=50, num_sanity_val_steps=0),
                               callbacks=[Script(), saver])
        trainer = ToyTrainer(config, batch_size=8)
        if STYLE == "swallow":
            try:
                trainer.fit()
            except RuntimeError as exc:
                print("main caught:", exc)
            return None
        trainer.fit()
        return trainer

    if __name__ == "__main__":
        if STYLE == "wrapped":
            raise SystemExit(entrypoint(main).exit_code)
        entrypoint(main)
    """
)


def _launch(tmp_path, mode, style="wrapped"):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, str(script), str(tmp_path), mode, style, "--nproc", "2"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finish(proc, timeout, ranks_grace=0.0):
    try:
        return proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        _end_ranks(Path(proc.args[2]), ranks_grace)


def _end_ranks(root, grace):
    """The ranks run in sessions of their own: end any that is still alive (by the pid it wrote)."""
    deadline = time.monotonic() + grace
    for pid_file in root.glob("pid*"):
        pid = int(pid_file.read_text())
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
            time.sleep(0.05)
        try:
            if "train.py" in Path(f"/proc/{pid}/cmdline").read_text():
                os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError):
            pass  # already gone


def _launch_and_wait(tmp_path, style="wrapped"):
    """Launch in "preempt" mode and wait until rank 0 has trained 2 steps."""
    proc = _launch(tmp_path, "preempt", style)
    deadline = time.monotonic() + 120
    while not (tmp_path / "started").exists():
        assert proc.poll() is None and time.monotonic() < deadline, _finish(proc, 10)[-3000:]
        time.sleep(0.05)
    return proc


@pytest.mark.parametrize("style", ["wrapped", "bare"])
def test_sigterm_to_the_launcher_preempts_every_rank_and_exits_75(tmp_path, style):
    proc = _launch_and_wait(tmp_path, style)
    os.kill(proc.pid, signal.SIGTERM)  # the launcher only: it forwards to the ranks
    out = _finish(proc, 120)
    assert proc.returncode == 75, out[-3000:]
    assert (tmp_path / "rank0_preempted").exists(), out[-3000:]  # not killed while rank 1 had exited
    checkpoints = [p.name for p in (tmp_path / "ckpt").iterdir()]
    assert len(checkpoints) == 1 and checkpoints[0].startswith("step_"), checkpoints
    assert out.count("preempted at step") == 2, out[-3000:]


def test_ranks_of_a_killed_launcher_checkpoint_and_end(tmp_path):
    proc = _launch_and_wait(tmp_path)
    proc.kill()  # SIGKILL: the launcher cannot forward anything; the ranks get SIGTERM from the kernel
    _finish(proc, 30, ranks_grace=60)  # the ranks end by themselves (else: killed, and the test fails)
    assert (tmp_path / "rank0_preempted").exists(), "the orphaned ranks did not end as preempted"
    assert [p.name.startswith("step_") for p in (tmp_path / "ckpt").iterdir()] == [True]


@pytest.mark.parametrize("style", ["wrapped", "bare", "swallow"])
def test_a_failed_rank_fails_the_launcher_promptly(tmp_path, style):
    proc = _launch(tmp_path, "fail", style)
    out = _finish(proc, 120)  # bounded: rank 0's own collective timeout is 300 s
    assert proc.returncode == 1, out[-3000:]
    assert "rank 1 broke" in out and "rank 1 exited with status 1" in out, out[-3000:]
    # Rank 0 failed by itself (released by rank 1's abort), well before its collective
    # timeout, and was not ended by the launcher's SIGTERM/SIGKILL: it wrote its status.
    assert (tmp_path / "rank0_failed").exists(), out[-3000:]
    if style == "swallow":
        assert out.count("main caught:") == 2, out[-3000:]

"""Requeue and restart rules (issue 39): a preempted SLURM job is requeued only on the requeue
signal (SIGUSR1 by default; SIGTERM, what ``scancel`` sends, stops and saves without one),
only after progress since its start and at most ``max_requeues`` times; a requeued or
restarted job that finds no checkpoint where its earlier attempt committed one fails, naming
the root and the host; a one-node SLURM job checkpointing to a node-local root is warned.
The rank-dependent decisions are taken on rank 0 and are the same on every rank: checked on
2 gloo ranks (``--nproc 2`` on 127.0.0.1) with the condition on one rank only."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dream_trainer import (
    Callback,
    CheckpointCallback,
    CheckpointError,
    CheckpointParameters,
    DeviceParameters,
    TrainerConfig,
    TrainingParameters,
)
from dream_trainer.exits import Preemption
from dream_trainer.launch import LaunchExit, RequeuePolicy, entrypoint
from dream_trainer.restarts import RESUME_RECORD, node_local_reason, warn_if_node_local
from dream_trainer.testing import ToyTrainer

TIMEOUT_S = 180


def _stub_scontrol(monkeypatch, tmp_path: Path) -> Path:
    """A ``scontrol`` on PATH that records its arguments; the process is in SLURM job 4242."""
    bin_dir, log = tmp_path / "bin", tmp_path / "scontrol.log"
    bin_dir.mkdir()
    stub = bin_dir / "scontrol"
    stub.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    return log


class SignalAt(Callback):
    """Sends this process `signum` after optimizer step `step` (0: in ``pre_fit``, before any)."""

    def __init__(self, signum: int, step: int):
        self.signum, self.step = signum, step

    def pre_fit(self):
        if self.step == 0:
            os.kill(os.getpid(), self.signum)

    def post_train_step(self, result, batch_idx):
        if self.trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


def _trainer(tmp_path: Path, *callbacks, max_steps: int = 20, **checkpoint) -> ToyTrainer:
    saver = CheckpointCallback(CheckpointParameters(root_dir=str(tmp_path / "ckpt"), every_n_epochs=None, **checkpoint))
    training = TrainingParameters(n_epochs=50, max_steps=max_steps, num_sanity_val_steps=0)
    config = TrainerConfig(root_dir=str(tmp_path / "runs"), run_name="r", training_parameters=training,
                           device_parameters=DeviceParameters.SINGLE_DEVICE(), callbacks=[*callbacks, saver])
    return ToyTrainer(config, batch_size=8)


def _fit_under_entrypoint(trainer: ToyTrainer, **requeue) -> int:
    def main():
        trainer.fit()
        return trainer

    with pytest.raises(LaunchExit) as exit_:
        entrypoint(main, argv=[], requeue=True, **requeue)
    return exit_.value.code


# ---------------------------------------------------------------------- item 2: when to requeue
def test_sigterm_stops_and_saves_without_requeue_and_the_requeue_signal_requeues(monkeypatch, tmp_path, caplog):
    log = _stub_scontrol(monkeypatch, tmp_path)
    caplog.set_level(logging.WARNING)
    assert _fit_under_entrypoint(_trainer(tmp_path / "a", SignalAt(signal.SIGTERM, 2))) == 75  # still preempted
    assert list((tmp_path / "a" / "ckpt").glob("step_*")), "the preemption saved"
    assert not log.exists(), "scancel's SIGTERM must not requeue"
    assert "not requeued: it was stopped by SIGTERM, not by the requeue signal SIGUSR1" in caplog.text

    assert _fit_under_entrypoint(_trainer(tmp_path / "b", SignalAt(signal.SIGUSR1, 2))) == 75
    assert log.read_text().split() == ["requeue", "4242"]


def test_the_requeue_signal_is_configurable(monkeypatch, tmp_path):
    log = _stub_scontrol(monkeypatch, tmp_path)
    monkeypatch.setenv("DREAM_TRAINER_REQUEUE_SIGNAL", "TERM")  # e.g. ranks under torchrun: --signal=TERM@90
    assert _fit_under_entrypoint(_trainer(tmp_path, SignalAt(signal.SIGTERM, 2))) == 75
    assert log.read_text().split() == ["requeue", "4242"]
    assert RequeuePolicy.resolve("usr2").signal == signal.SIGUSR2 == RequeuePolicy.resolve(int(signal.SIGUSR2)).signal
    with pytest.raises(ValueError, match="requeue signal .*'SIGHUP'.* expected one of the stop signals"):
        RequeuePolicy.resolve("SIGHUP")  # not a stop signal: the run would never stop on it
    with pytest.raises(ValueError, match="max_requeues .*'-1'.* expected an integer >= 0"):
        RequeuePolicy.resolve(max_requeues="-1")  # type: ignore[arg-type]


def test_a_run_signalled_before_its_first_step_since_its_start_is_not_requeued(monkeypatch, tmp_path, caplog):
    log = _stub_scontrol(monkeypatch, tmp_path)
    _trainer(tmp_path, max_steps=3).fit()  # the earlier attempt: 3 steps, checkpointed at the end
    caplog.set_level(logging.WARNING)
    resumed = _trainer(tmp_path, SignalAt(signal.SIGUSR1, 0), max_steps=6)
    assert _fit_under_entrypoint(resumed) == 75
    assert resumed.resumed and resumed.global_step == 3  # resumed, then stopped before a step of its own
    assert not log.exists()
    assert "not requeued: no optimizer step completed since this start" in caplog.text


def test_max_requeues_is_read_against_slurm_restart_count(monkeypatch, tmp_path, caplog):
    log = _stub_scontrol(monkeypatch, tmp_path)
    caplog.set_level(logging.WARNING)
    _trainer(tmp_path, max_steps=2).fit()  # the earlier attempts' progress
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")  # this is the job's third start
    assert _fit_under_entrypoint(_trainer(tmp_path, SignalAt(signal.SIGUSR1, 4)), max_requeues=2) == 75
    assert not log.exists()
    assert "not requeued: the job was already requeued 2 time(s) (SLURM_RESTART_COUNT), max_requeues=2" in caplog.text
    monkeypatch.setenv("DREAM_TRAINER_MAX_REQUEUES", "3")  # the same cap from the environment
    assert _fit_under_entrypoint(_trainer(tmp_path, SignalAt(signal.SIGUSR1, 6))) == 75
    assert log.read_text().split() == ["requeue", "4242"]


def test_the_requeue_rules_are_a_local_function_of_what_rank_0_holds():
    policy = RequeuePolicy(max_requeues=1)
    usr1, term = int(signal.SIGUSR1), int(signal.SIGTERM)
    assert policy.refusal(Preemption(usr1, progressed=True), requeues=0) is None
    assert "SIGTERM" in policy.refusal(Preemption(term, progressed=True), requeues=0)
    assert "no optimizer step" in policy.refusal(Preemption(usr1, progressed=False), requeues=0)
    assert "max_requeues=1" in policy.refusal(Preemption(usr1, progressed=True), requeues=1)
    assert "unknown" in policy.refusal(None, requeues=0)


# ---------------------------------------------------------------------- item 3: a restart without its checkpoints
@pytest.mark.parametrize("variable", ["SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"])
def test_a_restarted_job_that_finds_no_checkpoint_fails_naming_the_root_and_the_host(monkeypatch, tmp_path, variable):
    monkeypatch.setenv(variable, "1")  # the run directory went with the checkpoints: only the job knows
    with pytest.raises(CheckpointError) as error:
        _trainer(tmp_path).fit()
    message = str(error.value)
    assert str(tmp_path / "ckpt") in message and f"host {socket.gethostname()}" in message
    assert f"{variable}=1" in message and "allow_fresh_restart=True" in message
    assert not list((tmp_path / "ckpt").glob("step_*"))  # failed before any step

    trainer = _trainer(tmp_path, max_steps=2, allow_fresh_restart=True)  # the opt-out: from step 0
    trainer.fit()
    assert trainer.status == "completed" and not trainer.resumed


def test_the_run_record_names_where_the_earlier_attempt_committed(monkeypatch, tmp_path, caplog):
    _trainer(tmp_path, max_steps=3).fit()
    record = json.loads((tmp_path / "runs" / "default" / "r" / RESUME_RECORD).read_text())
    assert record["checkpoint_root"] == str(tmp_path / "ckpt") and record["step"] == 3
    assert record["host"] == socket.gethostname()
    for path in (tmp_path / "ckpt").iterdir():  # the root is there, its checkpoints are not (another node)
        shutil.rmtree(path)
    with pytest.raises(CheckpointError, match=r"committed the checkpoint of step 3 under .*ckpt on host"):
        _trainer(tmp_path).fit()  # no restart variable: the run record alone says so

    caplog.set_level(logging.WARNING)
    trainer = _trainer(tmp_path, max_steps=2, allow_fresh_restart=True)
    trainer.fit()
    assert trainer.global_step == 2 and "allow_fresh_restart=True: starting from step 0" in caplog.text


def test_a_restart_whose_earlier_attempt_committed_nothing_starts_fresh(monkeypatch, tmp_path):
    class Crash(Callback):
        def post_train_step(self, result, batch_idx):
            raise RuntimeError("crashed before the first checkpoint")

    with pytest.raises(RuntimeError, match="crashed"):
        _trainer(tmp_path, Crash()).fit()
    assert json.loads((tmp_path / "runs" / "default" / "r" / RESUME_RECORD).read_text())["step"] is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the run directory survived: it says nothing was lost
    trainer = _trainer(tmp_path, max_steps=2)
    trainer.fit()
    assert trainer.status == "completed" and not trainer.resumed
    trainer = _trainer(tmp_path, max_steps=4)  # and a restart with its checkpoint resumes as ever
    trainer.fit()
    assert trainer.resumed and trainer.global_step == 4


def test_a_one_node_slurm_job_with_a_node_local_checkpoint_root_is_warned_once(monkeypatch, tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "job-tmp"))
    assert node_local_reason("/dev/shm/ckpt") == "it is under /dev/shm"
    assert node_local_reason(tmp_path / "job-tmp" / "ckpt").startswith("it is under $TMPDIR")
    assert node_local_reason("/shared/project/ckpt") is None
    assert not warn_if_node_local("/tmp/x", num_nodes=1)  # not a SLURM job: a laptop's /tmp is fine
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert not warn_if_node_local("/tmp/x", num_nodes=2)  # several nodes: check_shared_root's business
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    _trainer(tmp_path, max_steps=1).fit()
    _trainer(tmp_path, max_steps=2).fit()
    warned = [r for r in caplog.records if "looks node-local" in r.getMessage()]
    assert len(warned) == 1 and str(tmp_path / "ckpt") in warned[0].getMessage()


# ---------------------------------------------------------------------- 2 gloo ranks
SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from dream_trainer import (Callback, CheckpointCallback, CheckpointError, CheckpointParameters,
                               DeviceParameters, TrainerConfig, TrainingParameters, entrypoint)
    from dream_trainer.testing import ToyTrainer

    ROOT, MODE = Path(sys.argv[1]), sys.argv[2]
    RANK = int(os.environ["RANK"]) if "RANK" in os.environ else None

    class Signal(Callback):
        def post_train_step(self, result, batch_idx):
            if MODE.startswith("signal-") and self.trainer.world.rank == 1 and self.trainer.global_step == 2:
                os.kill(os.getpid(), getattr(signal, MODE.split("-")[1]))  # rank 1 only

    def main():
        if MODE == f"restart-on-{RANK}":  # the job's restart count, seen by one rank only
            os.environ["SLURM_RESTART_COUNT"] = "1"
        saver = CheckpointCallback(CheckpointParameters(root_dir=str(ROOT / "ckpt"), every_n_epochs=None))
        config = TrainerConfig(root_dir=str(ROOT / "runs"), run_name="r", device_parameters=DeviceParameters.DDP(),
                               training_parameters=TrainingParameters(n_epochs=50, max_steps=6, num_sanity_val_steps=0),
                               callbacks=[Signal(), saver])
        trainer = ToyTrainer(config, batch_size=8)
        try:
            trainer.fit()
        except CheckpointError as exc:
            print(f"rank {RANK} raised CheckpointError: {exc}", flush=True)
            raise
        print(f"rank {RANK} status {trainer.status}", flush=True)
        return trainer

    if __name__ == "__main__":
        entrypoint(main, requeue=True)
    """
)


def _two_ranks(tmp_path: Path, mode: str) -> tuple[int, str, Path]:
    run = tmp_path / mode
    run.mkdir()
    (run / "train.py").write_text(SCRIPT)
    log = _stub(run)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DREAM_TRAINER_", "SLURM_", "TORCHELASTIC_"))}
    env.update(PYTHONUNBUFFERED="1", PATH=f"{run / 'bin'}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_ID="4242")
    proc = subprocess.Popen([sys.executable, str(run / "train.py"), str(run), mode, "--nproc", "2"], cwd=run, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out = proc.communicate(timeout=TIMEOUT_S)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks (one session)
        proc.communicate()
        pytest.fail(f"{mode}: the 2-rank run timed out")
    return proc.returncode, out, log


def _stub(run: Path) -> Path:
    (run / "bin").mkdir()
    stub, log = run / "bin" / "scontrol", run / "scontrol.log"
    stub.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    return log


def test_two_ranks_requeue_on_the_agreed_signal_only_and_from_rank_0_once(tmp_path):
    code, out, log = _two_ranks(tmp_path, "signal-SIGUSR1")  # the warning reaches rank 1 only
    assert code == 75, out[-3000:]
    assert log.read_text().split() == ["requeue", "4242"], out[-3000:]  # rank 0 knew the agreed signal
    code, out, log = _two_ranks(tmp_path, "signal-SIGTERM")  # scancel's signal, on rank 1 only
    assert code == 75, out[-3000:]
    assert not log.exists() and "not requeued: it was stopped by SIGTERM" in out, out[-3000:]
    assert out.count("status preempted") == 2  # both ranks saved and stopped at the same step


def test_two_ranks_agree_on_a_missing_checkpoint_whichever_rank_sees_the_restart(tmp_path):
    code, out, _ = _two_ranks(tmp_path, "restart-on-0")  # rank 0 decides: every rank fails with its error
    assert code == 1, out[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} raised CheckpointError: no checkpoint to resume from under" in out, out[-3000:]
    assert f"host {socket.gethostname()}" in out
    code, out, _ = _two_ranks(tmp_path, "restart-on-1")  # rank 1's view alone changes nothing, on any rank
    assert code == 0, out[-3000:]
    assert out.count("status completed") == 2 and "CheckpointError" not in out

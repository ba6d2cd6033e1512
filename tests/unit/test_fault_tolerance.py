"""Fault tolerance in one process: settings and their errors, an unreachable lighthouse, the
hostname trap, the lighthouse CLI, and one replica group training with a real lighthouse
and torchft Manager (committed steps, vetoes, skipped batches, the Manager's state in
checkpoints). The multi-group runs are in tests/integration/test_fault_tolerance.py."""

from __future__ import annotations

import copy
import importlib.util
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import (
    Callback,
    CheckpointCallback,
    CheckpointParameters,
    DeviceParameters,
    FaultToleranceCallback,
    FaultToleranceError,
    FaultToleranceParameters,
    LoggingParameters,
    SkipBatch,
    TrainerConfig,
    TrainingParameters,
)
from dream_trainer.ft import FaultTolerantSampler, Lighthouse, step_units
from dream_trainer.launch import free_port
from dream_trainer.testing import ToyTrainer
from dream_trainer.testing.toy import toy_data
from dream_trainer.world.fault_tolerant import check_lighthouse, resolve_hostname

needs_torchft = pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="torchft is not installed")


# --------------------------------------------------------------------- settings
@pytest.mark.parametrize("bad, message", [
    ({"lighthouse": "127.0.0.1:29510"}, r"lighthouse='127.0.0.1:29510' is invalid: expected 'http://host:port'"),
    ({"replica_group_id": -1}, r"replica_group_id=-1 is invalid: expected an int >= 0"),
    ({"min_replica_size": 0}, r"min_replica_size=0 is invalid"),
    ({"checkpoint_interval": 0}, r"checkpoint_interval=0 is invalid"),
    ({"max_failures": -1}, r"max_failures=-1 is invalid"),
    ({"heartbeat_interval": float("nan")}, r"heartbeat_interval=nan is invalid"),
    ({"hostname": " "}, r"hostname=' ' is invalid"),
    ({"init_sync": "yes"}, r"init_sync='yes' is invalid: expected True or False"),
])
def test_bad_parameters_are_named(bad, message):
    with pytest.raises((ValueError, TypeError), match=message):
        FaultToleranceParameters(**bad)


def test_the_step_units_never_straddle_two_data_epochs():
    assert step_units(0, 2, 10) == 0 and step_units(8, 2, 10) == 8
    assert step_units(9, 2, 10) == 10  # units 9 and 10 are in two epochs: start the next one
    assert step_units(9, 1, 10) == 9 and step_units(27, 4, 10) == 30


# --------------------------------------------------------------------- the hostname trap
def test_an_unresolvable_hostname_is_an_error_or_loopback(monkeypatch):
    with pytest.raises(FaultToleranceError, match=r"hostname='no-such-host.invalid' does not resolve"):
        resolve_hostname("no-such-host.invalid", "http://127.0.0.1:29510")
    assert resolve_hostname("127.0.0.1", "http://10.0.0.1:29510") == "127.0.0.1"
    # This machine's own name not in DNS (what torchft would advertise by default):
    monkeypatch.setattr(socket, "gethostname", lambda: "unresolvable-host.invalid")
    assert resolve_hostname(None, "http://127.0.0.1:29510") == "127.0.0.1"  # every group is on this machine
    with pytest.raises(FaultToleranceError, match=r"'unresolvable-host.invalid' does not resolve.*hostname="):
        resolve_hostname(None, "http://192.0.2.1:29510")


# --------------------------------------------------------------------- an unreachable lighthouse
class Configured(Callback):
    def __init__(self):
        self.configured = False

    def pre_configure(self):
        self.configured = True


def _config(lighthouse, *callbacks, root="runs", **training):
    params = dict(n_epochs=None, max_steps=12, num_sanity_val_steps=0)
    params.update(training)
    ft = FaultToleranceParameters(lighthouse=lighthouse, replica_group_id=0, connect_timeout_s=3.0, timeout_s=10.0)
    return TrainerConfig(run_name="ft", root_dir=str(root), device_parameters=DeviceParameters.DDP(),
                         logging_parameters=LoggingParameters(log_every_n_steps=1),
                         training_parameters=TrainingParameters(**params),
                         callbacks=[FaultToleranceCallback(ft), *callbacks])


def test_an_unreachable_lighthouse_fails_at_once(tmp_path):
    probe = Configured()
    trainer = ToyTrainer(_config(f"http://127.0.0.1:{free_port()}", probe, root=tmp_path))  # nothing listens there
    started = time.monotonic()
    with pytest.raises(FaultToleranceError, match=r"lighthouse at http://127.0.0.1:\d+ is unreachable.*dream_trainer.ft"):
        trainer.fit()
    assert time.monotonic() - started < 3.0 and trainer.status == "failed" and not probe.configured
    with pytest.raises(FaultToleranceError, match="unreachable"):  # a name that does not resolve
        check_lighthouse("http://no-such-host.invalid:29510", 2.0)


def test_no_lighthouse_and_no_group_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    monkeypatch.delenv("REPLICA_GROUP_ID", raising=False)
    config = TrainerConfig(training_parameters=TrainingParameters(n_epochs=None, max_steps=3),
                           callbacks=[FaultToleranceCallback(FaultToleranceParameters(replica_group_id=0))])
    with pytest.raises(FaultToleranceError, match="no lighthouse"):
        ToyTrainer(config).fit()
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:1")
    config = TrainerConfig(training_parameters=TrainingParameters(n_epochs=None, max_steps=3),
                           callbacks=[FaultToleranceCallback()])
    with pytest.raises(FaultToleranceError, match="no replica group id"):
        ToyTrainer(config).fit()


@pytest.mark.parametrize("training, message", [
    ({"max_steps": None, "n_epochs": 1}, "needs TrainingParameters\\(max_steps=...\\)"),
    ({"train_steps_per_epoch": 4}, "train_steps_per_epoch=4 cannot be used with FaultToleranceCallback"),
])
def test_step_based_runs_only(tmp_path, training, message):
    with pytest.raises(ValueError, match=message):
        ToyTrainer(_config("http://127.0.0.1:1", root=tmp_path, **training)).fit()


# --------------------------------------------------------------------- the lighthouse CLI
@needs_torchft
def test_the_lighthouse_command_serves_until_sigterm():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dream_trainer.ft", "lighthouse", "--bind", f"127.0.0.1:{port}"],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}" in line
        check_lighthouse(f"http://127.0.0.1:{port}", 5.0)  # it answers
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------- one group, a real lighthouse
class FTToy(ToyTrainer):
    """ToyTrainer on a FaultTolerantSampler (sample indices recorded per step)."""

    def __init__(self, config, micro_batches=1, workers=0, **kwargs):
        super().__init__(config, **kwargs)
        self.micro_batches, self.workers, self.seen = micro_batches, workers, []

    def configure_dataloaders(self):
        x, y = toy_data(self.n_samples, self.in_features)
        data = TensorDataset(x, y, torch.arange(self.n_samples))
        sampler = FaultTolerantSampler(data, self.batch_size, self.world, micro_batches=self.micro_batches)
        return DataLoader(data, batch_sampler=sampler, num_workers=self.workers), None

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.seen.append(index.tolist())
        return super().training_step((x, y), batch_idx)


@pytest.fixture
def lighthouse():
    with Lighthouse(bind="127.0.0.1:0", heartbeat_timeout_ms=1000, join_timeout_ms=100) as server:
        yield server


def _events(trainer):
    import json

    return [json.loads(line) for line in (trainer.run_dir / "fault_tolerance.jsonl").read_text().splitlines()]


@needs_torchft
def test_one_group_commits_every_step_and_checkpoints_the_manager(tmp_path, lighthouse):
    checkpoint = CheckpointCallback(CheckpointParameters(every_n_epochs=None))
    trainer = FTToy(_config(lighthouse.address, checkpoint, root=tmp_path, gradient_accumulation_steps=2),
                    micro_batches=2, n_samples=64, batch_size=4)
    trainer.fit()
    ft = trainer.callbacks["FaultToleranceCallback"]
    assert trainer.status == "completed" and trainer.global_step == 12 and ft.uncommitted == 0
    assert trainer.run_dir.name == "replica_group_0" and checkpoint.saved[-1].name == "step_000000012"
    assert [e["participants"] for e in _events(trainer) if e["event"] == "step"] == [1] * 12
    # 12 steps x 2 micro-batches x 4 samples from 64 samples (units of 8): each data epoch
    # is a permutation, so the first 8 steps see every sample once.
    assert sorted(i for batch in trainer.seen[:16] for i in batch) == list(range(64))
    # Resumed from that checkpoint, the Manager counts from 12 (its state was saved), and
    # the data goes on where it stopped (the sampler's position was saved).
    resumed = FTToy(_config(lighthouse.address, CheckpointCallback(CheckpointParameters(every_n_epochs=None)),
                            root=tmp_path, gradient_accumulation_steps=2, max_steps=14),
                    micro_batches=2, n_samples=64, batch_size=4)
    resumed.fit()
    quorums = [e for e in _events(resumed) if e["event"] == "quorum"]
    assert resumed.global_step == 14 and quorums[-1]["step"] == 12
    uninterrupted = FTToy(_config(lighthouse.address, root=tmp_path / "straight", gradient_accumulation_steps=2,
                                  max_steps=14), micro_batches=2, n_samples=64, batch_size=4)
    uninterrupted.fit()
    assert resumed.seen == uninterrupted.seen[24:]
    assert all(torch.equal(a, b) for a, b in zip(resumed.model.parameters(), uninterrupted.model.parameters()))


class VetoAndSkip(Callback):
    """Vetoes the 4th optimizer step once, and skips the batch of the 7th once."""

    vetoes_steps = skips_batches = True

    def __init__(self):
        self.vetoed = self.skipped = False

    def pre_optimizer_step(self, model, optimizer):
        if self.trainer.global_step == 3 and not self.vetoed:
            self.vetoed = True
            return False
        return None

    def pre_train_step(self, batch, batch_idx):
        if self.trainer.global_step == 6 and not self.skipped:
            self.skipped = True
            raise SkipBatch("skip one")


@needs_torchft
def test_a_veto_is_not_committed_and_a_skipped_batch_releases_the_step(tmp_path, lighthouse):
    trainer = FTToy(_config(lighthouse.address, VetoAndSkip(), root=tmp_path), n_samples=64, batch_size=4)
    trainer.fit()
    assert trainer.status == "completed" and trainer.global_step == 12
    assert trainer.skipped_steps == 2 and trainer.skipped_batches == 1
    failed = [e for e in _events(trainer) if e["event"] == "not_committed"]
    assert [(e["step"], e["reason"]) for e in failed] == [
        (3, "vetoed by VetoAndSkip"), (6, "the step ended without an optimizer step")]
    # The vetoed step is retried on the same data (not committed: the units did not move).
    assert trainer.seen[3] == trainer.seen[4]


@needs_torchft
def test_sampler_settings_are_checked(tmp_path, lighthouse):
    with pytest.raises(ValueError, match=r"micro_batches=1\) but TrainingParameters.gradient_accumulation_steps=2"):
        FTToy(_config(lighthouse.address, root=tmp_path, gradient_accumulation_steps=2), n_samples=64).fit()
    with pytest.raises(ValueError, match=r"needs DataLoader\(num_workers=0\)"):
        FTToy(_config(lighthouse.address, root=tmp_path), workers=1, n_samples=64).fit()
    with pytest.raises(ValueError, match=r"64 samples are fewer than one unit"):
        FTToy(_config(lighthouse.address, root=tmp_path), n_samples=64, batch_size=128).fit()


# --------------------------------------------------------------------- what a heal sends
class AdamToy(ToyTrainer):
    def configure_optimizers(self):
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.01)


class Capture(Callback):
    """Saves the trainer's state (native optimizer form) at the end of step `at`; or loads
    `state` in pre_fit (what a heal does between steps, here before the first)."""

    def __init__(self, at=None, state=None):
        self.at, self.state = at, state

    def pre_fit(self):
        if self.state is not None:
            self.trainer.load_state_dict(self.state, live=True)

    def post_train_step(self, result, batch_idx):
        if self.trainer.global_step == self.at and not self.trainer.is_accumulating_gradients:
            self.state = copy.deepcopy(self.trainer.state_dict(native_optimizers=True))  # it holds live tensors


def test_native_optimizer_state_continues_exactly(tmp_path):
    def config(*callbacks, steps=10):
        return TrainerConfig(run_name="n", root_dir=str(tmp_path), device_parameters=DeviceParameters.SINGLE_DEVICE(),
                             training_parameters=TrainingParameters(n_epochs=None, max_steps=steps,
                                                                    num_sanity_val_steps=0), callbacks=list(callbacks))

    capture = Capture(at=6)
    straight = AdamToy(config(capture))
    straight.fit()
    assert isinstance(next(iter(capture.state["optimizers"]["optimizer"]["state"])), int)  # by index, not by name
    healed = AdamToy(config(Capture(state=capture.state)))  # a fresh optimizer: no state at all
    healed.fit()
    assert healed.global_step == 10 and healed.optimizer.state_dict()["state"][0]["step"] == 10  # no extra init step
    assert all(torch.equal(a, b) for a, b in zip(straight.model.parameters(), healed.model.parameters()))

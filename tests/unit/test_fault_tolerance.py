"""Fault tolerance in one process: settings and their errors, an unreachable lighthouse, the
hostname trap and where the servers listen, the heartbeat interval against the lighthouse's
timeout, the lighthouse CLI, the run's history read from its files (never from outside the
run's directory), and one replica group training with a real
lighthouse and torchft Manager (committed steps, vetoes, skipped batches, the Manager's
state in checkpoints, the gradient all-reduce started during backward). The multi-group
runs are in tests/integration/test_fault_tolerance.py."""

from __future__ import annotations

import copy
import importlib.util
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

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
from dream_trainer.fault_tolerance import (
    FaultTolerantSampler,
    Lighthouse,
    check_progress,
    confined,
    group_roots,
    run_history,
    step_units,
)
from dream_trainer.launch import free_port
from dream_trainer.testing import ToyTrainer
from dream_trainer.testing.toy import toy_data
from dream_trainer.fault_tolerance.addresses import check_heartbeat, check_lighthouse, resolve_hostname
from dream_trainer.fault_tolerance.world import FaultTolerantWorld

needs_torchft = pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="torchft is not installed")


# --------------------------------------------------------------------- settings
@pytest.mark.parametrize("bad, message", [
    ({"lighthouse": "127.0.0.1:29510"}, r"lighthouse='127.0.0.1:29510' is invalid: expected 'http://host:port'"),
    ({"replica_group_id": -1}, r"replica_group_id=-1 is invalid: expected an int >= 0"),
    ({"min_replica_size": 0}, r"min_replica_size=0 is invalid"),
    ({"start_groups": 0}, r"start_groups=0 is invalid"),
    ({"checkpoint_interval": 0}, r"checkpoint_interval=0 is invalid"),
    ({"max_failures": -1}, r"max_failures=-1 is invalid"),
    ({"heartbeat_interval": float("nan")}, r"heartbeat_interval=nan is invalid"),
    ({"lighthouse_heartbeat_timeout_s": 0}, r"lighthouse_heartbeat_timeout_s=0 is invalid"),
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
    # A name that resolves: loopback all the same when the lighthouse is (nothing needs to
    # be reachable from elsewhere); the name when the lighthouse is on another machine.
    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")
    assert resolve_hostname(None, "http://127.0.0.1:29510") == "127.0.0.1"
    assert resolve_hostname(None, "http://192.0.2.1:29510") == "localhost"


@needs_torchft
def test_the_servers_listen_where_the_group_is_reached(monkeypatch):
    """(bind, advertised): the hostname's address; a name that resolves to loopback here
    while the lighthouse is elsewhere (127.0.1.1 in /etc/hosts): this machine's address on
    the route to the lighthouse, advertised too. An address the heal server cannot listen on
    is an error naming it and the setting to fix."""
    from dream_trainer.fault_tolerance import transport as ft_transport
    from dream_trainer.fault_tolerance.transport import HealTransport, bound_store, listen_address

    assert listen_address("127.0.0.1", "127.0.0.1") == ("127.0.0.1", "127.0.0.1")
    assert listen_address("localhost", "localhost")[0] in ("127.0.0.1", "::1")
    assert listen_address("::1", "::1") == ("::1", "::1")
    monkeypatch.setattr(ft_transport, "_route_to", lambda host: "192.0.2.7")
    assert listen_address("localhost", "10.0.0.1") == ("192.0.2.7", "192.0.2.7")
    assert listen_address("192.0.2.8", "10.0.0.1") == ("192.0.2.8", "192.0.2.8")  # an address of its own: kept
    with pytest.raises(FaultToleranceError, match=r"the heal server cannot listen on 192.0.2.8 \(the address of this "
                                                  r"group's hostname 'node-a'\).*FaultToleranceParameters\(hostname="):
        HealTransport(timedelta(seconds=5), host="192.0.2.8", advertised="node-a")
    with pytest.raises(FaultToleranceError, match=r"the group's store cannot listen on 192.0.2.8"):
        bound_store("192.0.2.8", "node-a")


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
    with pytest.raises(FaultToleranceError, match=r"lighthouse at http://127.0.0.1:\d+ is unreachable.*dream_trainer.fault_tolerance"):
        trainer.fit()
    # Before any model is built, and long before torchft's quorum timeout (120 s) would
    # have ended the wait (a bound, not a timing: it holds on a busy machine).
    assert time.monotonic() - started < 60 and trainer.status == "failed" and not probe.configured
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


# --------------------------------------------------------------------- heartbeats
@needs_torchft
def test_the_heartbeat_interval_is_checked_against_the_lighthouse(tmp_path):
    """A heartbeat interval longer than half the lighthouse's heartbeat timeout fails before
    anything is built, naming both values and what is allowed: against the real timeout
    of a lighthouse in this process, else against lighthouse_heartbeat_timeout_s."""
    with Lighthouse(bind="127.0.0.1:0", heartbeat_timeout_ms=1000, join_timeout_ms=100) as lh:
        probe = Configured()
        config = _config(lh.address, probe, root=tmp_path)
        config.callbacks[0].params = FaultToleranceParameters(lighthouse=lh.address, replica_group_id=0,
                                                              heartbeat_interval=60.0)
        trainer = ToyTrainer(config)
        with pytest.raises(FaultToleranceError, match=(
                rf"heartbeat_interval=60 s is too long for a heartbeat timeout of 1 s \(the heartbeat_timeout_ms=1000 "
                rf"of the Lighthouse at {lh.address}\): it must be at most half of it, <= 0.5 s")):
            trainer.fit()
        assert trainer.status == "failed" and not probe.configured
        # The real timeout wins over what the group assumes.
        with pytest.raises(FaultToleranceError, match=r"heartbeat_interval=0.6 s .* <= 0.5 s"):
            check_heartbeat(FaultToleranceParameters(heartbeat_interval=0.6, lighthouse_heartbeat_timeout_s=5.0),
                            lh.address)
        check_heartbeat(FaultToleranceParameters(heartbeat_interval=0.5), lh.address)
    remote = "http://192.0.2.1:29510"  # settings unknown: lighthouse_heartbeat_timeout_s (default 1 s)
    with pytest.raises(FaultToleranceError, match=r"heartbeat_interval=60 s .*lighthouse_heartbeat_timeout_s=1, "
                                                  r"the lighthouse's --heartbeat-timeout-ms this group assumes"):
        check_heartbeat(FaultToleranceParameters(heartbeat_interval=60.0), remote)
    check_heartbeat(FaultToleranceParameters(heartbeat_interval=60.0, lighthouse_heartbeat_timeout_s=120.0), remote)


# --------------------------------------------------------------------- the run's files
def test_the_run_history_and_the_groups_checkpoint_roots(tmp_path):
    """What a (re)starting group reads of the other groups' files: only JSON, lines cut
    short by a kill skipped; the checkpoint roots of every group, default or explicit."""
    for group, lines in {0: ['{"event": "step", "step": 7}', '{"event": "end", "status": "completed", "step": 9}'],
                         1: ['{"event": "quorum", "step": 12}', '{"event": "st'],
                         2: ['{"event": "end", "status": "failed", "step": 30}']}.items():
        (tmp_path / f"replica_group_{group}").mkdir()
        (tmp_path / f"replica_group_{group}" / "fault_tolerance.jsonl").write_text("\n".join(lines) + "\n")
    assert run_history(tmp_path) == (30, 9, str(tmp_path / "replica_group_0" / "fault_tolerance.jsonl"))
    assert run_history(tmp_path / "nothing") == (0, None, "")
    (tmp_path / "replica_group_x").mkdir()
    assert group_roots(tmp_path / "replica_group_1" / "checkpoints", 1) == [
        tmp_path / f"replica_group_{g}" / "checkpoints" for g in (0, 1, 2)]
    assert group_roots(tmp_path / "replica_group_2", 2) == [tmp_path / f"replica_group_{g}" for g in (0, 1, 2)]
    assert group_roots(tmp_path / "elsewhere", 1) == [tmp_path / "elsewhere"]


def test_what_is_read_back_stays_inside_the_run(tmp_path):
    """A group directory, an event file or a checkpoint root found on disk that leads out of
    the run's directory (a symlink; a path with ``..``) is refused with an error naming it,
    where it leads and the directory the run is configured with; inside, links are fine."""
    run, outside = tmp_path / "run", tmp_path / "elsewhere"
    for d in (run / "replica_group_0", outside / "replica_group_9"):
        d.mkdir(parents=True)
        (d / "fault_tolerance.jsonl").write_text('{"event": "step", "step": 3}\n')
    assert run_history(run)[0] == 3
    (run / "replica_group_0" / "checkpoints").mkdir()
    (run / "replica_group_1").symlink_to(run / "replica_group_0", target_is_directory=True)  # inside: fine
    assert run_history(run)[0] == 3 and len(group_roots(run / "replica_group_0" / "checkpoints", 0)) == 2
    (run / "replica_group_9").symlink_to(outside / "replica_group_9", target_is_directory=True)
    with pytest.raises(FaultToleranceError, match=r"event file .*replica_group_9/fault_tolerance.jsonl resolves to "
                                                  r".*elsewhere/replica_group_9/fault_tolerance.jsonl, outside "
                                                  r".*/run, the directory this run is configured with: refused"):
        run_history(run)
    with pytest.raises(FaultToleranceError, match=r"replica group directory .*replica_group_9 resolves to .*elsewhere"):
        group_roots(run / "replica_group_0" / "checkpoints", 0)
    (run / "replica_group_9").unlink()
    (run / "replica_group_0" / "fault_tolerance.jsonl").unlink()
    (run / "replica_group_0" / "fault_tolerance.jsonl").symlink_to(outside / "replica_group_9" / "fault_tolerance.jsonl")
    with pytest.raises(FaultToleranceError, match=r"event file .*replica_group_0/fault_tolerance.jsonl resolves"):
        run_history(run)
    (run / "replica_group_0" / "fault_tolerance.jsonl").unlink()
    (run / "replica_group_0" / "checkpoints").rmdir()
    (run / "replica_group_0" / "checkpoints").symlink_to(outside, target_is_directory=True)  # a root linked out
    with pytest.raises(FaultToleranceError, match=r"checkpoint root .*replica_group_0/checkpoints resolves to "
                                                  r".*elsewhere, outside"):
        group_roots(run / "replica_group_1" / "checkpoints", 1)
    with pytest.raises(FaultToleranceError, match=r"resolves to .*elsewhere, outside"):
        confined(run / ".." / "elsewhere", run, "a path")
    assert confined(run / "replica_group_1" / ".." / "replica_group_0", run, "a path") == \
        run / "replica_group_1" / ".." / "replica_group_0"


def test_a_first_quorum_behind_the_run_fails_or_warns(caplog):
    """Behind a finished run: an error. From step 0 while steps were committed: an error.
    From a checkpoint older than the last committed step (every group was lost): a warning.
    At or past what the files say: nothing."""
    with pytest.raises(FaultToleranceError, match=r"replica group 1 stands at step 4 after its first quorum "
                                                  r"\(1 group\(s\)\), but this run was finished at step 20 \(f.jsonl\)"):
        check_progress((20, 20, "f.jsonl"), 4, 1, 1)
    with pytest.raises(FaultToleranceError, match=r"would train this run again from step 0: 17 step\(s\) were "
                                                  r"committed before \(g.jsonl\)"):
        check_progress((17, None, "g.jsonl"), 0, 2, 0)
    with caplog.at_level("WARNING", logger="dream_trainer.fault_tolerance"):
        check_progress((17, None, "g.jsonl"), 15, 2, 0)
        check_progress((17, 17, "g.jsonl"), 17, 1, 0)
        check_progress((0, None, ""), 0, 1, 0)
    assert [r.getMessage() for r in caplog.records] == [
        "replica group 0 resumes at step 15: steps 16-17 of this run were committed before (g.jsonl), but no live "
        "group and no checkpoint visible to this group has them: they are lost"]


# --------------------------------------------------------------------- the lighthouse CLI
@needs_torchft
def test_the_lighthouse_command_serves_until_sigterm():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dream_trainer.fault_tolerance", "lighthouse", "--bind", f"127.0.0.1:{port}"],
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


class AllReduces(Callback):
    """Per micro-batch: whether it was an accumulation micro-step, the cross-group
    all-reduces started since the last one, how many of them during backward; and the
    gradient of the model's unused parameter at the optimizer step."""

    def __init__(self):
        self.calls, self.records, self.unused_grads = 0, [], []

    def pre_configure(self):  # the Manager exists (launched); the world attaches it in post_configure
        manager = self.trainer.world.manager
        start = manager.allreduce

        def counted(tensor, *args, **kwargs):
            self.calls += 1
            return start(tensor, *args, **kwargs)

        manager.allreduce = counted

    def pre_optimizer_step(self, model, optimizer):
        self.unused_grads.append(model.unused.grad.clone())

    def post_train_step(self, result, batch_idx):
        trainer = self.trainer
        self.records.append((trainer.is_accumulating_gradients, self.calls, trainer.world.gradients.started_in_backward))
        self.calls = 0


class WithUnused(FTToy):
    """A model with a parameter that never gets a gradient (a missing gradient is zeros)."""

    def configure_models(self):
        super().configure_models()
        self.model.register_parameter("unused", torch.nn.Parameter(torch.ones(3)))


@needs_torchft
def test_the_gradient_all_reduce_starts_during_the_last_backward_of_a_step(tmp_path, lighthouse, monkeypatch):
    """Bucketed: each bucket's all-reduce starts in the backward of a step's last micro-batch
    as soon as its gradients are ready (nothing on accumulation micro-steps); a bucket with
    a parameter that gets no gradient is started by trainer.step, with zeros for it."""
    monkeypatch.setattr(FaultTolerantWorld, "bucket_mb", 0.001)
    spy = AllReduces()
    trainer = WithUnused(_config(lighthouse.address, spy, root=tmp_path, gradient_accumulation_steps=2),
                         micro_batches=2, n_samples=64, batch_size=4, hidden=64)
    trainer.fit()
    buckets = trainer.world.gradients.buckets
    assert trainer.status == "completed" and trainer.global_step == 12 and buckets >= 3
    # The unused parameter comes first, so its bucket is the last: the others start in backward.
    assert spy.records == [(True, 0, 0), (False, buckets, buckets - 1)] * 12
    assert all(torch.equal(g, torch.zeros(3)) for g in spy.unused_grads) and len(spy.unused_grads) == 12


class TwoBackward(FTToy):
    """Two backward passes in a step's only micro-batch."""

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.seen.append(index.tolist())
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.backward(loss, retain_graph=True)
        self.backward(loss)
        self.step(self.optimizer)
        return {"loss": loss}


@needs_torchft
def test_a_gradient_after_its_all_reduce_started_is_not_committed(tmp_path, lighthouse, caplog):
    """A second backward adds to gradients whose all-reduce already started: that step is not
    committed (never applied with half-averaged gradients), said once, and the all-reduce
    then starts after backward: the next steps commit, on the same data first."""
    trainer = TwoBackward(_config(lighthouse.address, root=tmp_path), n_samples=64, batch_size=4)
    with caplog.at_level("WARNING", logger="dream_trainer.fault_tolerance.world"):
        trainer.fit()
    assert trainer.status == "completed" and trainer.global_step == 12 and trainer.skipped_steps == 1
    failed = [e for e in _events(trainer) if e["event"] == "not_committed"]
    assert [e["step"] for e in failed] == [0] and "LateGradientError: a gradient was accumulated after" in failed[0]["reason"]
    assert trainer.world.gradients.overlap is False and trainer.seen[0] == trainer.seen[1]
    said = [r.getMessage() for r in caplog.records if "not committed" in r.getMessage()]
    assert len(said) == 1 and "step 1 was not committed (LateGradientError" in said[0]


@needs_torchft
def test_sampler_settings_are_checked(tmp_path, lighthouse):
    with pytest.raises(ValueError, match=r"micro_batches=1\) but the trainer accumulates 2 micro-batch"):
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
    """Saves the trainer's state (what a heal sends: the checkpoints' composition) at the
    end of step `at`; or loads `state` in pre_fit (into a fresh optimizer, as a heal may)."""

    def __init__(self, at=None, state=None):
        self.at, self.state = at, state

    def pre_fit(self):
        if self.state is not None:
            self.trainer.load_state_dict(self.state)

    def post_train_step(self, result, batch_idx):
        if self.trainer.global_step == self.at and not self.trainer.is_accumulating_gradients:
            self.state = copy.deepcopy(self.trainer.state_dict())  # it holds live tensors


def test_the_heal_state_is_the_checkpoint_composition_and_continues_exactly(tmp_path):
    def config(*callbacks, steps=10):
        return TrainerConfig(run_name="n", root_dir=str(tmp_path), device_parameters=DeviceParameters.SINGLE_DEVICE(),
                             training_parameters=TrainingParameters(n_epochs=None, max_steps=steps,
                                                                    num_sanity_val_steps=0), callbacks=list(callbacks))

    capture = Capture(at=6)
    straight = AdamToy(config(capture))
    straight.fit()
    optimizer = capture.state["optimizers"]["optimizer"]
    named = {k.removeprefix("state.").rsplit(".", 1)[0] for k in optimizer if k.startswith("state.")}
    assert named == {n for n, _ in straight.model.named_parameters()}
    healed = AdamToy(config(Capture(state=capture.state)))  # a fresh optimizer: no state at all
    healed.fit()
    assert healed.global_step == 10 and healed.optimizer.state_dict()["state"][0]["step"] == 10  # DCP's init step: overwritten
    assert all(torch.equal(a, b) for a, b in zip(straight.model.parameters(), healed.model.parameters()))

"""The goodput ledger (``trainer.goodput``): the parts of a run's wall time. The ledger alone
(its switches, seams and state), a real run with checkpoints, validation and skipped steps,
and a run preempted by SIGTERM and resumed, which counts the restart and continues the
ledger. The fault-tolerant heal part is checked in tests/integration/test_fault_tolerance.py;
compile in tests/unit/test_performance_callbacks.py."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from dream_trainer import (Callback, CheckpointParameters, DeviceParameters, TrainerConfig,
                           TrainingParameters)
from dream_trainer.callbacks import CheckpointCallback
from dream_trainer.testing import ToyTrainer
from dream_trainer.trainer.goodput import KINDS, GoodputLedger
from dream_trainer.trainer.step_path import StepPath


# -------------------------------------------------------------------- the ledger alone
def _arrive(clock):
    clock.arrive(time.perf_counter())


def test_switches_and_seams_put_every_moment_in_one_part():
    ledger, clock = GoodputLedger(), StepPath()  # the loop's clock: the ledger reads it, the loop keeps it
    ledger.start()
    ledger.fetching(clock)
    time.sleep(0.01)  # waiting for the batch
    _arrive(clock)
    with ledger.timed("checkpoint"):
        with ledger.timed("validation"):  # nested: the innermost counts
            time.sleep(0.01)
    clock.end(1, time.perf_counter())  # a step ends: the ledger reads it from the clock, no call
    clock.fetch_start = time.perf_counter()
    _arrive(clock)
    time.sleep(0.01)
    with ledger.timed("compile"):  # a named part inside the skipped step stays what it is
        time.sleep(0.01)
    time.sleep(0.01)
    now = time.perf_counter()
    ledger.step_skipped(now)  # its productive time is skipped time
    clock.end(2, now)
    time.sleep(0.01)  # the next step's (productive)
    summary = ledger.finish(report=False)
    parts = summary["parts_s"]
    assert parts["data"] >= 0.01 and parts["data"] == pytest.approx(clock.data_total)
    assert parts["validation"] >= 0.01 and parts["compile"] >= 0.01 and set(parts) == set(KINDS)
    assert parts["skipped"] >= 0.02 and parts["productive"] >= 0.01
    assert sum(parts.values()) == pytest.approx(summary["wall_s"])
    ledger.start()  # a new fit(): this attempt's parts start again
    ledger.fetching(clock)
    _arrive(clock)
    time.sleep(0.01)
    moved = ledger.add("compile", 10.0)  # at most what the running part holds
    parts = ledger.finish(report=False)["parts_s"]
    assert 0.01 <= moved < 10.0 and parts["compile"] == moved and parts["productive"] < moved


def test_a_named_part_inside_a_fetch_is_not_data_and_a_read_mid_fetch_splits_it():
    ledger, clock = GoodputLedger(), StepPath()
    ledger.start()
    fetch_start = ledger.fetching(clock)
    time.sleep(0.01)
    assert ledger.parts()["data"] >= 0.01  # read while the fetch is under way: its wait so far is data
    with ledger.timed("heal"):  # a fault-tolerant quorum that heals inside the fetch
        time.sleep(0.02)
    time.sleep(0.01)
    _arrive(clock)
    wait = clock.arrived_at - fetch_start
    time.sleep(0.01)
    parts = ledger.finish(report=False)["parts_s"]
    assert parts["heal"] >= 0.02 and parts["data"] >= 0.02 and parts["productive"] >= 0.01
    assert parts["data"] + parts["heal"] == pytest.approx(wait)  # the telemetry's wait holds both; the ledger splits it


def test_bad_parts_and_seconds_are_refused():
    ledger = GoodputLedger()
    with pytest.raises(ValueError, match=r"goodput part 'productive' is not one of"):
        ledger.add("productive", 1.0)
    with pytest.raises(ValueError, match=r"seconds=-1.*expected seconds >= 0"):
        ledger.add("checkpoint", -1)
    with pytest.raises(ValueError, match=r"goodput part 'ckpt' is not one of"):
        with ledger.timed("ckpt"):
            pass


def test_a_loaded_ledger_continues_and_counts_the_restart_but_a_heal_does_not_replace_it():
    first = GoodputLedger()
    first.start()
    with first.timed("validation"):
        time.sleep(0.01)
    state = first.state_dict()
    time.sleep(0.02)  # the work lost after the checkpoint, the time down
    second = GoodputLedger()
    second.start()
    second.load_state_dict(state)
    second.fetching(StepPath())  # the first step of the new attempt
    parts = second.finish(report=False)["parts_s"]
    assert parts["validation"] == pytest.approx(first.parts()["validation"], abs=1e-3) and parts["restart"] >= 0.02
    assert second.attempts == 2
    healed = second.parts()
    second.load_state_dict(first.state_dict())  # while training: a peer's state, ignored
    assert second.parts()["restart"] == pytest.approx(healed["restart"]) and second.attempts == 2


# -------------------------------------------------------------------- real runs
def _config(root, callbacks, **training):
    params = dict(n_epochs=None, max_steps=12, val_every_n_steps=4, num_sanity_val_steps=1)
    params.update(training)
    return TrainerConfig(run_name="goodput", root_dir=str(root), callbacks=list(callbacks),
                         device_parameters=DeviceParameters.SINGLE_DEVICE(),
                         training_parameters=TrainingParameters(**params))


class Clocks(Callback):
    """Measures validation from its hooks, vetoes step 3, and notes when the loop starts."""

    vetoes_steps = True

    def __init__(self):
        self.validation_s, self.started_at, self._t, self.vetoed = 0.0, None, None, False

    def pre_fit(self):
        self.started_at = time.time()

    def pre_validation_epoch(self):
        self._t = time.perf_counter()

    def post_validation_epoch(self, result):
        self.validation_s += time.perf_counter() - self._t

    def pre_optimizer_step(self, model, optimizer):
        if self.trainer.global_step == 2 and not self.vetoed:  # once: a skipped step does not advance
            self.vetoed = True
            self.trainer.skip_step("test veto")


def test_a_run_with_checkpoints_and_validation_splits_its_wall_time(tmp_path):
    clocks, saver = Clocks(), CheckpointCallback(CheckpointParameters(every_n_steps=4))
    trainer = ToyTrainer(_config(tmp_path, [clocks, saver]))
    started = time.perf_counter()
    trainer.fit()
    outside = time.perf_counter() - started
    summary = json.loads((trainer.run_dir / "goodput.json").read_text())
    parts, wall = summary["parts_s"], summary["wall_s"]
    assert sum(parts.values()) == pytest.approx(wall) and 0 < wall <= outside
    assert parts["checkpoint"] >= 0.99 * sum(saver.blocked_s) > 0  # every save's blocked time
    assert parts["validation"] >= clocks.validation_s > 0  # the sanity check and 3 validations
    assert parts["skipped"] > 0 and parts["data"] > 0 and parts["productive"] > 0
    assert parts["restart"] == 0 and summary["attempts"] == 1
    assert summary["goodput"] == pytest.approx(parts["productive"] / wall)
    assert trainer.goodput.summary()["parts_s"] == pytest.approx(parts)


def test_a_preempted_and_resumed_run_counts_the_restart_and_continues_the_ledger(tmp_path, caplog):
    class Terminate(Callback):
        def pre_train_step(self, batch, batch_idx):
            if self.trainer.global_step == 5:
                os.kill(os.getpid(), signal.SIGTERM)

    save = CheckpointParameters(every_n_steps=None, at_fit_end=False)
    first = ToyTrainer(_config(tmp_path, [Terminate(), CheckpointCallback(save)]))
    first.fit()
    assert first.status == "preempted"
    ended = time.time()
    before = json.loads((first.run_dir / "goodput.json").read_text())["parts_s"]
    clocks = Clocks()
    with caplog.at_level("INFO", logger="dream_trainer.trainer.goodput"):
        second = ToyTrainer(_config(tmp_path, [clocks, CheckpointCallback(save)]))
        second.fit()
    assert second.resumed and second.status == "completed"
    summary = json.loads((second.run_dir / "goodput.json").read_text())
    parts = summary["parts_s"]
    assert summary["attempts"] == 2 and summary["restart_known"]
    # From the preemption save to the first step of the new attempt: at least the time
    # between the two fits.
    assert parts["restart"] >= clocks.started_at - ended > 0
    # Continued: the first attempt's validations and steps are in it (as of its save).
    assert parts["validation"] >= 0.9 * before["validation"] and parts["productive"] > 0
    assert sum(parts.values()) == pytest.approx(summary["wall_s"])
    assert "goodput" in caplog.text and "over 2 attempt(s)" in caplog.text and "restart" in caplog.text

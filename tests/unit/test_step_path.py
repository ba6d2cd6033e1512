"""`StepPath` on its own: vetoes (host and device), batch skips, optimizer routes, the step
cycle and its counters, its state dict — no trainer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dream_trainer.trainer.step_path import OptimizerRoute, StepPath


def test_a_host_veto_keeps_the_first_reason_and_is_taken_once():
    path = StepPath()
    assert not path.veto_pending and path.take_veto() is None
    path.veto("first")
    path.veto("second")
    assert path.veto_pending
    assert path.take_veto() == "first"
    assert not path.veto_pending and path.take_veto() is None


@pytest.mark.parametrize(
    ("flags", "expected"),
    [([0.0], None), ([1.0], "spike"), ([float("nan")], "spike"), ([0.0, 0.0], None), ([0.0, 1.0], "spike")],
)
def test_device_flags_are_or_ed_and_read_at_the_take(flags, expected):
    path = StepPath()
    for value in flags:
        path.veto_if(torch.tensor(value), "spike")
    assert path.veto_pending
    assert path.take_veto() == expected
    assert not path.veto_pending


def test_a_host_veto_wins_over_a_device_flag_and_a_flag_that_needs_grad_is_detached():
    path = StepPath()
    flag = torch.ones((1,), requires_grad=True) * 1.0
    path.veto_if(flag, "device")
    path.veto("host")
    assert path.take_veto() == "host"
    path.veto_if(flag, "device")
    path.clear_vetoes()
    assert not path.veto_pending and path.take_veto() is None


def test_batch_skip_requests_keep_the_first_reason():
    path = StepPath()
    path.request_batch_skip("bad batch")
    path.request_batch_skip("other")
    assert path.take_batch_skip() == "bad batch"
    assert path.take_batch_skip() is None


def test_an_optimizer_route_is_made_once_until_forgotten():
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    made: list[torch.optim.Optimizer] = []

    def make(opt: torch.optim.Optimizer) -> OptimizerRoute:
        made.append(opt)
        return OptimizerRoute(name="optimizer", params=[p for g in opt.param_groups for p in g["params"]],
                              model=model, schedulers=[])

    path = StepPath()
    first = path.route(optimizer, make)
    assert path.route(optimizer, make) is first and made == [optimizer]
    assert first.params == list(model.parameters()) and first.model is model
    path.forget_routes()
    assert path.route(optimizer, make) is not first and len(made) == 2


def test_the_cycle_opens_once_counts_waits_and_samples_skipped_steps_and_times_the_step():
    path = StepPath()
    path.step_end = path.fetch_start = 10.0
    assert path.arrive(10.25) is True
    assert path.stats.samples is None and path.stats.data_wait_s == pytest.approx(0.25)  # nothing counted yet
    path.count(samples=4, tokens=None)
    assert path.stats.samples == 4 and path.stats.tokens is None and path.stats.total_samples == 4
    path.fetch_start = 10.3
    assert path.arrive(10.4) is False  # a second micro-batch of the same step: nothing reset
    path.count(samples=4, tokens=32)
    assert path.stats.samples == 8 and path.stats.tokens == 32 and path.stats.data_wait_s == pytest.approx(0.35)
    path.stepped = True
    assert path.end(step=1, now=10.5) is False
    assert not path.open and path.stats.step == 1 and path.stats.step_time_s == pytest.approx(0.5)
    assert path.skipped_steps == 0 and path.stats.total_samples == 8
    path.fetch_start = 10.5
    assert path.arrive(10.5) is True  # the next step starts clean, the totals go on
    path.count(samples=2, tokens=None)
    assert path.stats.samples == 2 and path.stats.tokens is None and path.stats.total_samples == 10
    assert path.stats.total_tokens == 32
    path.stats.skipped = "vetoed"
    assert path.skipped
    assert path.end(step=2, now=11.0) is True  # skipped: the global step stays 1
    assert path.skipped_steps == 1 and path.stats.step == 1


def test_state_dict_round_trips_the_counters_and_an_old_checkpoint_reads_as_zero():
    path = StepPath()
    path.skipped_steps, path.skipped_batches = 3, 2
    state = path.state_dict()
    assert state == {"skipped_steps": 3, "skipped_batches": 2}
    other = StepPath()
    other.load_state_dict(state)
    assert other.state_dict() == state
    other.load_state_dict({"global_step": 5})  # written before these counters existed
    assert other.state_dict() == {"skipped_steps": 0, "skipped_batches": 0}


def test_running_mean_folds_without_a_device_op_per_value():
    from dream_trainer.trainer.telemetry import RunningMean

    values = [torch.tensor(float(i)) for i in range(1, 12)]
    mean = RunningMean(fold=4)
    assert mean.mean() is None and mean.count == 0
    for v in values:
        mean.add(v)
    assert mean.count == 11 and len(mean._pending) == 3  # two folds of 4, three waiting
    assert torch.equal(mean.mean(), torch.tensor(6.0)) and mean._pending == []

"""The automatic pipeline schedule's cost model (issue 40): its terms against the analytic
bubble, the choice moving with communication and memory, the reasons it prints, and every
rank choosing alike (checked on 2 gloo ranks with one rank's numbers different)."""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dream_trainer.pipeline import (
    SCHEDULES,
    CostInputs,
    DeviceCost,
    ModelCost,
    PipelineLayout,
    PipelineParameters,
    PipelineRuntime,
    choose_schedule,
    cpu_gloo,
    estimate,
    expected_bubble,
)
from dream_trainer.pipeline.cost import hidden_size, in_flight
from dream_trainer.testing import spawn_world

FREE = DeviceCost("free links", flops_per_s=1e12, latency_s=0.0, bytes_per_s=float("inf"), action_s=0.0,
                  split_backward=0.0, overlapped=False)
MODEL = ModelCost(flops_per_sample=6e9, boundary_bytes_per_sample=64 * 128 * 4, n_layers=8)
V = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2, "InterleavedZeroBubble": 2}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 16)])
def test_with_free_communication_the_idle_share_is_the_expected_bubble(schedule, pp, m):
    e = estimate(schedule, pp, V[schedule], m, 32, MODEL, FREE)
    assert e.compute_s == pytest.approx(6e9 * 32 / pp / 1e12)
    assert e.transfer_s == 0.0 and e.actions_s == 0.0
    assert e.idle_s / e.step_s == pytest.approx(expected_bubble(schedule, pp, V[schedule], m))


def test_transfers_and_actions_are_counted_per_schedule():
    slow = dataclasses.replace(FREE, latency_s=1e-3, action_s=1e-4)
    one, two = estimate("1F1B", 2, 1, 4, 32, MODEL, slow), estimate("Interleaved1F1B", 2, 2, 4, 32, MODEL, slow)
    assert one.transfer_s == pytest.approx(2 * 4 * 1 * (2 - 1) / 2 * 1e-3)  # 2 v m (pv - 1) / pv sends over gloo
    assert two.transfer_s == pytest.approx(2 * 4 * 2 * (4 - 1) / 4 * 1e-3)
    assert one.actions_s == pytest.approx(2 * 4 * 1e-4) and two.actions_s == pytest.approx(2 * 2 * 4 * 1e-4)
    zb = estimate("InterleavedZeroBubble", 2, 2, 4, 32, MODEL, slow)
    assert zb.actions_s == pytest.approx(3 * 2 * 4 * 1e-4)  # the backward split in two
    overlapped = estimate("Interleaved1F1B", 2, 2, 4, 32, MODEL, dataclasses.replace(slow, overlapped=True))
    assert overlapped.transfer_s == pytest.approx(2 * (4 - 1) * 1e-3)  # NCCL: fill and drain only


def test_in_flight_activations_follow_each_schedule():
    assert in_flight("GPipe", 4, 1, 16) == 16 and in_flight("1F1B", 4, 1, 16) == 4 and in_flight("1F1B", 4, 1, 2) == 2
    assert in_flight("Interleaved1F1B", 4, 2, 16) == (2 - 1) * 4 + 2 * 3 + 1
    assert in_flight("InterleavedZeroBubble", 2, 2, 2) == 4  # capped by the chunks there are


def test_the_choice_moves_with_the_cost_of_communication():
    batch, params = 32, PipelineParameters()
    free = choose_schedule(params, pp=2, batch=batch, n_layers=8, cost=(MODEL, FREE))
    assert (free.schedule, free.stages_per_rank) == ("InterleavedZeroBubble", 2)  # the smallest bubble wins
    latency = dataclasses.replace(FREE, latency_s=0.05)  # transfers dominate: the fewest stages
    slow = choose_schedule(params, pp=2, batch=batch, n_layers=8, cost=(MODEL, latency))
    assert (slow.schedule, slow.stages_per_rank) == ("1F1B", 1)  # 1F1B before GPipe: less memory
    line = slow.describe(2)
    assert "auto: the fastest by the cost model (free links)" in line and "transfers" in line
    assert "alternatives (estimated step): GPipe x1: ~" in line and "InterleavedZeroBubble x2: ~" in line
    assert len(slow.estimates) == len(slow.candidates) == 4


def test_a_schedule_over_the_memory_is_left_out_and_none_fitting_is_refused():
    big = dataclasses.replace(MODEL, boundary_bytes_per_sample=4096 * 4096 * 2, n_layers=32, state_bytes=1e9)
    gpipe_only = estimate("GPipe", 4, 1, 16, 16, big, FREE).peak_bytes
    limit = dataclasses.replace(FREE, memory_bytes=(gpipe_only / 2 + big.state_bytes / 4) / 0.9)
    choice = choose_schedule(PipelineParameters(microbatches=16), pp=4, batch=16, n_layers=32, cost=(big, limit))
    assert choice.schedule != "GPipe" and "GPipe x1 left out: over the device's memory" in choice.describe(4)
    tiny = dataclasses.replace(FREE, memory_bytes=1e6)
    with pytest.raises(ValueError, match=r"no pipeline schedule fits the device's memory with 16 micro-batches: "
                                         r"1F1B x1 needs ~17.4 GB a rank \(activations 17.2 GB, model state 250 MB\), over 90 % of "
                                         r"the device's 1 MB; GPipe x1 needs ~69 GB.*use more pipeline ranks or "
                                         r"micro-batches$"):
        choose_schedule(PipelineParameters(microbatches=16), pp=4, batch=16, n_layers=32, cost=(big, tiny))


def test_without_the_sample_size_auto_falls_back_and_says_how_to_fix_it():
    line = choose_schedule(PipelineParameters(), pp=2, batch=8, n_layers=4, gloo=True).describe(2)
    assert "(no cost model: set PipelineParameters.sample_tokens)" in line
    with pytest.raises(ValueError, match=r"sample_tokens=0 is invalid"):
        PipelineParameters(sample_tokens=0)


class _Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)


class _Net(nn.Module):
    def __init__(self, d: int = 24, n: int = 4):
        super().__init__()
        self.emb, self.head = nn.Embedding(50, d), nn.Linear(d, 50)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(n))


def test_the_runtime_feeds_the_cost_model_from_the_trainer_and_logs_why(caplog):
    assert hidden_size(_Block(24)) == 24
    with torch.device("meta"):
        holder = SimpleNamespace(model=_Net())
    layout = PipelineLayout(layers="blocks", first=("emb",), last=("head",))
    costs = CostInputs(flops_per_token=1e6, flops_per_sample=None, element_bytes=4, device=torch.device("cpu"))
    with caplog.at_level("WARNING", logger="dream_trainer.pipeline.runtime"):
        PipelineRuntime().plan(holder, layout, PipelineParameters(sample_tokens=16), pp=2, pp_rank=0,
                               batch=lambda: 8, gloo=True, costs=costs)
    lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(lines) == 1 and f"the fastest by the cost model ({cpu_gloo().name})" in lines[0], lines


def _choose_on_rank(results_dir: str) -> str:
    """One of 2 gloo ranks: rank 1's links are 100x slower, so its cost model alone prefers
    fewer stages; both ranks must refuse, naming each choice (not cut the model apart)."""
    import torch.distributed as dist

    from dream_trainer.pipeline.runtime import agree_on_choice

    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        device = dataclasses.replace(FREE, latency_s=0.05 if rank == 1 else 0.0)
        choice = choose_schedule(PipelineParameters(), pp=2, batch=32, n_layers=8, cost=(MODEL, device))

        def gather(obj):
            out = [None] * dist.get_world_size()
            dist.all_gather_object(out, obj)
            return out

        try:
            agree_on_choice(choice, gather)
        except RuntimeError as exc:
            return str(exc)
        return "agreed"
    finally:
        dist.destroy_process_group()


def test_ranks_whose_cost_models_disagree_all_refuse_naming_each_choice(tmp_path):
    messages = spawn_world(2, _choose_on_rank, str(tmp_path), timeout=120.0)
    assert messages[0] == messages[1], messages
    assert ("the ranks chose different pipeline schedules (rank 0: InterleavedZeroBubble x2, 4 micro-batches; "
            "rank 1: 1F1B x1, 4 micro-batches)") in messages[0]
    assert os.environ.get("RANK") is None  # the spawned ranks' environment stayed theirs

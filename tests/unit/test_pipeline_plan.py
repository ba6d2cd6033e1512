"""Pipeline planning in one process: expected bubbles, the automatic choice and its
refusals (each with a suggestion), the layer split, the stage cut and its parameters."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dream_trainer import DeviceParameters
from dream_trainer.pipeline import (
    PipelineLayout,
    PipelineParameters,
    StageLayers,
    choose_schedule,
    cut,
    expected_bubble,
    split_layers,
    stage_ids,
)


@pytest.mark.parametrize("schedule, v, m, want", [
    ("GPipe", 1, 4, 1 / 5), ("1F1B", 1, 4, 1 / 5),  # (p-1)/(m+p-1), p = 2
    ("Interleaved1F1B", 2, 4, 1 / 9),  # (p-1)/(v m + p-1)
    ("InterleavedZeroBubble", 2, 4, 1 / 25),  # (p-1) / (3 v m + p-1)
])
def test_expected_bubble_formulas(schedule, v, m, want):
    assert expected_bubble(schedule, 2, v, m) == pytest.approx(want)
    assert expected_bubble(schedule, 1, v, m) == 0.0
    assert expected_bubble(schedule, 2, v, 4 * m) < expected_bubble(schedule, 2, v, m)  # more micro-batches: less


def test_auto_chooses_the_smallest_bubble_and_says_so():
    choice = choose_schedule(PipelineParameters(), pp=2, batch=8, n_layers=4)
    assert (choice.schedule, choice.stages_per_rank, choice.microbatches) == ("InterleavedZeroBubble", 2, 4)
    assert "InterleavedZeroBubble" in choice.describe(2) and "1F1B x1: 20.0%" in choice.describe(2)
    # Two layers cannot make 4 stages: the best one-stage-per-rank schedule (1F1B before GPipe on a tie).
    assert choose_schedule(PipelineParameters(), pp=2, batch=8, n_layers=2).schedule == "1F1B"
    assert choose_schedule(PipelineParameters(schedule="GPipe"), pp=2, batch=8, n_layers=4).schedule == "GPipe"


@pytest.mark.parametrize("params, batch, layers, match", [
    (PipelineParameters(microbatches=3), 8, 4, r"microbatches=3 does not divide the 8 samples.*counts that do: \[1, 2, 4, 8\]"),
    (PipelineParameters(schedule="1F1B", microbatches=1), 8, 4,
     r"1F1B needs at least as many micro-batches as stages \(2\), got 1.*Micro-batch counts that divide the batch of 8: \[2, 4, 8\]"),
    (PipelineParameters(schedule="Interleaved1F1B"), 8, 2, r"4 stages \(2 ranks x 2\) but only 2 layers"),
    (PipelineParameters(schedule="GPipe", stages_per_rank=2), 8, 4, r"GPipe holds 1 stage per rank, not 2"),
])
def test_a_plan_that_cannot_run_is_refused_with_a_suggestion(params, batch, layers, match):
    with pytest.raises(ValueError, match=match):
        choose_schedule(params, pp=2, batch=batch, n_layers=layers)


@pytest.mark.parametrize("kwargs, match", [
    ({"schedule": "ZBV"}, r"schedule='ZBV' is invalid"), ({"microbatches": 0}, r"microbatches=0 is invalid"),
    ({"split": "blocks"}, r"split='blocks' is invalid"), ({"split": (2, 0)}, r"split=\(2, 0\) is invalid"),
])
def test_pipeline_parameters_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PipelineParameters(**kwargs)
    with pytest.raises(ValueError, match=r"pipeline_parallel=0 is invalid"):
        DeviceParameters(pipeline_parallel=0)


def test_split_layers():
    assert split_layers(5, 2, "layers") == [range(0, 3), range(3, 5)]
    assert split_layers(4, 2, (1, 3)) == [range(0, 1), range(1, 4)]
    assert split_layers(4, 2, "parameters", [10, 1, 1, 1]) == [range(0, 1), range(1, 4)]
    assert split_layers(6, 3, "parameters", [1, 1, 1, 1, 1, 1]) == [range(0, 2), range(2, 4), range(4, 6)]
    with pytest.raises(ValueError, match=r"split=\(1, 2\) is invalid: 2 stages of 4 layers need 2 counts summing to 4, e.g. \(2, 2\)"):
        split_layers(4, 2, (1, 2))
    with pytest.raises(ValueError, match=r"5 pipeline stages but only 4 layers"):
        split_layers(4, 5, "layers")
    assert stage_ids("Interleaved1F1B", 1, 2, 2) == [1, 3] and stage_ids("1F1B", 0, 2, 1) == [0]


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(2, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        x = x if self.emb is None else self.emb(x)
        for block in self.blocks:
            x = block(x)
        return x if self.head is None else self.head(x)


def test_the_cut_keeps_names_shares_modules_and_leaves_the_model_whole():
    net = _Net()
    layout = PipelineLayout(layers="blocks", first=("emb",), last=("head",))
    first, second = cut(net, layout, [0, 1], True, False), cut(net, layout, [2, 3], False, True)
    assert [n for n, _ in first.named_parameters()] == ["emb.weight", "emb.bias", "blocks.0.weight", "blocks.0.bias",
                                                        "blocks.1.weight", "blocks.1.bias"]
    assert {n.split(".")[1] for n, _ in second.named_parameters() if n.startswith("blocks")} == {"2", "3"}
    assert isinstance(second.blocks, StageLayers) and second.blocks[0] is net.blocks[2] and second.emb is None
    assert len(net.blocks) == 4 and net.emb is not None and net.head is not None  # the source is untouched
    x = torch.randn(3, 2)
    torch.testing.assert_close(second(first(x)), net(x))
    with pytest.raises(TypeError, match=r"pipeline_layout.layers='head' is a Linear, not an nn.ModuleList"):
        cut(net, PipelineLayout(layers="head"), [0], True, True)


def test_tied_first_and_last_modules_are_refused():
    from dream_trainer.pipeline import check_untied

    net = _Net()
    net.head = nn.Linear(2, 4)
    net.head.weight = net.emb.weight  # tied
    with pytest.raises(ValueError, match=r"\['head'\] share weights with \['emb'\] \(tied embeddings\)"):
        check_untied(net, PipelineLayout(layers="blocks", first=("emb",), last=("head",)))
    check_untied(_Net(), PipelineLayout(layers="blocks", first=("emb",), last=("head",)))  # untied: fine


def test_zero_bubble_is_left_out_with_sharded_stages():
    assert choose_schedule(PipelineParameters(), pp=2, batch=8, n_layers=4, sharded_stages=True).schedule == "Interleaved1F1B"
    assert choose_schedule(PipelineParameters(), pp=2, batch=8, n_layers=4).schedule == "InterleavedZeroBubble"
    with pytest.raises(ValueError, match=r"InterleavedZeroBubble with FSDP2 inside the stages \(dp_shard > 1\)"):
        choose_schedule(PipelineParameters(schedule="InterleavedZeroBubble"), pp=2, batch=8, n_layers=4, sharded_stages=True)


def test_a_batch_the_micro_batches_do_not_divide_is_refused_naming_the_fix():
    from dream_trainer.pipeline.stages import check_batch

    check_batch(torch.zeros(8, 3), 4)  # fine
    with pytest.raises(ValueError, match=r"a validation batch of 6 samples cannot be cut into 4 equal pipeline "
                                         r"micro-batches.*multiple of 4 samples.*drop_last=True.*microbatches"):
        check_batch(torch.zeros(6, 3), 4, "validation")


def test_auto_over_gloo_leaves_zero_bubble_out_and_says_why():
    # Issue 40: on CPU ranks (gloo P2P) InterleavedZeroBubble measured slowest; the analytic
    # bubble counts no communication. Over gloo, auto takes the next smallest expected bubble.
    over_gloo = choose_schedule(PipelineParameters(), pp=2, batch=8, n_layers=4, gloo=True)
    assert (over_gloo.schedule, over_gloo.stages_per_rank, over_gloo.microbatches) == ("Interleaved1F1B", 2, 4)
    line = over_gloo.describe(2)
    assert line.startswith("pipeline: schedule Interleaved1F1B, 2 ranks x 2 stage(s), 4 micro-batches (auto: ")
    assert "InterleavedZeroBubble left out over gloo (CPU)" in line
    assert "alternatives (expected bubble): 1F1B x1: 20.0%, GPipe x1: 20.0%, InterleavedZeroBubble x2: 4.0%" in line
    # Two layers: one stage per rank, over gloo too; asked for, zero bubble still runs over gloo.
    assert choose_schedule(PipelineParameters(), pp=2, batch=8, n_layers=2, gloo=True).schedule == "1F1B"
    asked = choose_schedule(PipelineParameters(schedule="InterleavedZeroBubble"), pp=2, batch=8, n_layers=4, gloo=True)
    assert asked.schedule == "InterleavedZeroBubble" and "(asked for; expected bubble 4.0%)" in asked.describe(2)
    # NCCL (free communication as far as the model knows): the analytic preference.
    assert choose_schedule(PipelineParameters(), pp=2, batch=8, n_layers=4).schedule == "InterleavedZeroBubble"


def test_the_choice_is_logged_at_warning_once(caplog):
    from dream_trainer.pipeline import PipelineRuntime

    with torch.device("meta"):
        holder = SimpleNamespace(model=_Net())
    layout = PipelineLayout(layers="blocks", first=("emb",), last=("head",))
    with caplog.at_level("WARNING", logger="dream_trainer.pipeline.runtime"):
        PipelineRuntime().plan(holder, layout, PipelineParameters(), pp=2, pp_rank=0, batch=lambda: 8, gloo=True)
    lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(lines) == 1 and lines[0].startswith("pipeline: schedule Interleaved1F1B"), lines

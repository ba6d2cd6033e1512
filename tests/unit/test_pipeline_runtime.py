"""`PipelineRuntime` in one process, with no trainer (any object that holds the model) and
as a component of `DreamTrainer`: each trainer has its own, and the trainer's bases hold no
pipeline state."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dream_trainer import BaseTrainer, DeviceParameters, DreamTrainer, TrainerConfig
from dream_trainer.pipeline import PipelineLayout, PipelineParameters, PipelineRuntime, StageLayers
from tests.unit.test_import_graph import GRAPH
from tests.unit.test_pipeline_plan import _Net  # the model the plan's tests cut

LAYOUT = PipelineLayout(layers="blocks", first=("emb",), last=("head",))


def _never() -> int:
    raise AssertionError("the batch size was asked before the model was checked")


def test_a_runtime_that_planned_nothing_runs_hooks_once_and_has_no_pipeline():
    runtime, holder, calls = PipelineRuntime(), SimpleNamespace(model=_Net()), []
    runtime.for_each_stage(holder, lambda: calls.append(holder.model))
    assert calls == [holder.model] and runtime.pipeline is None
    with runtime.whole_model(holder, torch.device("cpu")) as whole:
        assert whole == []
    with pytest.raises(RuntimeError, match=r"start\(\) before plan\(\)"):
        runtime.start(torch.device("cpu"), None)
    with pytest.raises(RuntimeError, match=r"train_step\(\) before start\(\)"):
        runtime.train_step(torch.zeros(2, 2), torch.zeros(2), nn.functional.mse_loss)


def test_plan_cuts_the_holders_model_and_keeps_the_whole_one_until_its_weights_are_set():
    with torch.device("meta"):
        net = _Net()
    holder = SimpleNamespace(model=net)
    runtime = PipelineRuntime()
    runtime.plan(holder, LAYOUT, PipelineParameters(schedule="1F1B"), pp=2, pp_rank=1, batch=lambda: 8)
    part = holder.model
    assert part is not net and runtime.whole is net and runtime.stages == [part]
    assert (runtime.stage_ids, runtime.n_stages, runtime.choice.schedule) == ([1], 2, "1F1B")
    assert isinstance(part.blocks, StageLayers) and [b for b in part.blocks] == [net.blocks[2], net.blocks[3]]
    assert part.emb is None and part.head is net.head
    part.to_empty(device="cpu")  # what the trainer materializes: this rank's part only
    assert net.emb.weight.is_meta
    with runtime.whole_model(holder, torch.device("cpu")) as whole:
        assert whole == [net] and holder.model is net
        # Only this rank's layers are allocated (issue 40): the other rank's stay on meta.
        assert [n for n, t in net.named_parameters() if not t.is_meta] == [n for n, _ in part.named_parameters()]
    assert holder.model is part and runtime.whole is None


@torch.no_grad()
def _init(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            module.weight.mul_(0.5)
            nn.init.uniform_(module.bias, -0.1, 0.1)


@pytest.mark.parametrize("schedule, pp_rank", [("1F1B", 0), ("1F1B", 1), ("Interleaved1F1B", 0),
                                               ("Interleaved1F1B", 1)])
def test_each_rank_initializes_its_layers_as_one_process_without_allocating_the_others(schedule, pp_rank):
    reference = _Net()
    torch.manual_seed(0)
    _init(reference)  # one process, from the same seed
    next_draw = torch.rand(3)
    with torch.device("meta"):
        net = _Net()
    holder, runtime = SimpleNamespace(model=net), PipelineRuntime()
    runtime.plan(holder, LAYOUT, PipelineParameters(schedule=schedule, microbatches=4), pp=2, pp_rank=pp_rank,
                 batch=lambda: 8)
    part = holder.model
    part.to_empty(device="cpu")
    torch.manual_seed(0)
    with runtime.whole_model(holder, torch.device("cpu")) as whole:
        _init(whole[0])
        allocated = {n for n, t in net.named_parameters() if not t.is_meta}
    mine = dict(part.named_parameters())
    assert allocated == set(mine) and len(mine) < len(dict(reference.named_parameters()))
    for name, value in mine.items():
        assert torch.equal(value, reference.get_parameter(name)), name  # bit for bit
    assert torch.equal(torch.rand(3), next_draw)  # the random stream went on as in one process


def test_each_stage_of_an_interleaved_rank_gets_the_hook_in_turn():
    holder, seen = SimpleNamespace(model=_Net()), []
    runtime = PipelineRuntime()
    runtime.plan(holder, LAYOUT, PipelineParameters(schedule="Interleaved1F1B", microbatches=4), pp=2, pp_rank=0,
                 batch=lambda: 8)
    part = holder.model
    assert (runtime.stage_ids, runtime.n_stages) == ([0, 2], 4)
    runtime.for_each_stage(holder, lambda: seen.append([n for n, _ in holder.model.named_parameters()]))
    assert seen == [["emb.weight", "emb.bias", "blocks.0.weight", "blocks.0.bias"],
                    ["blocks.2.weight", "blocks.2.bias"]]
    assert holder.model is part  # restored after the hooks


def test_a_missing_model_is_refused_before_the_batch_size_is_asked():
    runtime = PipelineRuntime()
    with pytest.raises(AttributeError, match=r"pipeline_layout.model='net': the trainer has no such model"):
        runtime.plan(SimpleNamespace(model=_Net()), PipelineLayout(layers="blocks", model="net"),
                     PipelineParameters(), pp=2, pp_rank=0, batch=_never)
    assert runtime.layout is None and runtime.stages == []


def test_train_step_scales_the_loss_by_the_accumulation_and_reports_it_unscaled():
    seen = []

    class _Schedule:  # what the running Pipeline does with the loss function
        def train_step(self, inputs, target, loss_fn):
            loss = loss_fn(inputs, target)
            seen.append(loss)
            return loss

    runtime = PipelineRuntime()
    runtime.pipeline = _Schedule()
    out = runtime.train_step(torch.tensor(6.0), torch.tensor(0.0), lambda out, tgt: out - tgt, accumulation=3)
    assert seen == [torch.tensor(2.0)] and out == torch.tensor(6.0)
    with pytest.raises(ValueError, match=r"accumulation=0 is invalid"):
        runtime.train_step(torch.tensor(6.0), torch.tensor(0.0), lambda out, tgt: out - tgt, accumulation=0)


def test_two_trainers_do_not_share_pipeline_state(tmp_path):
    config = TrainerConfig(root_dir=str(tmp_path), device_parameters=DeviceParameters.SINGLE_DEVICE())
    first, second = DreamTrainer(config), DreamTrainer(config)
    assert DreamTrainer.__bases__ == (BaseTrainer,)  # a component, not a mixin
    assert first.pipeline_runtime is not second.pipeline_runtime
    assert first.pipeline is None and first.context_parallel is None
    first.pipeline_runtime.stages.append(nn.Linear(1, 1))  # in place: a class-level list would be `second`'s too
    assert second.pipeline_runtime.stages == []
    first.model = _Net()
    first.pipeline_runtime.plan(first, LAYOUT, PipelineParameters(schedule="1F1B"), pp=2, pp_rank=0, batch=lambda: 8)
    assert len(first.pipeline_runtime.stages) == 1 and first.model.head is None
    assert second.pipeline_runtime.stages == [] and second.pipeline_runtime.whole is None
    assert "model" not in vars(second) and second.pipeline is None
    first.pipeline_runtime.pipeline = object()
    assert first.pipeline is first.pipeline_runtime.pipeline and second.pipeline is None
    mutable = {name for name, value in vars(DreamTrainer).items()
               if isinstance(value, (list, dict, set)) and not name.startswith("__")}
    assert mutable == set()


def test_the_runtime_imports_no_trainer_world_or_callback():
    imports = GRAPH["dream_trainer.pipeline.runtime"]
    assert "dream_trainer.pipeline.stages" in imports  # not vacuous
    assert [i for i in imports if i.split(".")[1] in ("trainer", "world", "callbacks", "configs")] == []

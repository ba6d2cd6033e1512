"""Pipeline parallelism (`torch.distributed.pipelining`) on the mesh's ``pp`` dimension:
the plan (schedules, expected bubbles, the automatic choice, the layer split) and the
stages (the cut of a declared model, and the schedule that runs them), and a trainer's
`PipelineRuntime` (its stages, from the cut to the running pipeline)."""

from dream_trainer.pipeline.plan import (
    SCHEDULES,
    PipelineChoice,
    PipelineParameters,
    choose_schedule,
    expected_bubble,
    split_layers,
    stage_ids,
)
from dream_trainer.pipeline.cost import DeviceCost, Estimate, ModelCost, cpu_gloo, cuda_nccl, estimate
from dream_trainer.pipeline.runtime import CostInputs, PipelineRuntime, check_untied
from dream_trainer.pipeline.stages import Pipeline, PipelineLayout, StageLayers, cut

__all__ = ["SCHEDULES", "CostInputs", "DeviceCost", "Estimate", "ModelCost", "Pipeline", "PipelineChoice",
           "PipelineLayout", "PipelineParameters", "PipelineRuntime", "StageLayers", "check_untied", "choose_schedule",
           "cpu_gloo", "cuda_nccl", "cut", "estimate", "expected_bubble", "split_layers", "stage_ids"]

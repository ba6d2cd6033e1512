"""Callbacks: the protocol (re-exported from `dream_trainer.protocol`) and the callbacks
that ship with dream_trainer.

Every shipped callback is named ``<what it does>Callback``. dream-trainer's names
`OptimizeFSDP` and `Fp8Quantization` (and `FindGraphBreaksCallback`, ..., which already
follow the rule) import too: each is the same class under a second name.

The shipped callbacks depend on the trainer and the protocol; neither depends on them. A
callback's optional dependency (torchao, torchft, rich) is imported only when that
callback is used.
"""

from __future__ import annotations

from dream_trainer.callbacks.checkpoint import CheckpointCallback
from dream_trainer.callbacks.compile_monitor import CompileMonitorCallback
from dream_trainer.fault_tolerance import FaultToleranceCallback
from dream_trainer.callbacks.fp8 import Float8Hardware, Fp8Quantization, Fp8QuantizationCallback, float8_hardware
from dream_trainer.callbacks.graph_breaks import FindGraphBreaksCallback
from dream_trainer.callbacks.logger import LoggerCallback
from dream_trainer.callbacks.monitors import (
    AnomalyDetectorCallback,
    GradientMonitorCallback,
    LossMonitorCallback,
    MemoryMonitorCallback,
    ThroughputMonitorCallback,
    TrainingDashboardCallback,
    health_callbacks,
)
from dream_trainer.callbacks.optimize_fsdp import OptimizeFSDPCallback, OptimizeFSDP
from dream_trainer.callbacks.performance import PerformanceReportCallback
from dream_trainer.callbacks.profile import ProfileCallback
from dream_trainer.callbacks.progress import ProgressBarCallback
from dream_trainer.callbacks.run_record import InitFromCheckpointCallback, RunRecordCallback
from dream_trainer.callbacks.step_window import StepWindowCallback
from dream_trainer.callbacks.trackers import MLflowLoggerCallback, WandbLoggerCallback
from dream_trainer.protocol import (
    CONTEXT_HOOKS,
    HOOKS,
    Callback,
    CallbackCollection,
    CallbackDependencyError,
    RankZeroCallback,
    SkipBatch,
    StopTraining,
)

__all__ = [
    "CONTEXT_HOOKS",
    "HOOKS",
    "AnomalyDetectorCallback",
    "Callback",
    "CallbackCollection",
    "CallbackDependencyError",
    "CheckpointCallback",
    "CompileMonitorCallback",
    "FaultToleranceCallback",
    "FindGraphBreaksCallback",
    "Float8Hardware",
    "Fp8QuantizationCallback",
    "Fp8Quantization",
    "GradientMonitorCallback",
    "LoggerCallback",
    "LossMonitorCallback",
    "MemoryMonitorCallback",
    "OptimizeFSDPCallback",
    "OptimizeFSDP",
    "PerformanceReportCallback",
    "ProfileCallback",
    "RunRecordCallback",
    "WandbLoggerCallback",
    "MLflowLoggerCallback",
    "InitFromCheckpointCallback",
    "ProgressBarCallback",
    "RankZeroCallback",
    "SkipBatch",
    "StepWindowCallback",
    "StopTraining",
    "ThroughputMonitorCallback",
    "TrainingDashboardCallback",
    "float8_hardware",
    "health_callbacks",
]


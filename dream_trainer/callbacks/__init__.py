"""Callbacks: the protocol and the callbacks that ship with dream_trainer.

The protocol (`Callback`, `RankZeroCallback`, `StopTraining`, `HOOKS`, `CallbackCollection`)
depends on nothing else in the package, and the trainer depends on it. The shipped
callbacks depend on the trainer, so they are loaded on first access
(``from dream_trainer.callbacks import CheckpointCallback``): importing the protocol never
imports the trainer, whatever module is imported first, and a callback's optional
dependency is imported only when that callback is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dream_trainer.callbacks.base import CONTEXT_HOOKS, HOOKS, Callback, RankZeroCallback, SkipBatch, StopTraining
from dream_trainer.callbacks.collection import CallbackCollection, CallbackDependencyError

if TYPE_CHECKING:
    from dream_trainer.callbacks.monitors import (
        AnomalyDetectorCallback,
        GradientMonitorCallback,
        LossMonitorCallback,
        MemoryMonitorCallback,
        ThroughputMonitorCallback,
        TrainingDashboardCallback,
        health_callbacks,
    )
    from dream_trainer.callbacks.checkpoint import CheckpointCallback
    from dream_trainer.callbacks.compile_monitor import CompileMonitor
    from dream_trainer.callbacks.fault_tolerance import FaultToleranceCallback
    from dream_trainer.callbacks.fp8 import Float8Hardware, Fp8Quantization, float8_hardware
    from dream_trainer.callbacks.graph_breaks import FindGraphBreaksCallback
    from dream_trainer.callbacks.logger import LoggerCallback
    from dream_trainer.callbacks.optimize_fsdp import OptimizeFSDP
    from dream_trainer.callbacks.performance import PerformanceReport
    from dream_trainer.callbacks.profile import ProfileCallback
    from dream_trainer.callbacks.progress import ProgressBar

_SHIPPED = {
    "AnomalyDetectorCallback": "dream_trainer.callbacks.monitors",
    "GradientMonitorCallback": "dream_trainer.callbacks.monitors",
    "LossMonitorCallback": "dream_trainer.callbacks.monitors",
    "MemoryMonitorCallback": "dream_trainer.callbacks.monitors",
    "ThroughputMonitorCallback": "dream_trainer.callbacks.monitors",
    "TrainingDashboardCallback": "dream_trainer.callbacks.monitors",
    "health_callbacks": "dream_trainer.callbacks.monitors",
    "CheckpointCallback": "dream_trainer.callbacks.checkpoint",
    "CompileMonitor": "dream_trainer.callbacks.compile_monitor",
    "FaultToleranceCallback": "dream_trainer.callbacks.fault_tolerance",
    "FindGraphBreaksCallback": "dream_trainer.callbacks.graph_breaks",
    "Fp8Quantization": "dream_trainer.callbacks.fp8",
    "Float8Hardware": "dream_trainer.callbacks.fp8",
    "float8_hardware": "dream_trainer.callbacks.fp8",
    "LoggerCallback": "dream_trainer.callbacks.logger",
    "OptimizeFSDP": "dream_trainer.callbacks.optimize_fsdp",
    "PerformanceReport": "dream_trainer.callbacks.performance",
    "ProfileCallback": "dream_trainer.callbacks.profile",
    "ProgressBar": "dream_trainer.callbacks.progress",
}

__all__ = [
    "CONTEXT_HOOKS",
    "HOOKS",
    "AnomalyDetectorCallback",
    "Callback",
    "CallbackCollection",
    "CallbackDependencyError",
    "CheckpointCallback",
    "CompileMonitor",
    "FaultToleranceCallback",
    "FindGraphBreaksCallback",
    "Float8Hardware",
    "Fp8Quantization",
    "GradientMonitorCallback",
    "LoggerCallback",
    "LossMonitorCallback",
    "MemoryMonitorCallback",
    "OptimizeFSDP",
    "PerformanceReport",
    "ProfileCallback",
    "ProgressBar",
    "RankZeroCallback",
    "SkipBatch",
    "StopTraining",
    "ThroughputMonitorCallback",
    "TrainingDashboardCallback",
    "float8_hardware",
    "health_callbacks",
]


def __getattr__(name: str) -> Any:
    if name in _SHIPPED:
        value = getattr(importlib.import_module(_SHIPPED[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

"""dream_trainer: a thin, typed PyTorch training loop; everything else is a callback."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dream_trainer._lazy import lazy_exports

if TYPE_CHECKING:  # what the names are, for type checkers; at run time each is imported on first use
    from dream_trainer.callbacks import (
        HOOKS,
        Callback,
        CallbackCollection,
        CallbackDependencyError,
        CheckpointCallback,
        FaultToleranceCallback,
        LoggerCallback,
        ProgressBarCallback,
        RankZeroCallback,
        SkipBatch,
        StopTraining,
    )
    from dream_trainer.checkpoint import CheckpointError, CheckpointInfo, list_checkpoints
    from dream_trainer.weights_io import export_model
    from dream_trainer.configs import (
        CheckpointParameters,
        DeviceParameters,
        FaultToleranceParameters,
        LoggingParameters,
        TrainerConfig,
        TrainingParameters,
    )
    from dream_trainer.fault_tolerance import FaultToleranceError, FaultTolerantWorld
    from dream_trainer.serialization import UnsafeStateError, allow_types
    from dream_trainer.launch import LaunchExit, LaunchResult, entrypoint
    from dream_trainer.run_identity import RunIdentity
    from dream_trainer.trainer import (
        EXIT_FAILED,
        EXIT_PREEMPTED,
        AbstractTrainer,
        BaseTrainer,
        CompiledModule,
        DreamTrainer,
        LogRecursionError,
        StepStats,
        TrainingInterrupted,
    )
    from dream_trainer.world import (
        DistributedWorld,
        MemoryStatus,
        MeshPlan,
        MeshPlanError,
        plan_mesh,
    )

_EXPORTS: dict[str, tuple[str, ...]] = {
    ".callbacks": (
        "HOOKS", "Callback", "CallbackCollection", "CallbackDependencyError", "CheckpointCallback",
        "FaultToleranceCallback", "LoggerCallback", "ProgressBarCallback", "RankZeroCallback", "SkipBatch",
        "StopTraining",
    ),
    ".checkpoint": ("CheckpointError", "CheckpointInfo", "list_checkpoints"),
    ".weights_io": ("export_model",),
    ".configs": (
        "CheckpointParameters", "DeviceParameters", "FaultToleranceParameters", "LoggingParameters", "TrainerConfig",
        "TrainingParameters",
    ),
    ".fault_tolerance": ("FaultToleranceError", "FaultTolerantWorld"),
    ".serialization": ("UnsafeStateError", "allow_types"),
    ".launch": ("LaunchExit", "LaunchResult", "entrypoint"),
    ".run_identity": ("RunIdentity",),
    ".trainer": (
        "EXIT_FAILED", "EXIT_PREEMPTED", "AbstractTrainer", "BaseTrainer", "CompiledModule", "DreamTrainer",
        "LogRecursionError", "StepStats", "TrainingInterrupted",
    ),
    ".world": ("DistributedWorld", "MemoryStatus", "MeshPlan", "MeshPlanError", "plan_mesh"),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

__version__ = "0.1.0"

__all__ = [
    "EXIT_FAILED",
    "EXIT_PREEMPTED",
    "HOOKS",
    "AbstractTrainer",
    "BaseTrainer",
    "Callback",
    "CallbackCollection",
    "CallbackDependencyError",
    "CheckpointCallback",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointParameters",
    "CompiledModule",
    "DeviceParameters",
    "DistributedWorld",
    "DreamTrainer",
    "FaultToleranceCallback",
    "FaultToleranceError",
    "FaultToleranceParameters",
    "FaultTolerantWorld",
    "LaunchExit",
    "LaunchResult",
    "LogRecursionError",
    "LoggerCallback",
    "LoggingParameters",
    "MemoryStatus",
    "MeshPlan",
    "MeshPlanError",
    "ProgressBarCallback",
    "RankZeroCallback",
    "RunIdentity",
    "SkipBatch",
    "StepStats",
    "StopTraining",
    "TrainerConfig",
    "TrainingInterrupted",
    "TrainingParameters",
    "UnsafeStateError",
    "allow_types",
    "entrypoint",
    "export_model",
    "list_checkpoints",
    "plan_mesh",
]

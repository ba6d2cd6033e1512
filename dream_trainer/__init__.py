"""dream_trainer: a thin, typed PyTorch training loop; everything else is a callback."""

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

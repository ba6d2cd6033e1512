"""dream_trainer: a thin, typed PyTorch training loop; everything else is a callback."""

from dream_trainer.callbacks import (
    HOOKS,
    Callback,
    CallbackCollection,
    CallbackDependencyError,
    LoggerCallback,
    ProgressBar,
    RankZeroCallback,
    StopTraining,
)
from dream_trainer.configs import DeviceParameters, LoggingParameters, TrainerConfig, TrainingParameters
from dream_trainer.launch import RunIdentity, entrypoint
from dream_trainer.trainer import AbstractTrainer, BaseTrainer, DreamTrainer, TrainingInterrupted
from dream_trainer.world import DistributedWorld, MeshPlan, MeshPlanError, plan_mesh

__version__ = "0.1.0"

__all__ = [
    "HOOKS",
    "AbstractTrainer",
    "BaseTrainer",
    "Callback",
    "CallbackCollection",
    "CallbackDependencyError",
    "DeviceParameters",
    "DistributedWorld",
    "DreamTrainer",
    "LoggerCallback",
    "LoggingParameters",
    "MeshPlan",
    "MeshPlanError",
    "ProgressBar",
    "RankZeroCallback",
    "RunIdentity",
    "StopTraining",
    "TrainerConfig",
    "TrainingInterrupted",
    "TrainingParameters",
    "entrypoint",
    "plan_mesh",
]

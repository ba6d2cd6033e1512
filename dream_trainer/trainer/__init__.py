"""Trainers: `AbstractTrainer` (counters, accessors), `BaseTrainer` (the loop) and
`DreamTrainer` (the model-build sequence)."""

from dream_trainer.trainer.abstract import AbstractTrainer
from dream_trainer.trainer.base import BaseTrainer
from dream_trainer.exits import EXIT_FAILED, EXIT_PREEMPTED
from dream_trainer.trainer.control import ControlPlane, TrainingInterrupted
from dream_trainer.trainer.dream import CompiledModule, DreamTrainer
from dream_trainer.trainer.metric_log import LogRecursionError
from dream_trainer.trainer.telemetry import StepStats

__all__ = [
    "EXIT_FAILED",
    "EXIT_PREEMPTED",
    "AbstractTrainer",
    "BaseTrainer",
    "CompiledModule",
    "ControlPlane",
    "DreamTrainer",
    "LogRecursionError",
    "StepStats",
    "TrainingInterrupted",
]

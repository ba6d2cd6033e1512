"""Trainers: `AbstractTrainer` (counters, accessors), `BaseTrainer` (the loop) and
`DreamTrainer` (the model-build pipeline)."""

from dream_trainer.trainer.abstract import AbstractTrainer
from dream_trainer.trainer.base import BaseTrainer
from dream_trainer.trainer.preemption import EXIT_FAILED, EXIT_PREEMPTED, TrainingInterrupted
from dream_trainer.trainer.dream import CompiledModule, DreamTrainer
from dream_trainer.trainer.metrics import LogRecursionError
from dream_trainer.trainer.telemetry import StepStats

__all__ = [
    "EXIT_FAILED",
    "EXIT_PREEMPTED",
    "AbstractTrainer",
    "BaseTrainer",
    "CompiledModule",
    "DreamTrainer",
    "LogRecursionError",
    "StepStats",
    "TrainingInterrupted",
]

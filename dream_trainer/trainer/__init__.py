"""Trainers: `AbstractTrainer` (counters, accessors), `BaseTrainer` (the loop) and
`DreamTrainer` (the model-build pipeline)."""

from dream_trainer.trainer.abstract import AbstractTrainer
from dream_trainer.trainer.base import BaseTrainer, TrainingInterrupted
from dream_trainer.trainer.dream import DreamTrainer

__all__ = ["AbstractTrainer", "BaseTrainer", "DreamTrainer", "TrainingInterrupted"]

"""Helpers for testing trainers and callbacks: `spawn_world`, `RecordingCallback`,
`ToyTrainer`."""

from dream_trainer.testing.recording import Call, RecordingCallback
from dream_trainer.testing.spawn import SpawnError, spawn_world
from dream_trainer.testing.toy import ToyTrainer, copy_full_, toy_data

__all__ = ["Call", "RecordingCallback", "SpawnError", "ToyTrainer", "copy_full_", "spawn_world", "toy_data"]

"""Helpers for testing trainers and callbacks: `spawn_world`, `RecordingCallback`,
`ToyTrainer`, `HostReadCounter`."""

from dream_trainer.testing.host_reads import HostRead, HostReadCounter, StepReads
from dream_trainer.testing.recording import Call, RecordingCallback
from dream_trainer.testing.spawn import SpawnError, spawn_world
from dream_trainer.testing.toy import ToyTrainer, copy_full_, toy_data

__all__ = ["Call", "HostRead", "HostReadCounter", "RecordingCallback", "SpawnError", "StepReads", "ToyTrainer", "copy_full_", "spawn_world", "toy_data"]

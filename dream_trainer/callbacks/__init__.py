"""Callbacks: the protocol and the callbacks that ship with dream_trainer."""

from dream_trainer.callbacks.base import CONTEXT_HOOKS, HOOKS, Callback, RankZeroCallback, StopTraining
from dream_trainer.callbacks.collection import CallbackCollection, CallbackDependencyError
from dream_trainer.callbacks.logging import LoggerCallback
from dream_trainer.callbacks.progress import ProgressBar

__all__ = [
    "CONTEXT_HOOKS",
    "HOOKS",
    "Callback",
    "CallbackCollection",
    "CallbackDependencyError",
    "LoggerCallback",
    "ProgressBar",
    "RankZeroCallback",
    "StopTraining",
]

"""The callback protocol: `Callback`, `RankZeroCallback`, `StopTraining`, `SkipBatch`,
`HOOKS` and `CallbackCollection` with its typed dispatch.

It imports nothing from the trainer, the world or the shipped callbacks (a test checks the
import graph): the trainer depends on the protocol, and the shipped callbacks depend on
both.
"""

from dream_trainer.protocol.base import CONTEXT_HOOKS, HOOKS, Callback, RankZeroCallback, SkipBatch, StopTraining
from dream_trainer.protocol.collection import CallbackCollection, CallbackDependencyError

__all__ = [
    "CONTEXT_HOOKS",
    "HOOKS",
    "Callback",
    "CallbackCollection",
    "CallbackDependencyError",
    "RankZeroCallback",
    "SkipBatch",
    "StopTraining",
]

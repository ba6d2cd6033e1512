"""The training-health suite: six single-purpose callbacks that publish through
``trainer.log_dict`` (so every sink sees the same numbers), and `health_callbacks` for all
of them at once. See ``docs/health.md``."""

from __future__ import annotations

from typing import Any

from dream_trainer.protocol.base import Callback
from dream_trainer.callbacks.monitors.anomaly import AnomalyDetectorCallback, AnomalyError
from dream_trainer.callbacks.monitors.dashboard import TrainingDashboardCallback
from dream_trainer.callbacks.monitors.gradient import GradientMonitorCallback
from dream_trainer.callbacks.monitors.loss import LossMonitorCallback
from dream_trainer.callbacks.monitors.memory import MemoryMonitorCallback
from dream_trainer.callbacks.monitors.throughput import ThroughputMonitorCallback

_KINDS = {
    "gradient": GradientMonitorCallback,
    "memory": MemoryMonitorCallback,
    "throughput": ThroughputMonitorCallback,
    "loss": LossMonitorCallback,
    "anomaly": AnomalyDetectorCallback,
    "dashboard": TrainingDashboardCallback,
}


def health_callbacks(**overrides: dict[str, Any] | bool) -> list[Callback[Any]]:
    """All six health callbacks with their defaults, for "full monitoring".

    ``health_callbacks(gradient={"log_interval": 10}, dashboard=False)``: a dict of keyword
    arguments changes one callback's settings, ``False`` leaves it out. The keys are
    ``gradient``, ``memory``, ``throughput``, ``loss``, ``anomaly`` and ``dashboard``.
    """
    unknown = sorted(set(overrides) - set(_KINDS))
    if unknown:
        raise TypeError(f"health_callbacks: unknown {unknown}; expected some of {list(_KINDS)}")
    out: list[Callback[Any]] = []
    for name, cls in _KINDS.items():
        option = overrides.get(name, {})
        if option is False:
            continue
        if option is True:
            option = {}
        if not isinstance(option, dict):
            raise TypeError(f"health_callbacks({name}={option!r}): expected a dict of keyword arguments, True or False")
        out.append(cls(**option))
    return out


__all__ = [
    "AnomalyDetectorCallback",
    "AnomalyError",
    "GradientMonitorCallback",
    "LossMonitorCallback",
    "MemoryMonitorCallback",
    "ThroughputMonitorCallback",
    "TrainingDashboardCallback",
    "health_callbacks",
]

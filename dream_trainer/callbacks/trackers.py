"""Experiment trackers beside TensorBoard: `WandbLoggerCallback` (Weights & Biases; offline
works with no network) and `MLflowLoggerCallback` (a local file store by default).

Both get what `LoggerCallback` gets: every `on_log` call's metrics at their step (the same
stream: train metrics on log steps, validation at the end of each validation). The
resolved config (``trainer.config`` as data, dotted keys) is the run's hyperparameters. The
tracker's run id is part of the callback's state, so it is saved in every checkpoint and a
resumed run continues the same tracker run. Rank 0 only; not critical: a tracker that
fails is logged and disabled, never stops training. The packages are optional extras
(``pip install "dream-trainer[wandb]"`` / ``"dream-trainer[mlflow]"``), checked when the
callback is made.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import time
from pathlib import Path
from typing import Any

from dream_trainer.callbacks.logger import LoggedTrainer, numbers_only
from dream_trainer.protocol.base import RankZeroCallback

logger = logging.getLogger(__name__)

__all__ = ["MLflowLoggerCallback", "WandbLoggerCallback", "hyperparameters"]


def hyperparameters(config: Any) -> dict[str, Any]:
    """`config` as flat ``{"training_parameters.max_steps": 100, ...}`` data (empty when it
    is not a dataclass); what is not a number, a bool or None is given as text."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        return {}
    from dream_trainer.config_files import config_to_data

    out: dict[str, Any] = {}

    def walk(data: dict[str, Any], prefix: str) -> None:
        for key, value in data.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                out[prefix + key] = value if isinstance(value, (bool, int, float, type(None))) else str(value)

    walk(config_to_data(config), "")
    return out


def _require(package: str, extra: str, owner: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise ImportError(f"{owner} needs the {package} package, which is not installed: pip install "
                          f"'dream-trainer[{extra}]' (or pip install {package})")


class _TrackerCallback(RankZeroCallback[LoggedTrainer]):
    """What both trackers share: start at `pre_fit` (after a resume restored `run_id`),
    log every `on_log`, finish at teardown; `run_id` in the checkpointed state."""

    critical = False

    def __init__(self) -> None:
        self.run_id: str | None = None
        self._refused: set[str] = set()
        self._active = False

    def pre_fit(self) -> None:
        if not self._active:
            self.run_id = self._start(hyperparameters(getattr(self.trainer, "config", None)))
            self._active = True

    def on_log(self, metrics: dict[str, float], step: int) -> None:
        if not self._active:
            self.pre_fit()
        values = numbers_only(metrics, step, self._refused, type(self).__name__)
        if values:
            self._log(values, step)

    def on_teardown(self, status: str) -> None:
        if self._active:
            self._active = False
            self._finish(status)

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run_id = state.get("run_id")

    def _start(self, params: dict[str, Any]) -> str: ...  # pragma: no cover - each tracker's
    def _log(self, metrics: dict[str, float], step: int) -> None: ...  # pragma: no cover
    def _finish(self, status: str) -> None: ...  # pragma: no cover


class WandbLoggerCallback(_TrackerCallback):
    """Log to Weights & Biases. ``mode="offline"`` (default) writes the run under
    ``<run_dir>/wandb`` with no network (upload it later with ``wandb sync``); ``"online"``
    needs a login. The W&B run is named after the trainer's run, its project is
    `project` (default: the experiment), and its id is kept in checkpoints: a resume
    continues that W&B run (``resume="allow"``). `init_kwargs` go to ``wandb.init``."""

    def __init__(self, project: str | None = None, mode: str = "offline", **init_kwargs: Any):
        _require("wandb", "wandb", "WandbLoggerCallback")
        if mode not in ("offline", "online", "disabled"):
            raise ValueError(f"WandbLoggerCallback(mode={mode!r}) is invalid: expected 'offline', 'online' or "
                             "'disabled'")
        super().__init__()
        self.project, self.mode, self.init_kwargs = project, mode, init_kwargs
        self._run: Any = None

    def _start(self, params: dict[str, Any]) -> str:
        import wandb

        trainer = self.trainer
        run_dir = Path(trainer.run_dir)
        self._run = wandb.init(
            project=self.project or getattr(getattr(trainer, "config", None), "experiment", None) or run_dir.parent.name,
            name=getattr(trainer, "run_name", run_dir.name), dir=str(run_dir), mode=self.mode, config=params,
            id=self.run_id, resume="allow", **self.init_kwargs)
        return str(self._run.id)

    def _log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def _finish(self, status: str) -> None:
        self._run.finish(exit_code=0 if status in ("completed", "stopped", "preempted") else 1)
        self._run = None


class MLflowLoggerCallback(_TrackerCallback):
    """Log to MLflow. `tracking_uri` default: a file store at ``<root_dir>/mlruns`` (every
    run of the root in one store: ``mlflow ui --backend-store-uri <root_dir>/mlruns``;
    MLflow 3 keeps the file store behind ``MLFLOW_ALLOW_FILE_STORE``, set for it here).
    The experiment is `experiment` (default: the trainer's), the MLflow run is named after
    the trainer's run, the config goes in as params, and the run id is kept in checkpoints:
    a resume logs into the same MLflow run."""

    def __init__(self, tracking_uri: str | None = None, experiment: str | None = None):
        _require("mlflow", "mlflow", "MLflowLoggerCallback")
        super().__init__()
        self.tracking_uri, self.experiment = tracking_uri, experiment
        self._client: Any = None

    def _start(self, params: dict[str, Any]) -> str:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        trainer = self.trainer
        config = getattr(trainer, "config", None)
        uri = self.tracking_uri
        if uri is None:
            root = Path(getattr(config, "root_dir", None) or Path(trainer.run_dir).parent.parent)
            uri = (root / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3: a local file store is opt-in
        self._client = client = MlflowClient(tracking_uri=uri)
        if self.run_id is not None:
            client.update_run(self.run_id, status="RUNNING")
            return self.run_id
        name = self.experiment or getattr(config, "experiment", None) or "default"
        found = client.get_experiment_by_name(name)
        experiment_id = found.experiment_id if found is not None else client.create_experiment(name)
        run = client.create_run(experiment_id, run_name=getattr(trainer, "run_name", None))
        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            client.log_batch(run.info.run_id, params=items[i:i + 100])
        return str(run.info.run_id)

    def _log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def _finish(self, status: str) -> None:
        self._client.set_terminated(self.run_id, status="FINISHED" if status in ("completed", "stopped") else
                                    "KILLED" if status == "preempted" else "FAILED")

"""`GradientMonitorCallback`: gradient norms, clipping and explosions."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from dream_trainer.callbacks.monitors._base import DeviceWindow, Monitor, check_int, more_steps, outliers

logger = logging.getLogger(__name__)


class GradientMonitorCallback(Monitor):
    """Gradient health, from the norm the trainer computes once per step.

    Every optimizer step the pre-clip total gradient norm (``trainer.step_stats.grad_norm``,
    DTensor-aware; several optimizers combine into one norm) joins a window kept on the
    device, and a clip event is counted on the device. On its log steps it logs:

    - ``train/grad_norm``: this step's norm; ``train/grad_norm_avg``: the window's mean;
    - ``train/clip_rate``: the share of steps since the start whose gradients were clipped,
      ``train/clip_events``: how many (0 without ``gradient_clip_val``);
    - with ``top_k_layers=k``: ``train/grad_norm/<parameter>`` for the k largest per-parameter
      norms of that step (on a sharded model: this rank's shard of each parameter).

    An explosion — a norm above mean + `explosion_threshold` x std of the window before it,
    once the window holds `min_history` norms — is warned about, naming the step. Detection
    reads the window on log steps, so it reports within `log_interval` steps and adds no
    sync on other steps.
    """

    def __init__(self, log_interval: int = 100, history_size: int = 100, explosion_threshold: float = 3.0,
                 min_history: int = 20, top_k_layers: int = 0):
        super().__init__(log_interval)
        check_int("GradientMonitorCallback", "history_size", history_size, 2)
        check_int("GradientMonitorCallback", "min_history", min_history, 2)
        check_int("GradientMonitorCallback", "top_k_layers", top_k_layers, 0)
        self.explosion_threshold, self.min_history, self.top_k_layers = explosion_threshold, min_history, top_k_layers
        # The norms are the trainer's fresh tensors: kept as they are (no device op per step).
        self.window = DeviceWindow(history_size, counters=1, keep=True)  # counter 0: clip events
        self.explosions: list[tuple[int, float, float]] = []  # (step, norm, limit)
        self._steps = 0
        self._checked_until = 0
        self._layer_norms: dict[str, torch.Tensor] = {}

    def post_setup(self) -> None:
        self.trainer.request_grad_norm()

    def pre_optimizer_step(self, model: Any, optimizer: Any) -> None:
        trainer = self.trainer
        if self.top_k_layers and model is not None and (trainer.global_step + 1) % self.log_interval == 0:
            named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
            if named:
                grads = [g.to_local() if hasattr(g, "to_local") else g for _, g in named]
                norms = torch._foreach_norm(grads)
                self._layer_norms.update({n: v for (n, _), v in zip(named, norms)})

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        if not self.step_done():
            return
        stats = self.trainer.step_stats
        norms = stats.grad_norm
        if not norms:
            return
        if len(norms) == 1:
            norm = next(iter(norms.values()))
        else:
            norm = torch.linalg.vector_norm(torch.stack([n.float() for n in norms.values()]))
        self.window.push(norm, stats.step)
        self._steps += 1
        if stats.clip_limit:  # a clipped step: `clipped` compares each norm with its limit
            for clipped in stats.clipped.values():
                self.window.add(0, clipped)  # counted on the device
        if self.trainer.global_step % self.log_interval == 0:
            self._log()

    def _log(self) -> None:
        trainer = self.trainer
        layers = list(self._layer_norms)
        # The one read of this log step: the window, the clip count and the layer norms.
        history, (events,), layer_norms = self.window.read(list(self._layer_norms.values()))
        self._layer_norms = {}
        finite = [v for _, v in history if math.isfinite(v)]
        metrics = {
            "train/grad_norm": history[-1][1],
            "train/grad_norm_avg": sum(finite) / len(finite) if finite else float("nan"),
            "train/clip_rate": events / self._steps,
            "train/clip_events": events,
        }
        top = sorted(zip(layers, layer_norms), key=lambda kv: -kv[1])[: self.top_k_layers]
        metrics.update({f"train/grad_norm/{name}": value for name, value in top})
        found = outliers(history, self._checked_until, self.explosion_threshold, self.min_history)
        if found:  # one warning per log step, however many steps were outliers
            self.explosions.extend(found)
            step, value, limit = found[0]
            logger.warning("gradient explosion at step %d: norm %.4g > %.4g (mean + %.1f std of the steps before)%s",
                           step, value, limit, self.explosion_threshold, more_steps(found))
        self._checked_until = history[-1][0]
        trainer.log_dict(metrics)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self._steps, "clip_events": self.window.counter_state()[0], "explosions": list(self.explosions)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._steps = int(state["steps"])
        self.window.load_counters([float(state["clip_events"])], self.trainer.world.device)
        self.explosions = [tuple(e) for e in state["explosions"]]  # type: ignore[misc]


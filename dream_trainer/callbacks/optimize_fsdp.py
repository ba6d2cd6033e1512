"""`OptimizeFSDPCallback`: explicit FSDP2 prefetching in the order the modules really run."""

from __future__ import annotations

import logging
import warnings
from typing import Any

from torch import nn

from dream_trainer.protocol.base import Callback
from dream_trainer.trainer.dream import DreamTrainer

logger = logging.getLogger(__name__)


class OptimizeFSDPCallback(Callback[DreamTrainer]):
    """Trace the order FSDP2 modules run in, then prefetch along it.

    During the first training step (more if some sharded module did not run yet, at most
    `max_trace_steps`), forward and backward hooks on every module of
    ``trainer.fsdp_modules(model)`` record the order their forward and their backward start
    in, per model. Then each module gets
    ``set_modules_to_forward_prefetch(next prefetch modules in forward order)`` and
    ``set_modules_to_backward_prefetch(next prefetch modules in backward order)``: its
    all-gather is issued that many modules ahead. ``prefetch=1`` is explicit one-ahead
    prefetching (FSDP2's implicit default only in backward); modules that never ran are
    left out. With `unshard_on_step`, each model's root starts ``unshard(async_op=True)``
    before every training and validation step, so the first all-gather overlaps the data
    transfer and the first ops. The traced orders are ``self.forward_order`` /
    ``self.backward_order`` (``{model: [module paths]}``, the root is ``""``), logged, and
    printed with `display`. Rank-independent: every rank traces the same order.
    """

    def __init__(self, prefetch: int = 1, display: bool = False, unshard_on_step: bool = True, max_trace_steps: int = 3):
        for name, value in (("prefetch", prefetch), ("max_trace_steps", max_trace_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"OptimizeFSDPCallback({name}={value!r}) is invalid: expected an int >= 1")
        self.prefetch, self.display, self.unshard_on_step, self.max_trace_steps = prefetch, display, unshard_on_step, max_trace_steps
        self.forward_order: dict[str, list[str]] = {}
        self.backward_order: dict[str, list[str]] = {}
        self.applied = False
        self._hooks: list[Any] = []
        self._traced_steps = 0
        self._sharded: dict[str, dict[str, nn.Module]] = {}

    def post_setup(self) -> None:
        trainer = self.trainer
        self._sharded = {name: trainer.fsdp_modules(name) for name in trainer.named_models()}
        self._sharded = {name: mods for name, mods in self._sharded.items() if mods}
        if not self._sharded:
            logger.warning("OptimizeFSDPCallback: no model is sharded with fully_shard (dp_shard=1?): nothing to do")
            return
        # The tracing hooks fire on module outputs whose inputs may not need gradients
        # (the first block's input): torch notes it once; it is expected here.
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
        for model, modules in self._sharded.items():
            self.forward_order[model], self.backward_order[model] = [], []
            for path, module in modules.items():
                self._hooks.append(module.register_forward_pre_hook(self._record(self.forward_order[model], path)))
                self._hooks.append(module.register_full_backward_pre_hook(self._record(self.backward_order[model], path)))

    @staticmethod
    def _record(order: list[str], path: str) -> Any:
        def hook(module: nn.Module, *_: Any) -> None:
            if path not in order:
                order.append(path)

        return hook

    def pre_train_step(self, batch: Any, batch_idx: int) -> None:
        if self.applied and self.unshard_on_step:
            self._unshard_roots()

    def pre_validation_step(self, batch: Any, batch_idx: int) -> None:
        if self.applied and self.unshard_on_step:
            self._unshard_roots()

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        if not self._hooks or self.trainer.is_accumulating_gradients:
            return
        self._traced_steps += 1
        complete = all(
            len(self.forward_order[m]) == len(mods) and len(self.backward_order[m]) == len(mods)
            for m, mods in self._sharded.items()
        )
        if complete or self._traced_steps >= self.max_trace_steps:
            for handle in self._hooks:
                handle.remove()
            self._hooks = []
            self._apply()

    def _apply(self) -> None:
        lines = []
        for model, modules in self._sharded.items():
            forward = [modules[p] for p in self.forward_order[model]]
            backward = [modules[p] for p in self.backward_order[model]]
            for order, setter in ((forward, "set_modules_to_forward_prefetch"), (backward, "set_modules_to_backward_prefetch")):
                for i, module in enumerate(order):
                    getattr(module, setter)(order[i + 1 : i + 1 + self.prefetch])
            never = sorted(set(modules) - set(self.forward_order[model]))
            lines.append(
                f"{model}: forward {_names(self.forward_order[model])}; backward {_names(self.backward_order[model])}"
                + (f"; never ran (not prefetched): {_names(never)}" if never else "")
            )
        self.applied = True
        text = f"OptimizeFSDPCallback(prefetch={self.prefetch}) traced order:\n  " + "\n  ".join(lines)
        logger.info("%s", text)
        if self.display and self.trainer.world.rank == 0:
            print(text)

    def _unshard_roots(self) -> None:
        for model, modules in self._sharded.items():
            root = modules.get("")
            if root is not None:
                root.unshard(async_op=True)  # type: ignore[operator]


def _names(paths: list[str]) -> str:
    return "[" + ", ".join(p or "<root>" for p in paths) + "]"


OptimizeFSDP = OptimizeFSDPCallback
"""`OptimizeFSDPCallback` under dream-trainer's name (the same class)."""

"""`RecordingCallback`: records every hook call, in order."""

from __future__ import annotations

from collections import Counter
from typing import Any, NamedTuple

from dream_trainer.protocol.base import HOOKS, Callback


class Call(NamedTuple):
    """One recorded hook call."""

    hook: str
    global_step: int
    epoch: int
    batch_idx: int | None
    sanity: bool
    accumulating: bool


def _recorder(hook: str) -> Any:
    def record(self: RecordingCallback, *args: Any) -> None:
        trainer = self.trainer
        batch_idx = args[-1] if hook.endswith("_step") and hook.startswith(("pre_t", "post_t", "pre_v", "post_v")) else None
        self.calls.append(
            Call(
                hook,
                int(getattr(trainer, "global_step", 0)),
                int(getattr(trainer, "current_epoch", 0)),
                batch_idx,
                bool(getattr(trainer, "sanity_checking", False)),
                bool(getattr(trainer, "is_accumulating_gradients", False)),
            )
        )
        if hook == "on_log":
            self.logs.append((args[1], dict(args[0])))

    record.__name__ = record.__qualname__ = hook
    return record


class RecordingCallback(Callback[Any]):
    """Overrides every hook in `HOOKS` and appends a `Call` to ``self.calls`` per call;
    `on_log` payloads also go to ``self.logs`` as ``(step, metrics)``."""

    for _hook in HOOKS:
        locals()[_hook] = _recorder(_hook)
    del _hook

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.logs: list[tuple[int, dict[str, float]]] = []

    @property
    def hooks(self) -> list[str]:
        """The hook names, in call order."""
        return [call.hook for call in self.calls]

    def counts(self) -> Counter[str]:
        return Counter(self.hooks)

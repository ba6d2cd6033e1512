"""A step pays only for what it uses: on one rank with no per-step callback hooks, no
clipping and a world without step seams, the loop dispatches no hook, enters no collective
region, marks nothing for the watchdog and calls neither seam; each of those comes back as
soon as something uses it."""

from __future__ import annotations

import math
import sys
from collections import Counter
from typing import Any

import pytest
import torch

from dream_trainer import Callback, DeviceParameters, LoggingParameters, TrainerConfig, TrainingParameters
from dream_trainer.testing import ToyTrainer
from dream_trainer.world.world import DistributedWorld

NOT_ON_A_PLAIN_STEP = {
    ("dream_trainer.protocol.dispatch", name) for name in (
        "on_step_begin", "pre_train_step", "post_train_step", "on_step_end", "pre_optimizer_step",
        "post_optimizer_step", "pre_optimizer_zero_grad", "post_optimizer_zero_grad")
} | {
    ("dream_trainer.world.watchdog", name) for name in ("region", "enter", "batch_arrived", "compute_starts",
                                                        "step_work", "step_ended")
} | {
    ("dream_trainer.world.world", "sync_gradients"), ("dream_trainer.world.world", "agree_on_step"),
    ("dream_trainer.world.stragglers", "add"), ("dream_trainer.trainer.stepping", "before_backward"),
    ("dream_trainer.trainer.goodput", "fetching"),  # the ledger reads the step path's clock: no call per fetch
    ("dream_trainer.trainer.telemetry", "count_batch"), ("dream_trainer.trainer.step_path", "count"),  # nobody asked
}


def _trainer(tmp_path: Any, callbacks: tuple[Callback[Any], ...] = (), clip: float | None = None,
             log_every: int = 50, **kwargs: Any) -> ToyTrainer:
    return ToyTrainer(TrainerConfig(
        root_dir=str(tmp_path), device_parameters=DeviceParameters.SINGLE_DEVICE(),
        training_parameters=TrainingParameters(n_epochs=1, max_steps=8, num_sanity_val_steps=0,
                                               gradient_clip_val=clip),
        logging_parameters=LoggingParameters(log_every_n_steps=log_every), callbacks=list(callbacks)),
        with_validation=False, **kwargs)


class _Calls(Callback[Any]):
    """Counts the framework's calls (module, function) from the end of step 2 to the start of
    step 7 (steps 3 to 6: no log step at `log_every_n_steps=50`); overrides nothing per step
    itself (the profile starts in `post_setup` and is filtered by step)."""

    def __init__(self) -> None:
        self.calls: Counter[tuple[str, str]] = Counter()
        self.on = False

    def post_setup(self) -> None:
        sys.setprofile(self._trace)

    def post_fit(self) -> None:
        sys.setprofile(None)

    def _trace(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        if frame.f_code.co_name == "_open_batch":  # a batch arrives: steps 3-6 are counted
            self.on = 3 <= self.trainer.global_step + 1 <= 6
        module = frame.f_globals.get("__name__", "")
        if self.on and module.startswith("dream_trainer") and not module.startswith("dream_trainer.testing"):
            self.calls[(module, frame.f_code.co_name)] += 1


def test_a_plain_one_rank_step_dispatches_no_hook_region_mark_or_seam(tmp_path):
    calls = _Calls()
    trainer = _trainer(tmp_path, (calls,))
    try:
        trainer.fit()
    finally:
        sys.setprofile(None)
    assert trainer.status == "completed" and trainer.global_step == 8
    assert calls.calls, "nothing was traced"
    made = sorted(set(calls.calls) & NOT_ON_A_PLAIN_STEP)
    assert not made, made
    assert not trainer.world.collectives.tracking and not trainer.world.step_seams
    per_step = sum(calls.calls.values()) / 4
    assert per_step <= 25, (per_step, calls.calls.most_common())  # 20 here; 31 before the ledger read the path's clock, 66 before the flat path


class _StepHooks(Callback[Any]):
    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_step_end(self, step: int) -> None:
        self.seen.append(f"end {step}")

    def post_optimizer_zero_grad(self, model: Any, optimizer: Any) -> None:
        self.seen.append("zero_grad")


class _SeamWorld(DistributedWorld):
    """A world with a gradient seam of its own (no `step_seams` flag set by hand)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.synced = 0

    def sync_gradients(self, parameters: list[torch.nn.Parameter]) -> None:
        self.synced += 1


class _UseSeamWorld(Callback[Any]):
    def __init__(self, world: DistributedWorld) -> None:
        self.world = world

    def pre_launch(self) -> None:
        self.trainer.set_world(self.world)


def test_what_a_step_uses_comes_back(tmp_path):
    hooks = _StepHooks()
    world = _SeamWorld(DeviceParameters.SINGLE_DEVICE())
    assert world.step_seams and not DistributedWorld(DeviceParameters.SINGLE_DEVICE()).step_seams
    trainer = _trainer(tmp_path, (hooks, _UseSeamWorld(world)), clip=1e-6)
    trainer.fit()
    assert hooks.seen == [x for s in range(1, 9) for x in ("zero_grad", f"end {s}")]
    assert world.synced == 8  # the seam of a subclass is called on every step
    norm = trainer.step_stats.grad_norm["optimizer"]
    assert bool(norm > 1e-6) and trainer.step_stats.clipped["optimizer"]  # clipping still clips


@pytest.mark.parametrize("log_grad_norm", [False, True])
def test_the_gradient_norm_is_computed_on_log_steps_only_when_logged(tmp_path, log_grad_norm):
    norms: dict[int, bool] = {}

    class Norms(Callback[Any]):
        def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
            norms[self.trainer.global_step] = "optimizer" in self.trainer.step_stats.grad_norm

    trainer = ToyTrainer(TrainerConfig(
        root_dir=str(tmp_path), device_parameters=DeviceParameters.SINGLE_DEVICE(),
        training_parameters=TrainingParameters(n_epochs=1, max_steps=4, num_sanity_val_steps=0),
        logging_parameters=LoggingParameters(log_every_n_steps=2, log_grad_norm=log_grad_norm),
        callbacks=[Norms()]), with_validation=False)
    trainer.fit()
    assert norms == {1: False, 2: log_grad_norm, 3: False, 4: log_grad_norm}


def test_a_skip_step_no_optimizer_step_took_is_an_error_at_the_steps_end(tmp_path):
    class Forgets(ToyTrainer):
        vetoes_steps = True

        def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
            self.skip_step("never taken")
            return {}

    trainer = Forgets(TrainerConfig(
        root_dir=str(tmp_path), device_parameters=DeviceParameters.SINGLE_DEVICE(),
        training_parameters=TrainingParameters(n_epochs=1, max_steps=2, num_sanity_val_steps=0)),
        with_validation=False)
    with pytest.raises(RuntimeError, match=r"skip_step\(\) was called but no trainer.step\(optimizer\) followed"):
        trainer.fit()
    assert not trainer.step_path.veto_pending  # cleared: a later fit() does not inherit it


class _Times(Callback[Any]):
    """Reads the step's times after every step; asks for them from step 4 on."""

    def __init__(self) -> None:
        self.times: dict[int, tuple[float, float]] = {}

    def on_step_end(self, step: int) -> None:
        stats = self.trainer.step_stats
        self.times[step] = (stats.compute_s, stats.optimizer_s)
        if step == 3:
            self.trainer.request_step_times()


def test_step_times_are_measured_once_asked_for_and_nan_until_then(tmp_path):
    times = _Times()
    _trainer(tmp_path, (times,)).fit()
    assert all(math.isnan(c) and math.isnan(o) for step, (c, o) in times.times.items() if step <= 3)
    measured = [times.times[step] for step in range(4, 9)]  # from the next step on
    assert all(c > 0 and 0 < o < c for c, o in measured), measured  # the optimizer's part is inside the compute


class _PostOnly(Callback[Any]):
    """Overrides one per-step hook, as most monitors do."""

    def __init__(self) -> None:
        self.steps = 0

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        self.steps += 1


def test_a_callback_with_one_step_hook_makes_the_step_dispatch_that_hook_only(tmp_path):
    calls, post = _Calls(), _PostOnly()
    trainer = _trainer(tmp_path, (calls, post))
    try:
        trainer.fit()
    finally:
        sys.setprofile(None)
    assert post.steps == 8 and "post_train_step" in trainer.callbacks.overridden
    dispatched = {name for module, name in calls.calls if module == "dream_trainer.protocol.dispatch"}
    assert dispatched == {"post_train_step"}, dispatched  # no empty on_step_begin, pre_train_step, on_step_end...

"""Stragglers named at log steps (`dream_trainer.world.stragglers`): two gloo ranks, a real
trainer (DDP); rank 1's training_step sleeps before its forward, so its work before the
step's first collective (the backward's gradient reduction) is much longer than rank 0's.
Rank 0 logs a warning naming rank 1, and both log it as a metric; rank 0 is never named."""

from __future__ import annotations

import logging
import time

from dream_trainer import DeviceParameters, LoggingParameters, TrainerConfig, TrainingParameters
from dream_trainer.protocol.base import Callback
from dream_trainer.testing import ToyTrainer, spawn_world

SLEEP_S = 0.2


class SlowRankOne(ToyTrainer):
    def training_step(self, batch, batch_idx):
        if self.world.rank == 1:
            time.sleep(SLEEP_S)  # a slow host: its work before the gradient reduction
        return super().training_step(batch, batch_idx)


class Metrics(Callback):
    def __init__(self):
        self.seen: list[tuple[int, dict[str, float]]] = []

    def on_log(self, metrics, step):
        self.seen.append((step, {k: v for k, v in metrics.items() if "straggler" in k}))


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _run(root, factor):
    handler, metrics = Records(), Metrics()
    logging.getLogger("dream_trainer.world.stragglers").addHandler(handler)
    params = DeviceParameters.DDP(straggler_factor=factor)
    config = TrainerConfig(root_dir=str(root), run_name="s", device_parameters=params, callbacks=[metrics],
                           training_parameters=TrainingParameters(n_epochs=1, num_sanity_val_steps=0,
                                                                  validate_at_epoch_end=False),
                           logging_parameters=LoggingParameters(log_every_n_steps=2))
    SlowRankOne(config, batch_size=8, with_validation=False).fit()
    return handler.messages, metrics.seen


def test_a_rank_slowed_by_a_sleep_is_named_as_a_straggler(tmp_path):
    (warnings0, seen0), (warnings1, seen1) = spawn_world(2, _run, str(tmp_path), 1.5, timeout=120)
    steps = [step for step, _ in seen0 if _]
    # The trainer's log steps (12 steps: 192 samples / 2 ranks / 8) after the 2 warm-up steps.
    assert steps == [4, 6, 8, 10, 12], seen0
    assert [m for _, m in seen0] == [m for _, m in seen1]  # the same values on every rank
    for _, values in seen0:
        if values:
            assert values["train/straggler_rank"] == 1.0 and values["train/straggler_ratio"] > 1.5, values
    assert len(warnings0) == 5 and warnings1 == [], (warnings0, warnings1)  # named on rank 0 only
    for message in warnings0:
        assert message.startswith("rank 1 (node 0, host ") and " is a straggler: compute " in message, message
        assert "ms/step vs median " in message and "ms of the other ranks (straggler_factor=1.5)" in message
        assert float(message.split("compute ")[1].split(" ms/step")[0]) >= SLEEP_S * 1e3


def test_no_straggler_report_when_it_is_off(tmp_path):
    (warnings0, seen0), _ = spawn_world(2, _run, str(tmp_path), None, timeout=120)
    assert warnings0 == [] and all(not values for _, values in seen0), seen0

"""Decisions taken on one rank, acted on by both (2 gloo ranks, DDP): a StopTraining from a
rank-zero callback, a request_stop from one rank's training step, a non-critical callback
that keeps failing on one rank; and callback state that differs per rank survives resume."""

from pathlib import Path

from dream_trainer import (
    Callback,
    CheckpointCallback,
    CheckpointParameters,
    DeviceParameters,
    RankZeroCallback,
    StopTraining,
    TrainerConfig,
    TrainingParameters,
    list_checkpoints,
)
from dream_trainer.testing import ToyTrainer, spawn_world


class EarlyStop(RankZeroCallback):
    """Early stopping decided on rank 0 only."""

    def post_train_step(self, result, batch_idx):
        if self.trainer.global_step == 5:
            raise StopTraining("val loss plateaued")


class Steps(Callback):
    """Per-rank state: the sum of global steps this rank saw, offset by its rank."""

    def __init__(self):
        self.total = 0
        self.loaded = None

    def post_train_step(self, result, batch_idx):
        self.total += self.trainer.global_step + 1000 * self.trainer.world.rank

    def state_dict(self):
        return {"total": self.total, "rank": self.trainer.world.rank}

    def load_state_dict(self, state):
        self.loaded = dict(state)
        self.total = state["total"]


def _fit(root, callbacks, max_steps=None, trainer_cls=ToyTrainer, every=None):
    saver = CheckpointCallback(CheckpointParameters(root_dir=str(root / "ckpt"), every_n_steps=every))
    config = TrainerConfig(
        root_dir=str(root / "runs"),
        run_name="r",
        device_parameters=DeviceParameters.DDP(),
        training_parameters=TrainingParameters(n_epochs=3, max_steps=max_steps, num_sanity_val_steps=0),
        callbacks=[*callbacks, saver],
    )
    trainer = trainer_cls(config, batch_size=8)
    trainer.fit()
    return trainer, saver


def _stop_on_rank_zero(root):
    trainer, saver = _fit(Path(root), [EarlyStop()])
    return trainer.status, trainer.stop_reason, trainer.global_step, [p.name for p in saver.saved]


def test_stop_training_on_one_rank_stops_both_at_the_same_step(tmp_path):
    results = spawn_world(2, _stop_on_rank_zero, str(tmp_path), timeout=90)
    # Asked at step 5 on rank 0; agreed without a host wait at the next boundary.
    assert [r[:3] for r in results] == [("stopped", "val loss plateaued", 6)] * 2
    assert results[0][3] == ["step_000000006"]  # committed by rank 0 in post_fit
    assert [i.step for i in list_checkpoints(tmp_path / "ckpt")] == [6]
    assert not [p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".staging")]


class RequestsInStep(ToyTrainer):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        if self.world.rank == 1 and self.global_step == 3:
            self.request_stop("rank 1 saw bad data")
        return out


def _request_on_rank_one(root):
    trainer, _ = _fit(Path(root), [], trainer_cls=RequestsInStep)
    return trainer.status, trainer.stop_reason, trainer.global_step


def test_request_stop_in_one_ranks_step(tmp_path):
    results = spawn_world(2, _request_on_rank_one, str(tmp_path), timeout=90)
    # Asked during step 4 (global_step is 3 inside it) on rank 1; the flag goes out at the
    # end of step 4 and is read, without a host wait, at the end of step 5 on both ranks.
    assert results == [("stopped", "rank 1 saw bad data", 5)] * 2  # the same step and reason everywhere


class FailsOnRankOne(Callback):
    critical = False

    def __init__(self):
        self.calls = []

    def post_train_step(self, result, batch_idx):
        self.calls.append(self.trainer.global_step)
        if self.trainer.world.rank == 1 and self.trainer.global_step >= 2:
            raise RuntimeError("flaky on rank 1")


class Disabled(Callback):
    """Listens for the disabling event (what a dashboard shows)."""

    def __init__(self):
        self.events = []

    def on_callback_disabled(self, name, reason):
        self.events.append((self.trainer.global_step, name, reason))


def _failing_on_one_rank(root):
    flaky, listener = FailsOnRankOne(), Disabled()
    trainer, _ = _fit(Path(root), [flaky, listener], max_steps=12)
    return trainer.status, trainer.global_step, flaky.calls, "FailsOnRankOne" in trainer.callbacks, listener.events


def test_failing_non_critical_callback_is_disabled_on_every_rank_at_once(tmp_path):
    zero, one = spawn_world(2, _failing_on_one_rank, str(tmp_path), timeout=90)
    assert zero[:2] == one[:2] == ("completed", 12)
    # Fails at steps 2, 3, 4 on rank 1 (3 consecutive failures): disabled on both ranks
    # at the boundary after that (non-blocking agreement): both stop calling it after step 5.
    assert zero[2] == one[2] == [1, 2, 3, 4, 5]
    assert not zero[3] and not one[3]
    assert zero[4] == one[4] == [(5, "FailsOnRankOne", "3 consecutive failures")]  # the event, on both ranks


def _per_rank_state(root, max_steps):
    steps = Steps()
    trainer, _ = _fit(Path(root), [steps], max_steps=max_steps, every=4)
    return steps.total, steps.loaded


def test_callback_state_is_per_rank(tmp_path):
    first = spawn_world(2, _per_rank_state, str(tmp_path), 8, timeout=90)
    second = spawn_world(2, _per_rank_state, str(tmp_path), 10, timeout=90)
    for rank in (0, 1):
        saved_total, _ = first[rank]
        total, loaded = second[rank]
        assert loaded == {"total": saved_total, "rank": rank}  # its own state, not rank 0's
        assert total == saved_total + (9 + 1000 * rank) + (10 + 1000 * rank)

"""CallbackCollection: dispatch, dependencies, naming, mutation during dispatch, state, errors."""

import logging
import types
from typing import Protocol, runtime_checkable

import pytest

from dream_trainer import Callback, CallbackCollection, CallbackDependencyError, RankZeroCallback, StopTraining
from dream_trainer.protocol.base import HOOKS


class TrainerA:
    global_step = 0


class TrainerB:
    global_step = 0


@runtime_checkable
class HasModel(Protocol):
    model: object


class OnlyPreStep(Callback[TrainerA]):
    def __init__(self):
        self.seen = []

    def pre_train_step(self, batch, batch_idx):
        self.seen.append(batch_idx)


def test_only_overridden_hooks_are_dispatched():
    cb = OnlyPreStep()
    col = CallbackCollection([cb])
    col.initialize(TrainerA())
    assert type(cb).overridden_hooks() == ("pre_train_step",)
    for hook in HOOKS:
        listeners = getattr(col, "_h_" + hook)
        assert len(listeners) == (1 if hook == "pre_train_step" else 0), hook
    col.pre_train_step("batch", 3)
    col.post_train_step({}, 3)
    assert cb.seen == [3]


def test_dependency_mismatch_names_callback_and_both_types():
    col = CallbackCollection([OnlyPreStep()])
    with pytest.raises(CallbackDependencyError) as err:
        col.initialize(TrainerB())
    msg = str(err.value)
    assert "OnlyPreStep" in msg and "TrainerA" in msg and "TrainerB" in msg


def test_protocol_dependency():
    class NeedsModel(Callback[HasModel]):
        pass

    ok = TrainerA()
    ok.model = object()
    CallbackCollection([NeedsModel()]).initialize(ok)
    with pytest.raises(CallbackDependencyError, match="protocol HasModel"):
        CallbackCollection([NeedsModel()]).initialize(TrainerB())


def test_names_never_collide():
    a, b, c = OnlyPreStep(), OnlyPreStep(), OnlyPreStep()
    col = CallbackCollection([a, b])
    assert col.names() == ["OnlyPreStep", "OnlyPreStep_1"]
    assert col.add(c) == "OnlyPreStep_2"
    with pytest.raises(ValueError, match="already registered"):
        col.add(OnlyPreStep(), name="OnlyPreStep")
    with pytest.raises(ValueError, match="already in the collection"):
        col.add(a)
    assert col["OnlyPreStep_1"] is b and col[OnlyPreStep] is a
    named = CallbackCollection({"first": a, "second": b})
    assert named.names() == ["first", "second"]


def test_order_attribute():
    class Late(Callback):
        order = 10

    class Early(Callback):
        order = -10

    col = CallbackCollection([Late(), OnlyPreStep(), Early()])
    assert col.names() == ["Early", "OnlyPreStep", "Late"]


def test_self_removal_and_addition_during_dispatch():
    calls = []

    class RemovesItself(Callback):
        def pre_train_step(self, batch, batch_idx):
            calls.append("remover")
            col.remove(self)
            col.add(Added())

    class After(Callback):
        def pre_train_step(self, batch, batch_idx):
            calls.append("after")

    class Added(Callback):
        def pre_train_step(self, batch, batch_idx):
            calls.append("added")

    col = CallbackCollection([RemovesItself(), After()])
    col.initialize(TrainerA())
    col.pre_train_step(None, 0)
    assert calls == ["remover", "after"]  # the snapshot finished; nobody skipped
    col.pre_train_step(None, 1)
    assert calls == ["remover", "after", "after", "added"]
    assert col.names() == ["After", "Added"]


def test_state_dict_round_trip_and_missing_callback_warns(caplog):
    class Counter(Callback):
        def __init__(self):
            self.n = 0

        def pre_train_step(self, batch, batch_idx):
            self.n += 1

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, state):
            self.n = state["n"]

    src = CallbackCollection([Counter()])
    src.initialize(TrainerA())
    for i in range(3):
        src.pre_train_step(None, i)
    state = src.state_dict()
    assert state == {"Counter": {"n": 3}}  # stateless callbacks are left out
    dst = CallbackCollection([Counter(), OnlyPreStep()])
    dst.load_state_dict(state)
    assert dst["Counter"].n == 3
    with caplog.at_level(logging.WARNING):
        CallbackCollection([OnlyPreStep()]).load_state_dict(state)
    assert "Counter" in caplog.text and "ignored" in caplog.text


def test_rank_zero_callback_runs_on_rank_zero_only():
    class R0(RankZeroCallback):
        def __init__(self):
            self.n = 0

        def pre_fit(self):
            self.n += 1

    r0, r1 = R0(), R0()
    c0, c1 = CallbackCollection([r0]), CallbackCollection([r1])
    c0.initialize(TrainerA(), global_rank=0)
    c1.initialize(TrainerA(), global_rank=1)
    c0.pre_fit()
    c1.pre_fit()
    assert (r0.n, r1.n) == (1, 0)


class Flaky(Callback):
    critical = False
    max_consecutive_failures = 3

    def __init__(self):
        self.calls = 0

    def pre_train_step(self, batch, batch_idx):
        self.calls += 1
        raise RuntimeError("boom")


def test_non_critical_failure_is_logged_once_then_disabled(caplog):
    trainer = TrainerA()
    flaky, good = Flaky(), OnlyPreStep()
    col = CallbackCollection([flaky, good])
    col.initialize(trainer)
    with caplog.at_level(logging.WARNING):
        for step in range(5):
            trainer.global_step = step
            col.pre_train_step(None, step)
    assert flaky.calls == 3  # disabled after 3 consecutive failures
    assert good.seen == [0, 1, 2, 3, 4]  # the others keep running
    assert "Flaky" not in col
    assert caplog.text.count("Traceback") == 1
    assert "disabling callback 'Flaky'" in caplog.text


def test_non_consecutive_failures_do_not_disable():
    trainer = TrainerA()
    flaky = Flaky()
    col = CallbackCollection([flaky])
    col.initialize(trainer)
    for step in range(0, 20, 2):  # a failure every other step
        trainer.global_step = step
        col.pre_train_step(None, step)
    assert flaky.calls == 10 and "Flaky" in col


def test_critical_failure_and_stop_training_propagate():
    class Critical(Callback):
        def pre_fit(self):
            raise ValueError("critical")

    class Stopper(Callback):
        critical = False

        def pre_fit(self):
            raise StopTraining("enough")

    with pytest.raises(ValueError, match="critical"):
        col = CallbackCollection([Critical()])
        col.initialize(TrainerA())
        col.pre_fit()
    col = CallbackCollection([Stopper()])
    col.initialize(TrainerA())
    with pytest.raises(StopTraining, match="enough"):
        col.pre_fit()


def test_bad_inputs():
    with pytest.raises(TypeError, match="expected a dream_trainer Callback"):
        CallbackCollection([object()])
    with pytest.raises(ValueError, match="invalid"):
        CallbackCollection().add(OnlyPreStep(), name="has space")
    with pytest.raises(KeyError, match="registered"):
        CallbackCollection().remove("nope")


def test_a_hook_with_the_wrong_signature_fails_when_added():
    class OldStyle(Callback):
        def on_interrupt(self):  # before on_interrupt received the error
            pass

    class Fine(Callback):
        def on_interrupt(self, error, *rest):
            pass

        def post_train_step(self, *args, **kwargs):
            pass

    with pytest.raises(TypeError, match=r"OldStyle.on_interrupt\(self\) does not take the hook's arguments: expected on_interrupt\(self, error"):
        CallbackCollection([OldStyle()])
    assert "Fine" in CallbackCollection([Fine()])


def test_generic_callbacks_need_small_trainer_protocols_not_a_trainer_class(tmp_path):
    """The generic shipped callbacks declare the protocol pieces they use: any object with
    those members is accepted (not only an `AbstractTrainer`); a member the trainer's class
    declares, set later in the lifecycle (``run_dir`` at launch), counts; the error names
    what is missing."""
    from pathlib import Path

    from dream_trainer.callbacks import LoggerCallback, ProfileCallback, ProgressBarCallback
    from dream_trainer.callbacks.profile import ProfiledTrainer

    class Minimal:  # no trainer class at all
        run_dir: Path  # declared: set at launch
        global_step, current_epoch, is_accumulating_gradients = 0, 0, False
        logged_metrics, display_fields = {}, {}
        world = types.SimpleNamespace(rank=0, device="cpu")

        def log_dict(self, metrics):
            pass

    assert not hasattr(Minimal(), "run_dir")
    with pytest.raises(CallbackDependencyError, match=r"protocol ProfiledTrainer \(missing: request_stop\)"):
        CallbackCollection([ProfileCallback()]).initialize(Minimal(), global_rank=0)

    class WithStop(Minimal):
        def request_stop(self, reason="stop requested"):
            pass

    CallbackCollection([ProfileCallback(), LoggerCallback(), ProgressBarCallback()]).initialize(WithStop(), global_rank=0)
    assert ProfiledTrainer.__module__ == "dream_trainer.callbacks.profile"
    for callback in (ProfileCallback, LoggerCallback, ProgressBarCallback):
        assert getattr(callback.trainer_requirement(), "_is_protocol", False), callback


def test_looking_a_callback_up_by_a_former_or_mistyped_name_suggests_the_registered_one():
    import pytest

    from dream_trainer.callbacks import ProgressBarCallback
    from dream_trainer.protocol.collection import CallbackCollection

    callbacks = CallbackCollection([ProgressBarCallback()])
    with pytest.raises(KeyError, match="no callback 'ProgressBar' \\(did you mean 'ProgressBarCallback'\\?\\)"):
        callbacks["ProgressBar"]
    with pytest.raises(KeyError, match="did you mean 'ProgressBarCallback'"):
        callbacks["ProgresBarCallback"]
    with pytest.raises(KeyError, match="no callback 'Unrelated'; registered"):
        callbacks["Unrelated"]

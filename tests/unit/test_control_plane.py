"""`ControlPlane` on its own: no trainer, no process group (a one-rank world stand-in)."""

import os
import signal
import time

import pytest

from dream_trainer import StopTraining, TrainingInterrupted
from dream_trainer.exits import EXIT_FAILED, EXIT_PREEMPTED, exit_code_for
from dream_trainer.trainer.control import SIGNAL_REPEAT_WINDOW_S, ControlPlane


class OneRank:
    world_size = 1

    def all_gather_object(self, obj):
        return [obj]


class Disabled:
    def __init__(self):
        self.calls = []

    def disable(self, name, why):
        self.calls.append((name, why))


def test_no_request_decides_nothing():
    control, callbacks = ControlPlane(), Disabled()
    control.decide(OneRank(), callbacks)
    assert callbacks.calls == [] and control.local_flags() == [0, 0, 0]


def test_the_first_stop_reason_wins_and_is_raised_once():
    control = ControlPlane()
    assert control.request_stop("first") and not control.request_stop("second")
    assert control.stop_requested and control.local_flags() == [0, 1, 0]
    with pytest.raises(StopTraining, match="first"):
        control.decide(OneRank(), Disabled())
    assert not control.stop_requested
    control.decide(OneRank(), Disabled())  # acted on: nothing left


def test_disable_requests_are_acted_on_before_a_stop_in_name_order():
    control, callbacks = ControlPlane(), Disabled()
    control.request_disable("b", "kept failing")
    control.request_disable("a", "kept failing too")
    control.request_disable("b", "a later reason is not kept")
    control.request_stop("done")
    with pytest.raises(StopTraining):
        control.decide(OneRank(), callbacks)
    assert callbacks.calls == [("a", "kept failing too"), ("b", "kept failing")]
    assert control.disable_requests == {}


def test_a_signal_stops_at_the_next_decision_and_a_second_one_at_once():
    control, original = ControlPlane(), signal.getsignal(signal.SIGTERM)
    restore = control.install_signal_handlers(lambda: True)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # the same delivery twice (within the window): one signal
        assert control.signal == signal.SIGTERM
        with pytest.raises(TrainingInterrupted, match="SIGTERM") as caught:
            control.decide(OneRank(), Disabled())
        assert caught.value.at_step_boundary and caught.value.signal == signal.SIGTERM
        time.sleep(SIGNAL_REPEAT_WINDOW_S + 0.1)
        with pytest.raises(TrainingInterrupted, match="again") as again:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # the handler raises in this thread, at the next bytecode
        assert not again.value.at_step_boundary
    finally:
        restore()
    assert signal.getsignal(signal.SIGTERM) is original


def test_a_signal_when_not_running_raises_at_once():
    control = ControlPlane()
    restore = control.install_signal_handlers(lambda: False)
    try:
        with pytest.raises(TrainingInterrupted, match="SIGINT"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    finally:
        restore()


def test_reset_forgets_every_request():
    control = ControlPlane()
    control.request_stop("x")
    control.request_disable("cb", "why")
    control.reset()
    assert control.local_flags() == [0, 0, 0] and control.stop_request is None


def test_exit_codes_live_in_one_place():
    assert [exit_code_for(s) for s in ("completed", "stopped", "preempted", "failed")] == [0, 0, EXIT_PREEMPTED,
                                                                                          EXIT_FAILED]
    assert (EXIT_PREEMPTED, EXIT_FAILED) == (75, 1)

"""`ControlPlane` on two gloo ranks, no trainer: a request made on one rank only."""

import pytest

from dream_trainer import DeviceParameters, DistributedWorld, StopTraining
from dream_trainer.testing import spawn_world
from dream_trainer.trainer.control import ControlPlane


class Disabled:
    def __init__(self):
        self.calls = []

    def disable(self, name, why):
        self.calls.append((name, why))


def _one_rank_requests(blocking):
    """Rank 1 alone asks to stop and to disable a callback; both ranks must act at the same
    decision: at once when blocking, one decision later when not."""
    world = DistributedWorld(DeviceParameters.DDP())
    world.launch()
    control, callbacks = ControlPlane(), Disabled()
    acted_at = None
    try:
        for point in range(4):
            if point == 1 and world.rank == 1:
                control.request_disable("monitor", "failed 3 times")
                control.request_stop("rank one is done")
            try:
                control.decide(world, callbacks, blocking=blocking)
            except StopTraining as stop:
                acted_at = (point, stop.reason)
                break
        control.drain()
        return acted_at, callbacks.calls
    finally:
        world.teardown()


@pytest.mark.parametrize("blocking", [True, False])
def test_a_request_on_one_rank_is_acted_on_by_both_at_the_same_point(blocking):
    results = spawn_world(2, _one_rank_requests, blocking, timeout=120)
    expected_point = 1 if blocking else 2
    assert results == [((expected_point, "rank one is done"), [("monitor", "failed 3 times")])] * 2

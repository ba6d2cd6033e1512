"""The collective tracker, the watchdog's report and the straggler rule, on one process: two
watchdogs share a real c10d store (a `HashStore`, as the run's TCP store would be), and the
late rank is stopped by a real signal to the main thread."""

from __future__ import annotations

import json
import math
import threading
import time

import pytest
import torch.distributed as dist

from dream_trainer.cluster import ClusterEnvironment
from dream_trainer.configs import DeviceParameters
from dream_trainer.world.plan import plan_mesh
from dream_trainer.world.rendezvous import Roster
from dream_trainer.world.stragglers import find_stragglers
from dream_trainer.world.watchdog import (CollectiveHang, CollectiveTracker, Watchdog, abort_threshold, explain_hang,
                                          hang_threshold)


def _roster() -> Roster:
    cluster = ClusterEnvironment(source="test", rank=0, world_size=2, local_rank=0, local_world_size=1, node_rank=0,
                                 num_nodes=2, master_addr="127.0.0.1", master_port=1)
    return Roster(cluster, {0: (0, "host-a"), 1: (1, "host-b")})


def test_the_tracker_numbers_collectives_and_knows_whether_a_rank_is_inside():
    tracker = CollectiveTracker()
    with tracker.region("all_reduce", find_caller=True):
        inside = tracker.record()
    after = tracker.record()
    assert inside["seq"] == after["seq"] == 1 and inside["inside"] and not after["inside"]
    assert inside["caller"] == "test_the_tracker_numbers_collectives_and_knows_whether_a_rank_is_inside"
    with pytest.raises(ValueError), tracker.region("barrier"):
        raise ValueError("a failed collective")
    assert tracker.record()["seq"] == 2 and not tracker.record()["inside"]  # left on the way out, too


def test_the_forward_is_a_collective_where_the_layout_communicates_in_it():
    fsdp = CollectiveTracker(plan_mesh(DeviceParameters.FSDP(dp_shard=2), 2, 2))
    ddp = CollectiveTracker(plan_mesh(DeviceParameters.DDP(), 2, 2))
    for tracker in (fsdp, ddp):
        tracker.batch_arrived(3, time.perf_counter())
        tracker.compute_starts()
    assert fsdp.record()["seq"] == 1 and fsdp.record()["inside"] and ddp.record()["seq"] == 0
    assert ddp.record()["phase"] == "training_step" and ddp.record()["step"] == 3


def test_the_work_before_the_first_collective_is_measured_per_step():
    tracker = CollectiveTracker()
    start = time.perf_counter()
    tracker.batch_arrived(1, start - 0.5)  # arrived half a second ago
    with tracker.region("backward: gradient reduction"):
        pass
    with tracker.region("all_reduce"):  # not the first: not counted
        time.sleep(0.01)
    work = tracker.step_work(time.perf_counter() + 10)
    assert 0.5 <= work < 5  # from the arrival to the backward, not to the step's end
    assert tracker.step_work(time.perf_counter()) == 0.0


def test_the_threshold():
    assert hang_threshold(None, 300, 300) == 60 and hang_threshold(None, 20, 20) == 5
    assert hang_threshold(None, 300, 600) == 150  # the first step: a quarter of the init timeout
    assert hang_threshold(2.5, 300, 300) == 2.5 and math.isinf(hang_threshold(0, 300, 300))
    # A named hang ends the run just before the collective timeout by default, never before the report.
    assert abort_threshold(None, 60, 300) == 297 and abort_threshold(10, 60, 300) == 60
    assert abort_threshold(90, 60, 300) == 90


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"hang_report_s": -1}, r"hang_report_s=-1 is invalid: expected None \(the default\), 0 \(off\)"),
    ({"hang_report_s": 300}, r"hang_report_s=300 is invalid: expected less than timeout_s=300"),
    ({"straggler_factor": 1.0}, r"straggler_factor=1.0 is invalid: expected a number > 1 or None"),
    ({"hang_abort_s": 300}, r"hang_abort_s=300 is invalid: expected None \(the default: just before the collective "
                            r"timeout\) or seconds > 0 and under timeout_s=300"),
    ({"hang_abort_s": 0}, r"hang_abort_s=0 is invalid"),
])
def test_bad_watchdog_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DeviceParameters(**kwargs)


def test_the_straggler_rule_compares_with_the_median_of_the_other_ranks():
    ratio, slow = find_stragglers([0.010, 0.100], 1.5)  # two ranks: the slow one against the other
    assert slow == [(1, 0.100, 0.010)] and ratio == pytest.approx(10)
    assert find_stragglers([0.010, 0.012, 0.011, 0.030], 1.5)[1] == [(3, 0.030, 0.011)]
    assert find_stragglers([0.0001, 0.0004], 1.5)[1] == []  # 4x, but 0.3 ms: noise
    assert find_stragglers([0.010, 0.011], 1.5) == (pytest.approx(1.1), [])


def _stuck_pair(threshold: float = 0.05, abort_after: float | None = None):
    store, roster, released = dist.HashStore(), _roster(), []
    waiting, late = CollectiveTracker(), CollectiveTracker()
    waiting.roster = late.roster = roster
    zero = Watchdog(waiting, roster, 0, 2, lambda: threshold, lambda: released.append(True),
                    None if abort_after is None else (lambda: abort_after))
    one = Watchdog(late, roster, 1, 2, lambda: threshold, lambda: None)
    for tracker in (waiting, late):  # both passed collective #1
        with tracker.region("control point"):
            pass
    late.step_ended(3)
    late.between_steps()  # rank 1: fetching step 3's batch
    waiting.batch_arrived(3, time.perf_counter())
    return store, zero, one, waiting, released


def test_a_rank_that_never_enters_is_named_with_its_stack_and_stopped_by_a_signal():
    store, zero, one, waiting, released = _stuck_pair()
    one.install()  # the late rank's main thread (this one) gets the signal
    try:
        with waiting.region("backward: gradient reduction"):  # rank 0 waits in #2
            time.sleep(0.1)
            zero.tick(store)  # past the threshold: rank 1 is asked for its stack
            late_beat = threading.Thread(target=one.tick, args=(store,))
            with pytest.raises(CollectiveHang, match=r"rank 0 \(node 0, host host-a\) reported that this rank has "
                                                     r"not entered collective #2 \(backward: gradient reduction\)"):
                late_beat.start()  # rank 1 answers (its stack: this sleep)
                late_beat.join()
                zero.tick(store)  # rank 0 reports and asks rank 1 to stop
                threading.Thread(target=one.tick, args=(store,)).start()  # rank 1 reads it: a signal here
                time.sleep(30)  # a stuck main thread, cut by the signal
            zero.tick(store)  # rank 1 said it is stopping: rank 0 releases its peers
    finally:
        one.uninstall()
    assert released == [True]
    report = zero.verdict or ""
    assert report.startswith("rank 0 (node 0, host host-a) waited 0 s in collective #2 (backward: gradient "
                             "reduction) at step 3:"), report
    assert ("rank 1 (node 1, host host-b) has not entered collective #2 (backward: gradient reduction); it was "
            "last seen at step 3 in data (fetching the next batch) or the epoch's hooks, after collective #1 "
            "(control point)") in report
    # Rank 1's main thread (this one) as it was when its heartbeat answered: starting or joining that beat.
    assert "in test_a_rank_that_never_enters_is_named" in report and "        late_beat." in report, report
    error = RuntimeError("Connection closed by peer")
    assert explain_hang(zero, error) and error.__notes__ == [f"dream_trainer: {report}"]


def test_no_report_when_every_rank_has_entered_the_collective():
    store, zero, one, waiting, released = _stuck_pair()
    one.tracker.enter("backward: gradient reduction")  # rank 1 is in #2 too: the wait is elsewhere
    with waiting.region("backward: gradient reduction"):
        time.sleep(0.1)
        one.tick(store)  # publishes its record
        zero.tick(store)
        zero.tick(store)
    assert zero.verdict is None and released == [] and not store.check(["ask/1"])


def test_a_named_hang_is_reported_first_and_ends_the_run_only_after_hang_abort_s():
    """A rank that works alone past the report threshold (an upload, a long callback) is named
    at ERROR, but nothing is stopped until the wait reaches the abort threshold."""
    store, zero, one, waiting, released = _stuck_pair(threshold=0.05, abort_after=0.6)
    with waiting.region("checkpoint barrier"):
        time.sleep(0.1)
        zero.tick(store)  # past the report threshold: rank 1 is asked for its stack
        one.tick(store)  # rank 1 answers
        zero.tick(store)  # rank 0 names it, and goes on waiting
        assert zero.reported is not None and "rank 1 (node 1, host host-b) has not entered collective #2 " \
            "(checkpoint barrier)" in zero.reported
        assert zero.verdict is None and released == [] and not store.check(["ask/1"])  # no stop request
        zero.tick(store)
        assert zero.verdict is None and released == []  # still under hang_abort_s: reported once, not again
        time.sleep(0.6)
        zero.tick(store)  # past hang_abort_s, rank 1 still late: asked for its stack again
        one.tick(store)
        zero.tick(store)  # now the run ends: rank 1 asked to stop
        assert zero.verdict is not None and "checkpoint barrier" in zero.verdict
        assert json.loads(store.get("ask/1"))["kind"] == "abort"

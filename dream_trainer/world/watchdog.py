"""A hang names the rank: which collective each rank is in, and a watchdog that names the rank
that never entered the one its peers wait in.

Each rank keeps, in local memory only, a `CollectiveTracker` (``world.collectives``): the
sequence number and name of the collective it last entered (the world's collectives, the
control point, the backward's gradient reduction, the gradient sync and clipping, and the
forward of a layout that communicates there: FSDP, TP, CP, PP), whether it left it, and the
step and phase it is in (data, training_step, backward, optimizer step, ...). Entering costs
a few attribute writes and a clock read: no store round trip, nothing on the device.

The `Watchdog` runs in the heartbeat thread (`rendezvous.Heartbeat`), once per beat: it
publishes this rank's record in the run's store (only when it changed), answers requests
posted for this rank, and notices when this rank has waited in collective #K longer than
the threshold (`DeviceParameters.hang_report_s`). It then reads its peers' records: a rank
whose record is behind #K (or in another collective #K) is asked for its Python stack (its
heartbeat thread formats the main thread's frames, `sys._current_frames`, and writes them
back), and named::

    rank 1 (node 1, host gpu-7) has not entered collective #57 (backward: gradient
    reduction); it was last seen at step 3 in data (fetching the batch)

The report is logged (ERROR) at once. If the late rank still has not arrived when the wait
reaches ``DeviceParameters.hang_abort_s`` (default: just before the collective timeout, which
would end the wait anyway; a rank that legitimately works alone for a minute is reported,
not killed), the report is posted for the other ranks and ends the run on both sides:
the waiting rank releases its peers (its connections shut, NCCL aborted), so its own wait
fails at once with the report as a note; the late rank is asked to stop, and its heartbeat
thread interrupts its main thread with a real signal (`HANG_SIGNAL`, sent to the main
thread), whose handler raises `CollectiveHang`: a ``time.sleep``, a blocked lock or a loader
wait is interrupted too.

Why the store and not ``faulthandler`` on a signal: the store reaches a rank on another
host, the stack lands in the waiting rank's error (not in the late rank's own stderr), and
it works where the late rank's main thread cannot run Python (the heartbeat thread reads
its frames). What it cannot do: a rank whose C code holds the GIL runs no heartbeat either;
it is then named without a stack, and it stops when its next collective fails.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import CodeType
from typing import Any

import torch.distributed as dist

from dream_trainer.world.plan import MeshPlan
from dream_trainer.world.rendezvous import HEARTBEAT_S, Roster

__all__ = ["HANG_SIGNAL", "CollectiveHang", "CollectiveTracker", "Watchdog", "abort_threshold", "explain_hang",
           "hang_threshold", "watch"]

logger = logging.getLogger(__name__)

HANG_SIGNAL = signal.SIGURG
"""The signal a rank's heartbeat thread sends to its own main thread to stop it when a peer
reported it late (not one of `exits.STOP_SIGNALS`, which preempt; ignored by default, so a
stray one does nothing)."""

STACK_WAIT_S = 3 * HEARTBEAT_S
"""How long a waiting rank waits for a late rank's stack before it reports without it."""

_STACK_FRAMES, _STACK_CHARS = 40, 8000  # a stack sent through the store: its innermost part


class CollectiveHang(BaseException):
    """Stops a rank that a peer reported as never entering a collective (raised in its main
    thread by `HANG_SIGNAL`), or the waiting rank itself when its wait could not be
    released. A `BaseException`, like ``KeyboardInterrupt``: a callback's ``except
    Exception`` does not swallow it."""


def abort_threshold(hang_abort_s: float | None, report_s: float, current_timeout_s: float) -> float:
    """How long a rank waits in one collective before a reported hang ends the run:
    `hang_abort_s`, else ``current_timeout_s - 3 * HEARTBEAT_S`` (just before the collective
    times out, so a run is never ended earlier than the timeout would end it); never before
    the report (`report_s`)."""
    base = hang_abort_s if hang_abort_s is not None else current_timeout_s - 3 * HEARTBEAT_S
    return max(base, report_s)


def hang_threshold(hang_report_s: float | None, timeout_s: float, current_timeout_s: float) -> float:
    """How long a rank waits in one collective before it looks for the rank that is late:
    `hang_report_s`, else ``min(60, timeout_s / 4)``; while the long first-step timeout holds
    (`current_timeout_s` > `timeout_s`: compile, warm-up), at least a quarter of it. 0 (or
    ``inf``): off."""
    if hang_report_s == 0:
        return math.inf
    base = hang_report_s if hang_report_s is not None else min(60.0, timeout_s / 4)
    return max(base, current_timeout_s / 4) if current_timeout_s > timeout_s else base


class _Region:
    """``with tracker.region(name):`` — enters collective `name`, leaves it on the way out."""

    __slots__ = ("tracker", "name", "caller", "seq")

    def __init__(self, tracker: CollectiveTracker, name: str, caller: CodeType | None):
        self.tracker, self.name, self.caller, self.seq = tracker, name, caller, 0

    def __enter__(self) -> None:
        self.seq = self.tracker.enter(self.name, self.caller)

    def __exit__(self, *exc: object) -> None:
        self.tracker.left = self.seq


class CollectiveTracker:
    """This rank's place among its collectives, in local memory (see the module docstring).

    Attributes:
        current: ``(seq, name, caller code or None, perf_counter when entered)`` of the
            collective entered last (one tuple, replaced at once: the heartbeat thread
            never reads half a record).
        left: the sequence number of the last collective left; ``left != current[0]``
            while this rank is inside one.
        step, phase: the optimizer step and what the rank does (``"data"``,
            ``"training_step"``, ``"backward"``, ...); plug-ins may set `phase`.
        forward_communicates: the layout communicates in the forward (FSDP, TP, CP, PP):
            `compute_starts` enters a collective there.
        tracking: the trainer marks its steps and collectives here (False on one rank: no
            peer, no watchdog, no straggler to compare).
    """

    __slots__ = ("current", "left", "step", "phase", "forward_communicates", "tracking", "roster", "_skip",
                 "_work_start", "_work_s", "_next_step", "_regions")

    def __init__(self, plan: MeshPlan | None = None, skip_files: tuple[str, ...] = ()):
        self.current: tuple[int, str, CodeType | None, float] = (0, "", None, 0.0)
        self.left = 0
        self.step, self.phase, self._next_step = 0, "launch and setup", 1
        self.forward_communicates = plan is not None and (plan.dp_shard > 1 or plan.tp > 1 or plan.cp > 1
                                                          or plan.pp > 1)
        # One rank has no peer to wait for, no watchdog and no straggler: the trainer's step
        # skips its marks and regions then (the world's own collectives keep theirs).
        self.tracking = plan is None or plan.world_size > 1
        self.roster: Roster | None = None  # who is where, once the world is launched
        self._skip = frozenset(skip_files)  # files whose frames are not "the caller"
        self._work_start: float | None = None  # the micro-batch's arrival, until its first collective
        self._work_s = 0.0
        self._regions: dict[str, _Region] = {}

    def enter(self, name: str, caller: CodeType | None = None) -> int:
        """Enter collective `name` (called from `caller`, for the report): its sequence number."""
        now = time.perf_counter()
        if self._work_start is not None:  # the first collective since the batch arrived
            self._work_s += now - self._work_start
            self._work_start = None
        seq = self.current[0] + 1
        self.current = (seq, name, caller, now)
        return seq

    def region(self, name: str, find_caller: bool = False) -> _Region:
        """A context manager around collective `name`; `find_caller`: record the first
        caller outside the world's own files (``all_reduce`` called from ``Stepper.agree``)."""
        if not find_caller:  # the trainer's own regions, one object per name (not nested in themselves)
            region = self._regions.get(name)
            if region is None:
                region = self._regions[name] = _Region(self, name, None)
            return region
        frame = sys._getframe(1)
        while frame.f_back is not None and frame.f_code.co_filename in self._skip:
            frame = frame.f_back
        return _Region(self, name, frame.f_code)

    # ------------------------------------------------------------------ the step's marks (the trainer's)
    def step_ended(self, next_step: int) -> None:
        """The step ended (its hooks, its log and validation follow); `next_step` is the
        optimizer step the next batch is for."""
        self.phase, self._next_step = "the step's end (post_train_step, on_step_end, logging, validation)", next_step

    def between_steps(self) -> None:
        """A control point was passed (the loop's agreed decision point, at a step's end and
        around the epochs): the next thing is the next batch (or the epoch's hooks)."""
        self.step, self.phase = self._next_step, "data (fetching the next batch) or the epoch's hooks"

    def batch_arrived(self, step: int, now: float) -> None:
        """A micro-batch of step `step` arrived at `now`: its work starts (for the stragglers)."""
        self.step, self.phase, self._work_start = step, "pre_train_step (the batch arrived)", now

    def compute_starts(self) -> float:
        """``training_step`` is called; on a layout that communicates in the forward, the
        forward's collectives are entered here. Returns now."""
        self.phase = "training_step"
        if self.forward_communicates:
            self.enter("forward/backward: FSDP, TP, CP or PP collectives")
        return time.perf_counter()

    def step_work(self, now: float) -> float:
        """The end of a micro-batch's step: its work before its first collective (the time
        from its arrival to that collective; to `now` when it had none), taken."""
        if self._work_start is not None:
            self._work_s += now - self._work_start
            self._work_start = None
        work, self._work_s = self._work_s, 0.0
        return work

    def rank_name(self, rank: int) -> str:
        """``rank 3 (node 1, host gpu-7)`` once launched with a roll call; else ``rank 3``."""
        return self.roster.name(rank) if self.roster is not None else f"rank {rank}"

    def record(self) -> dict[str, Any]:
        """What the heartbeat publishes: the collective, whether it is inside it, its step and phase."""
        seq, name, caller, entered = self.current
        return {"seq": seq, "name": name, "caller": caller.co_qualname if caller is not None else None,
                "inside": self.left != seq, "step": self.step, "phase": self.phase,
                "for_s": round(time.perf_counter() - entered, 1) if seq else None}


def describe(record: dict[str, Any]) -> str:
    """``collective #57 (all_reduce, called from Stepper.agree)``."""
    caller = f", called from {record['caller']}" if record.get("caller") else ""
    return f"collective #{record['seq']} ({record['name']}{caller})"


def _stack_of(thread_id: int | None) -> str:
    """The Python stack of thread `thread_id` (the rank's main thread), innermost part, bounded."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    if frame is None:
        return "(its main thread is gone)"
    text = "".join(traceback.format_stack(frame)[-_STACK_FRAMES:])
    return text[-_STACK_CHARS:]


class Watchdog:
    """The heartbeat thread's part (see the module docstring): `tick` once per beat."""

    def __init__(self, tracker: CollectiveTracker, roster: Roster, rank: int, world_size: int,
                 threshold: Callable[[], float], release: Callable[[], None],
                 abort_after: Callable[[], float] | None = None):
        self.tracker, self.roster, self.rank, self.world_size = tracker, roster, rank, world_size
        self.threshold, self.release = threshold, release
        self.abort_after = abort_after or threshold  # a named hang ends the run after this wait
        self.reported: str | None = None  # the last report made without ending the run (yet)
        self._reported_seq: int | None = None
        self.verdict: str | None = None  # the report this rank made, or the one that stopped it
        self._published: tuple[Any, ...] | None = None
        self._asked: tuple[int, list[int], float] | None = None  # (seq, the late ranks asked, deadline)
        self._cleared: set[int] = set()  # collectives every rank had entered (reported once)
        self._abort: str | None = None  # why a peer asked this rank to stop
        self._own_seq: int | None = None  # the collective this rank reported a hang in
        self._release_after: tuple[list[int], float] | None = None  # (late ranks, deadline) before releasing
        self._interrupted = self._signalled = False
        self._disarmed = False
        self._main: int | None = threading.get_ident()  # the thread that runs the world (fit)
        self._restore: Any = None

    # ------------------------------------------------------------------ the main thread's side
    def install(self) -> None:
        """The `HANG_SIGNAL` handler (when the world runs on the main thread, where handlers live)."""
        if threading.current_thread() is threading.main_thread():
            self._restore = signal.signal(HANG_SIGNAL, self._on_signal)

    def uninstall(self) -> None:
        """Stop acting (teardown) and give the signal back its previous handler."""
        self._disarmed = True
        if self._restore is not None and threading.current_thread() is threading.main_thread():
            signal.signal(HANG_SIGNAL, self._restore)
            self._restore = None

    def disarm(self) -> str | None:
        """The run failed (or is ending): no report or interruption from now on. Returns the
        report that concerned this rank, if one was made."""
        self._disarmed = True
        return self.verdict

    def _on_signal(self, signum: int, frame: Any) -> None:
        reason = self._abort
        if reason is None or self._interrupted or self._disarmed:
            return
        if self._own_seq is not None and self.tracker.left == self._own_seq:
            return  # this rank's own wait already failed (released): that error goes on, with the report
        self._interrupted = True
        raise CollectiveHang(reason)

    # ------------------------------------------------------------------ the heartbeat thread's side
    def tick(self, store: dist.Store) -> None:
        """One beat: publish, answer requests, watch this rank's wait. Never raises."""
        if self._disarmed:
            return
        try:
            self._publish(store)
            self._answer(store)
            self._watch(store)
        except Exception as exc:  # noqa: BLE001 - the store went away (`explain` says so), a bad record
            logger.debug("the collective watchdog's beat failed: %s", exc)

    def _publish(self, store: dist.Store) -> None:
        tracker = self.tracker
        key = (tracker.current, tracker.left, tracker.step, tracker.phase)
        if key != self._published:
            self._published = key
            store.set(f"rec/{self.rank}", json.dumps(tracker.record()))

    def _answer(self, store: dist.Store) -> None:
        """A peer asked for this rank's stack, or asked it to stop."""
        key = f"ask/{self.rank}"
        if not store.check([key]):
            return
        request = json.loads(store.get(key))
        store.delete_key(key)
        store.set(f"stack/{self.rank}", json.dumps({"record": self.tracker.record(), "stack": _stack_of(self._main)}))
        if request.get("kind") == "abort" and self._abort is None:
            self._abort = self.verdict = str(request.get("reason", "a peer reported this rank late"))
            logger.error("stopping: %s", self._abort)
            store.set(f"stopping/{self.rank}", "1")  # the peer releases its connections once it reads this
            self._signalled = True
            self._interrupt()

    def _interrupt(self) -> None:
        """Raise `CollectiveHang` in the main thread, with a signal to it (so a sleep is cut)."""
        if self._restore is None:
            logger.error("this rank runs off the main thread: it cannot be interrupted, and stops when its next "
                         "collective fails")
            return
        signal.pthread_kill(threading.main_thread().ident or 0, HANG_SIGNAL)

    def _peers(self, store: dist.Store) -> dict[int, dict[str, Any] | None]:
        found: dict[int, dict[str, Any] | None] = {}
        for r in range(self.world_size):
            if r != self.rank:
                key = f"rec/{r}"
                found[r] = json.loads(store.get(key)) if store.check([key]) else None
        return found

    def _late(self, seq: int, name: str, peers: dict[int, dict[str, Any] | None]) -> list[int]:
        """The ranks behind collective #`seq`, or in another collective of that number."""
        return [r for r, rec in peers.items()
                if rec is None or rec["seq"] < seq or (rec["seq"] == seq and rec["name"] != name)]

    def _watch(self, store: dist.Store) -> None:
        tracker = self.tracker
        seq, name, _, entered = tracker.current
        if self.verdict is not None:
            if self._release_after is not None:
                self._release_when_stopping(store)
            elif seq == self._own_seq and tracker.left != seq and not self._signalled:
                self._signalled = True
                self._interrupt()  # released a beat ago and still inside (not a c10d wait): stop it too
            return
        if tracker.left == seq or seq == 0 or seq in self._cleared:
            return
        waited = time.perf_counter() - entered
        if self._asked is not None and self._asked[0] == seq:
            self._conclude(store, seq, name, waited)
            return
        if waited < self.threshold() or (self._reported_seq == seq and waited < self.abort_after()):
            return
        late = self._late(seq, name, self._peers(store))
        if not late:
            self._cleared.add(seq)
            logger.info("%s has been in %s for %.0f s; every rank has entered it", self.roster.name(self.rank),
                        describe(tracker.record()), waited)
            return
        for r in late:
            store.set(f"ask/{r}", json.dumps({"kind": "stack", "from": self.rank, "seq": seq}))
        self._asked = (seq, late, time.perf_counter() + STACK_WAIT_S)

    def _conclude(self, store: dist.Store, seq: int, name: str, waited: float) -> None:
        """The late ranks' stacks are in (or the wait for them is over): report and stop."""
        _, asked, deadline = self._asked or (seq, [], 0.0)
        answers = {r: json.loads(store.get(f"stack/{r}")) for r in asked if store.check([f"stack/{r}"])}
        if len(answers) < len(asked) and time.perf_counter() < deadline:
            return
        peers = self._peers(store)
        peers.update({r: a["record"] for r, a in answers.items()})
        late = [r for r in self._late(seq, name, peers) if r in asked]
        if not late:  # they arrived meanwhile: only slow
            self._asked = None
            self._cleared.add(seq)
            return
        mine = self.tracker.record()
        lines = [f"{self.roster.name(self.rank)} waited {waited:.0f} s in {describe(mine)} at step {mine['step']}:"]
        for r in late:
            lines.append(_late_line(self.roster.name(r), seq, name, peers[r], answers.get(r)))
        self._asked = None
        if waited < self.abort_after():  # named now; the run ends only if it is still late then
            self.reported, self._reported_seq = "\n".join(lines), seq
            logger.error("a collective hang (the run ends if it lasts %.0f s: DeviceParameters.hang_abort_s): %s",
                         self.abort_after(), self.reported)
            return
        self.verdict = self._abort = "\n".join(lines)
        self._own_seq = seq
        logger.error("a collective hang: %s", self.verdict)
        store.set(f"failed/{self.rank}", f"CollectiveHang: {lines[1].splitlines()[0]}"[:300])
        for r in late:
            reason = (f"{self.roster.name(self.rank)} reported that this rank has not entered collective #{seq} "
                      f"({name}) after waiting {waited:.0f} s for it")
            store.set(f"ask/{r}", json.dumps({"kind": "abort", "from": self.rank, "reason": reason}))
        self._release_after = (late, time.perf_counter() + STACK_WAIT_S)
        self._release_when_stopping(store)

    def _release_when_stopping(self, store: dist.Store) -> None:
        """Release the peers (this rank's own wait then fails, with the report as a note) once
        the late ranks have read their stop request (or `STACK_WAIT_S` passed): this rank's
        exit may take the store with it."""
        late, deadline = self._release_after or ([], 0.0)
        if time.perf_counter() < deadline and not all(store.check([f"stopping/{r}"]) for r in late):
            return
        self._release_after = None
        self.release()


def _late_line(who: str, seq: int, name: str, record: dict[str, Any] | None, answer: dict[str, Any] | None) -> str:
    if record is None:
        return f"{who} has not entered collective #{seq} ({name}); it never published where it is"
    if record["seq"] == seq:
        head = (f"{who} entered a different {describe(record)} at step {record['step']} in {record['phase']}: "
                f"the ranks' code paths diverged")
    else:
        where = "inside" if record["inside"] else "after"
        head = (f"{who} has not entered collective #{seq} ({name}); it was last seen at step {record['step']} in "
                f"{record['phase']}, {where} {describe(record)}")
    if answer is None:
        return head + f"\n  (no stack: it answered no request within {STACK_WAIT_S:g} s)"
    stack = "\n".join("    " + line for line in answer["stack"].rstrip().splitlines())
    return head + f"\n  its Python stack (main thread), innermost last:\n{stack}"


def explain_hang(watchdog: Watchdog | None, exc: BaseException) -> bool:
    """At a failure (`DistributedWorld.explain_failure`): stop the watchdog; when it made
    (or received) a hang report, add it to `exc` as a note. Whether it did."""
    verdict = watchdog.disarm() if watchdog is not None else None
    if verdict is None:
        return False
    if not isinstance(exc, CollectiveHang):
        exc.add_note(f"dream_trainer: {verdict}")
    return True


def watch(world: Any, roster: Roster) -> Watchdog:
    """The watchdog of a `DistributedWorld` being launched (its process group made with a
    roll call, `roster`): its threshold from ``DeviceParameters.hang_report_s`` and the
    world's current timeout; releasing the peers shuts this process's connections to them
    (NCCL: aborts the communicators too). Installs the `HANG_SIGNAL` handler."""
    from dream_trainer.world.sockets import shutdown_sockets

    params = world.device_parameters
    world.collectives.roster = roster

    def threshold() -> float:
        return hang_threshold(params.hang_report_s, params.timeout_s, world.timeout.total_seconds())

    def abort_after() -> float:
        return abort_threshold(params.hang_abort_s, threshold(), world.timeout.total_seconds())

    def release() -> None:
        if "nccl" in world.backend:
            dist.distributed_c10d._abort_process_group()  # NCCL only: unblocks the GPU streams
        shutdown_sockets(world._sockets)

    dog = Watchdog(world.collectives, roster, world.rank, world.world_size, threshold, release, abort_after)
    dog.install()
    return dog

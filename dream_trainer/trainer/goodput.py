"""`GoodputLedger`: where a run's wall time went, owned by the trainer as ``trainer.goodput``.

Every moment of the run from `fit()` on is in exactly one part, so the parts sum to the wall
time by construction:

- ``productive``: training steps that counted (forward, backward, optimizer, the step's
  callbacks and logging), less the named parts below that happened inside them;
- ``data``: waiting for the training loader's next batch;
- ``checkpoint``: the training thread blocked saving (or waiting for an async save);
- ``validation``: validation runs (the sanity check included);
- ``compile``: compile and recompile time (`CompileMonitorCallback` reports it);
- ``heal``: a fault-tolerant group's quorum that healed it from a peer;
- ``skipped``: the compute of optimizer steps that were skipped (a veto, a skipped batch);
- ``restart``: on a resumed run, from the moment the checkpoint it resumed from took its
  state to this attempt's first step: the work lost after that checkpoint, the time the
  job was down and this attempt's start-up (launch, build, loading);
- ``other``: the rest: start-up of a first attempt, epoch boundaries, teardown.

In the training loop the ledger makes no call of its own per batch or step: it reads the
step path's clock (`LoopClock`: when the current fetch began, when the last batch arrived,
when the last optimizer step ended, the loop's data wait so far), which the loop keeps
anyway, and splits the time between its own reads into ``data`` and ``productive`` from it.
It reads (no device sync) at a skipped step (`step_skipped`), at validation, at the loop's
start and end, and wherever a plug-in meets it through its two public seams: `timed`
(``with trainer.goodput.timed("checkpoint"): ...``) and `add` (time already spent, moved out
of the part it was counted in). A resumed run continues the ledger (`state_dict` /
`load_state_dict`, a part of the trainer's state); a fault-tolerant heal does not replace it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from dream_trainer.serialization import dumps, loads

logger = logging.getLogger(__name__)

KINDS = ("productive", "data", "checkpoint", "validation", "compile", "heal", "skipped", "restart", "other")
"""The ledger's parts, in report order."""
NAMED = frozenset(KINDS) - {"productive", "other"}
"""The parts `timed` and `add` take."""
GOODPUT_FILE = "goodput.json"


class LoopClock(Protocol):
    """What the ledger reads of the training loop (`dream_trainer.trainer.step_path.StepPath`
    is one): ``perf_counter`` instants and the loop's data wait so far."""

    fetch_start: float  # when the current (or last) batch was asked for
    arrived_at: float  # when the last batch arrived (< fetch_start: a fetch is under way)
    data_total: float  # seconds waited for batches, fetches that ended only
    ended_at: float  # when the last optimizer step ended
    data_at_end: float  # `data_total` then


class GoodputLedger:
    """Wall time split into parts (see the module docstring).

    Attributes:
        attempts: the run's attempts this ledger covers (1 + resumes).
        restart_known: False on a resumed run whose checkpoint had no ledger (the time
            between the attempts is not known; it is not counted).
    """

    def __init__(self) -> None:
        self._parts = dict.fromkeys(KINDS, 0.0)  # this attempt's
        self._carried = dict.fromkeys(KINDS, 0.0)  # the earlier attempts', from a checkpoint
        self._stack: list[str] = []  # named parts entered with `timed` / `push`, innermost last
        self._clock: LoopClock | None = None  # in the training loop: its clock (else the base part is "other")
        self._data_seen = 0.0  # the clock's data wait up to `_mark`
        self._mark: float | None = None  # perf_counter of the last switch; None: not running
        self._step_productive = 0.0  # productive time of the optimizer step in progress, up to `_mark`
        self._resumed_from: float | None = None  # time.time() of the loaded state: a restart to account
        self._stepping = False  # a batch was fetched in this fit(): a later load is a heal
        self.attempts = 1
        self.restart_known = True

    # ------------------------------------------------------------------ the trainer's switches
    def start(self) -> None:
        """`fit()` begins: this attempt's clock starts (in ``other``)."""
        self._parts = dict.fromkeys(KINDS, 0.0)
        self._stack, self._clock, self._step_productive, self._stepping = [], None, 0.0, False
        self._mark = time.perf_counter()

    def fetching(self, clock: LoopClock) -> float:
        """The training loop starts and asks for its first batch: from here its time is
        ``data`` or ``productive`` as `clock` says (see the module docstring). Sets and
        returns ``clock.fetch_start`` (the clock read)."""
        now = time.perf_counter()
        self._flush(now)
        clock.fetch_start = now
        self._clock, self._data_seen = clock, clock.data_total  # a fetch just began: nothing of it waited yet
        self._step_productive = 0.0
        self._stepping = True
        if self._resumed_from is not None:
            self._account_restart(self._resumed_from)
        return now

    def step_skipped(self, now: float) -> None:
        """The optimizer step in progress is skipped and ends at `now` (``perf_counter``),
        before its end reaches the clock: its productive time moves to ``skipped``."""
        self._flush(now)
        self._parts["productive"] -= self._step_productive
        self._parts["skipped"] += self._step_productive
        self._step_productive = 0.0

    def idle(self) -> None:
        """The training loop ended (an epoch's end, or the run's): ``other`` from here."""
        self._flush(time.perf_counter())
        self._clock = None

    def finish(self, run_dir: str | Path | None = None, report: bool = True) -> dict[str, Any]:
        """`fit()` ends: stop the clock; with `report`, log the table at INFO and write
        ``goodput.json`` into `run_dir` (when given). Returns `summary`. Never raises for a
        file it cannot write (a warning)."""
        if self._mark is not None:
            self._flush(time.perf_counter())
            self._mark = None
        self._stack, self._clock = [], None
        summary = self.summary()
        if report:
            logger.info("goodput: %s", self.table())
            if run_dir is not None:
                try:
                    Path(run_dir).mkdir(parents=True, exist_ok=True)
                    (Path(run_dir) / GOODPUT_FILE).write_text(json.dumps(summary, indent=1))
                except OSError as exc:
                    logger.warning("cannot write %s in %s: %s", GOODPUT_FILE, run_dir, exc)
        return summary

    # ------------------------------------------------------------------ the public seams
    @contextmanager
    def timed(self, kind: str) -> Iterator[None]:
        """Count the time inside the block as `kind` (one of `NAMED`); nested blocks count
        as the innermost."""
        self.push(kind)
        try:
            yield
        finally:
            self.pop(kind)

    def push(self, kind: str) -> None:
        """Enter part `kind` (what `timed` does on entry; end it with `pop`)."""
        _check_kind(kind)
        if self._mark is not None:
            self._flush(time.perf_counter())
        self._stack.append(kind)

    def pop(self, kind: str) -> None:
        """Leave part `kind`, entered with `push`."""
        if self._mark is not None:
            self._flush(time.perf_counter())
        if self._stack and self._stack[-1] == kind:
            self._stack.pop()
        elif kind in self._stack:  # left out of order (an exception unwound past a push): drop it and above
            del self._stack[self._stack.index(kind):]

    def add(self, kind: str, seconds: float) -> float:
        """Count `seconds` already spent as `kind`: moved out of the part running now (at
        most what that part holds in this attempt). Returns the seconds moved."""
        _check_kind(kind)
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0:
            raise ValueError(f"GoodputLedger.add({kind!r}, seconds={seconds!r}): expected seconds >= 0")
        if self._mark is not None:
            self._flush(time.perf_counter())
        current = self._current
        moved = min(float(seconds), max(0.0, self._parts[current]))
        self._parts[current] -= moved
        self._parts[kind] += moved
        if current == "productive":
            self._step_productive = max(0.0, self._step_productive - moved)
        return moved

    # ------------------------------------------------------------------ reading
    def parts(self) -> dict[str, float]:
        """Seconds per part so far, every attempt included."""
        if self._mark is not None:
            self._flush(time.perf_counter())
        return {kind: self._carried[kind] + self._parts[kind] for kind in KINDS}

    def summary(self) -> dict[str, Any]:
        """``{"wall_s", "goodput", "parts_s", "shares", "attempts", "restart_known"}``:
        goodput is productive / wall."""
        parts = self.parts()
        wall = sum(parts.values())
        return {"wall_s": wall, "goodput": parts["productive"] / wall if wall > 0 else None, "parts_s": parts,
                "shares": {k: (v / wall if wall > 0 else 0.0) for k, v in parts.items()},
                "attempts": self.attempts, "restart_known": self.restart_known}

    def table(self) -> str:
        """The summary as a text table: seconds and share per part."""
        s = self.summary()
        rows = [f"{kind:<11}{seconds:>11.2f} s{100 * s['shares'][kind]:>7.1f} %" for kind, seconds in s["parts_s"].items()]
        goodput = "n/a" if s["goodput"] is None else f"{100 * s['goodput']:.1f} %"
        restart = "" if s["restart_known"] else " (restart time unknown: the checkpoint had no ledger)"
        return (f"goodput {goodput} of {s['wall_s']:.2f} s wall over {s['attempts']} attempt(s){restart}\n"
                + "\n".join(rows))

    def line(self) -> str:
        """The summary on one line: goodput, the wall time and the parts that took any time."""
        s = self.summary()
        goodput = "n/a" if s["goodput"] is None else f"{100 * s['goodput']:.1f} %"
        parts = ", ".join(f"{kind} {seconds:.1f} s" for kind, seconds in s["parts_s"].items() if seconds >= 0.05)
        return f"{goodput} of {s['wall_s']:.1f} s wall, {s['attempts']} attempt(s) ({parts})"

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The parts so far and when they were taken (``time.time()``): a resumed run counts
        the time from then to its first step as ``restart``."""
        state = {"parts": self.parts(), "taken_at": time.time(), "attempts": self.attempts}
        return {"ledger": dumps(state, "goodput ledger")}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue a saved ledger (a resume, before the loop). Ignored once this `fit()`
        fetched a batch: a fault-tolerant heal brings a peer's state, not this group's time."""
        if self._stepping:
            return
        state = loads(state_dict["ledger"], "the goodput ledger")
        self._carried = {kind: float(state["parts"].get(kind, 0.0)) for kind in KINDS}
        self.attempts = int(state.get("attempts", 1)) + 1
        self._resumed_from = float(state["taken_at"])

    def mark_resumed_without_ledger(self) -> None:
        """A resumed run whose checkpoint had no ledger: the time between attempts is unknown."""
        self.restart_known = False

    # ------------------------------------------------------------------ internals
    @property
    def _current(self) -> str:
        if self._stack:
            return self._stack[-1]
        clock = self._clock
        if clock is None:
            return "other"
        return "data" if clock.fetch_start > clock.arrived_at else "productive"

    def _flush(self, now: float) -> None:
        """Count the time since the last read (`_mark`) into the part running: the innermost
        named part, else ``other`` outside the loop, else the loop's clock splits it into
        ``data`` and ``productive``."""
        mark = self._mark
        if mark is None:
            return
        elapsed, self._mark = now - mark, now
        parts, clock = self._parts, self._clock
        if clock is None:
            parts[self._stack[-1] if self._stack else "other"] += elapsed
            return
        data_wait = clock.data_total  # the loop's data wait up to `now`: the ended fetches'
        if clock.fetch_start > clock.arrived_at:  # and the one under way
            data_wait += now - clock.fetch_start
        data, self._data_seen = data_wait - self._data_seen, data_wait
        if self._stack:  # a named part (e.g. a heal inside a fetch): none of it is data
            parts[self._stack[-1]] += elapsed
            productive = 0.0
        else:
            productive = max(0.0, elapsed - data)
            parts["data"] += elapsed - productive
            parts["productive"] += productive
        if clock.ended_at > mark:  # a step ended since the last read: the current step's began there
            self._step_productive = 0.0 if self._stack else max(
                0.0, (now - clock.ended_at) - (data_wait - clock.data_at_end))
        else:
            self._step_productive += productive

    def _account_restart(self, resumed_from: float) -> None:
        """The first batch after a resume: everything since the checkpoint took its state
        is ``restart`` (this attempt's start-up included, so it leaves the other parts)."""
        gap = time.time() - resumed_from
        so_far = sum(self._parts.values())
        self._parts = dict.fromkeys(KINDS, 0.0)
        self._parts["restart"] = max(gap, so_far)  # clocks of two hosts may disagree: never less than this attempt's
        self._resumed_from = None


def _check_kind(kind: str) -> None:
    if kind not in NAMED:
        raise ValueError(f"goodput part {kind!r} is not one of {sorted(NAMED)}")

"""`ReplicaGroup`: start, watch and SIGKILL one replica group of a fault-tolerant run (a
process, or a ``--nproc`` launcher and its ranks), for tests and demos on one machine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (Linux ``/proc``; empty elsewhere)."""
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found.extend(children)
            frontier.extend(children)
    return found


class ReplicaGroup:
    """One replica group: ``argv`` run as a subprocess (in its own session).

    Args:
        argv: the command (e.g. ``[sys.executable, "train.py", "--ft-group", "1"]``).
        group_dir: the group's directory (``<run_dir>/replica_group_<id>``), where
            `FaultToleranceCallback` writes ``fault_tolerance.jsonl``.
        env: the environment (default: this process's).
    """

    def __init__(self, argv: Sequence[str], group_dir: str | os.PathLike[str], env: dict[str, str] | None = None):
        self.argv, self.dir, self.env = list(argv), Path(group_dir), env
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        """Start (or restart) the group."""
        if self.alive:
            raise RuntimeError(f"replica group {self.dir.name} is already running (pid {self.proc.pid})")  # type: ignore[union-attr]
        self.proc = subprocess.Popen(self.argv, env=self.env, start_new_session=True)
        self.starts += 1

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def kill(self) -> None:
        """SIGKILL every process of the group at once (its ranks, then the launcher) and
        reap it: what a lost machine looks like to the other groups."""
        if self.proc is None:
            return
        for pid in [*descendants(self.proc.pid), self.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def terminate(self) -> None:
        """SIGTERM the group (a launcher forwards it to its ranks): it stops at the next
        step boundary, checkpoints if it can, and exits 75 (preempted)."""
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]

    def wait(self, timeout: float) -> int:
        """Wait for the group to exit; on timeout, kill it and raise `TimeoutError`."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"replica group {self.dir.name} did not finish within {timeout:.0f}s") from None

    def events(self) -> list[dict[str, Any]]:
        """The group's ``fault_tolerance.jsonl`` events so far (every start of it)."""
        path = self.dir / "fault_tolerance.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]

    def reached(self, step: int, participants: int = 1) -> bool:
        """Whether a log step at or after `step` with at least `participants` groups was recorded."""
        return any(e["event"] == "step" and e["step"] >= step and e["participants"] >= participants
                   for e in self.events())

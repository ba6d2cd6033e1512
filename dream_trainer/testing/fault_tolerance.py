"""`ReplicaGroup`: start, watch and SIGKILL one replica group of a fault-tolerant run (a
process, or a ``--nproc`` launcher and its ranks), for tests, demos and benchmarks on one
machine; `wait_until` an event; `StartGate` and `start_together`, so that every group is in
the first quorum whatever their start-up times; `listening`: the TCP sockets a run's
processes listen on, and where."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dream_trainer.protocol.base import Callback


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


def _proc_address(hex_address: str) -> tuple[str, int]:
    """``/proc/net/tcp{,6}``'s ``HEXIP:HEXPORT`` as ``(ip, port)``."""
    import ipaddress
    import struct

    ip_hex, port_hex = hex_address.split(":")
    raw = bytes.fromhex(ip_hex)
    # The kernel prints each 32-bit word of the address in host byte order.
    words = b"".join(struct.pack("=I", w) for w in struct.unpack(f">{len(raw) // 4}I", raw))
    ip = ipaddress.ip_address(words)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(port_hex, 16)


def listening(pids: Sequence[int]) -> list[tuple[str, int]]:
    """The TCP sockets in LISTEN state that the processes `pids` hold, as ``(ip, port)``
    (``0.0.0.0`` / ``::``: every interface). Linux ``/proc`` (empty elsewhere)."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and fields[9] in inodes:
                found.append(_proc_address(fields[1]))
    return sorted(set(found))


class ReplicaGroup:
    """One replica group: ``argv`` run as a subprocess (in its own session).

    Args:
        argv: the command (e.g. ``[sys.executable, "train.py", "--ft-group", "1"]``).
        group_dir: the group's directory (``<run_dir>/replica_group_<id>``), where
            `FaultToleranceCallback` writes ``fault_tolerance.jsonl``.
        env: the environment (default: this process's).
        output: a file that receives the group's stdout and stderr (appended; default: this
            process's).
    """

    def __init__(self, argv: Sequence[str], group_dir: str | os.PathLike[str], env: dict[str, str] | None = None,
                 output: str | os.PathLike[str] | None = None):
        self.argv, self.dir, self.env = list(argv), Path(group_dir), env
        self.output = Path(output) if output is not None else None
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, argv: Sequence[str] | None = None) -> None:
        """Start (or restart) the group; `argv` replaces its command from now on."""
        if self.alive:
            raise RuntimeError(f"replica group {self.dir.name} is already running (pid {self.proc.pid})")  # type: ignore[union-attr]
        if argv is not None:
            self.argv = list(argv)
        if self.output is None:
            self.proc = subprocess.Popen(self.argv, env=self.env, start_new_session=True)
        else:
            self.output.parent.mkdir(parents=True, exist_ok=True)
            with open(self.output, "ab") as out:
                self.proc = subprocess.Popen(self.argv, env=self.env, start_new_session=True, stdout=out,
                                             stderr=subprocess.STDOUT)
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


def wait_until(condition: Callable[[], bool], groups: Sequence[ReplicaGroup], timeout: float, what: str) -> None:
    """Wait for `condition` (an event: a file, a line), checking every 20 ms; fail as soon
    as one of `groups` exited with an error, or after `timeout` seconds (a bound, not a
    timing the run depends on)."""
    deadline = time.monotonic() + timeout
    while not condition():
        for group in groups:
            if group.returncode not in (None, 0):
                raise RuntimeError(f"replica group {group.dir.name} exited with status {group.returncode} "
                                   f"while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.02)


def wait_for_file(path: str | os.PathLike[str], timeout: float = 300.0) -> None:
    """Wait (polling every 10 ms) for `path` to exist; `TimeoutError` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout:.0f} s")
        time.sleep(0.01)


class StartGate(Callback[Any]):
    """In a group's trainer: in `pre_fit` (the group's Manager heartbeats to the lighthouse
    since launch), write ``<run_dir>/<gate's name>.ready`` (group rank 0), then wait for
    `gate` to exist. `start_together` opens it once every group is ready: the first
    quorum then has them all (the lighthouse waits for a live group that has not asked yet)."""

    def __init__(self, gate: str | os.PathLike[str]):
        self.gate = Path(gate)

    def pre_fit(self) -> None:
        if self.trainer.world.rank == 0:
            (Path(self.trainer.run_dir) / f"{self.gate.name}.ready").touch()
        wait_for_file(self.gate)


def start_together(groups: Sequence[ReplicaGroup], gate: str | os.PathLike[str], timeout: float = 300.0) -> None:
    """Start `groups` with ``--gate <gate>`` (replacing a previous ``--gate``; their script
    runs a `StartGate` on it) and open the gate once every one is ready."""
    gate = Path(gate)
    for group in groups:
        argv = list(group.argv)
        if "--gate" in argv:
            del argv[argv.index("--gate"):argv.index("--gate") + 2]
        group.start([*argv, "--gate", str(gate)])
    wait_until(lambda: all((g.dir / f"{gate.name}.ready").exists() for g in groups), groups, timeout,
               "every group up")
    gate.touch()

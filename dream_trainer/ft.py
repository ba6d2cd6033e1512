"""Fault tolerance helpers (torchft): a lighthouse for local runs and the data sampler that
follows the quorum. See ``docs/fault_tolerance.md``.

Start a lighthouse (the coordinator every replica group talks to)::

    python -m dream_trainer.ft lighthouse --bind 127.0.0.1:29510 --min-replicas 1

or in Python, ``with Lighthouse(bind="127.0.0.1:0") as lh: ... lh.address``.
"""

from __future__ import annotations

import argparse
import signal
import threading
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from dream_trainer.world.fault_tolerant import LIGHTHOUSES, FaultToleranceError, FaultTolerantWorld, quiet_torchft
from dream_trainer.world.ft_history import check_progress, confined, group_roots, run_history

__all__ = ["FaultTolerantSampler", "Lighthouse", "check_progress", "confined", "group_roots", "run_history",
           "step_units"]


class Lighthouse:
    """A torchft lighthouse in this process (Rust threads; no subprocess).

    Args:
        bind: ``"host:port"`` to listen on (port 0: a free one; see `address`).
        min_replicas: groups needed to form a quorum at all (keep 1 so that a lone
            survivor trains on; `FaultToleranceParameters.min_replica_size` decides commits).
        join_timeout_ms: how long a quorum waits for a group that heartbeats but has not
            asked to join yet (a group still starting up) before going on without it.
        quorum_tick_ms: how often the lighthouse re-checks for a quorum.
        heartbeat_timeout_ms: a group silent this long is dead: the next quorum leaves it out.
            A survivor's stall after a peer dies is about this long. A group's
            `FaultToleranceParameters.heartbeat_interval` must be at most half of it (checked
            when the group starts; exactly for groups in this process, which know this
            lighthouse's settings).
    """

    def __init__(self, bind: str = "127.0.0.1:29510", min_replicas: int = 1, join_timeout_ms: int = 1000,
                 quorum_tick_ms: int = 20, heartbeat_timeout_ms: int = 1000):
        for name, value in (("min_replicas", min_replicas), ("join_timeout_ms", join_timeout_ms),
                            ("quorum_tick_ms", quorum_tick_ms), ("heartbeat_timeout_ms", heartbeat_timeout_ms)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Lighthouse({name}={value!r}) is invalid: expected an int >= 1")
        host, _, port = bind.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"Lighthouse(bind={bind!r}) is invalid: expected 'host:port' (e.g. '127.0.0.1:29510')")
        quiet_torchft()
        from torchft.coordination import LighthouseServer

        self.bind, self.min_replicas, self.heartbeat_timeout_ms = bind, min_replicas, heartbeat_timeout_ms
        self._server: Any = LighthouseServer(bind=bind, min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                                             quorum_tick_ms=quorum_tick_ms, heartbeat_timeout_ms=heartbeat_timeout_ms)
        port = self._server.address().rsplit(":", 1)[1]
        self.address = f"http://{host}:{port}"
        """What to give `FaultToleranceParameters.lighthouse` (the bound host and port)."""
        LIGHTHOUSES[self.address] = (heartbeat_timeout_ms, join_timeout_ms)

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None
            LIGHTHOUSES.pop(self.address, None)

    def __enter__(self) -> Lighthouse:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def step_units(position: int, participants: int, units_per_epoch: int) -> int:
    """The first data unit of a step: `position` (units used by committed steps), moved to
    the next data epoch when the step's `participants` units would straddle two epochs
    (two permutations of the dataset could share a sample; the epoch's tail is dropped)."""
    epoch = position // units_per_epoch
    if (position + participants - 1) // units_per_epoch != epoch:
        return (epoch + 1) * units_per_epoch
    return position


class FaultTolerantSampler(Sampler[list[int]]):
    """A batch sampler whose batches follow the fault-tolerant quorum: at each step the
    ``n`` participating groups take ``n`` consecutive *units* of the data (a unit: one
    group's samples for one optimizer step, ``micro_batches x in-group data-parallel ranks
    x batch_size``), the group of replica rank ``r`` the ``r``-th. So no sample is trained
    twice in a step, a step that is not committed is retried on the same units, and
    whatever the groups that come and go, committed steps walk through the data in order:
    data epoch ``e`` is a permutation of the dataset (seeded with ``seed + e``), cut into
    units. Endless (its length is nominal): train by ``max_steps``.

    Use it as ``DataLoader(dataset, batch_sampler=FaultTolerantSampler(dataset, 8,
    self.world, micro_batches=...))`` with ``num_workers=0``, in ``configure_dataloaders``.
    Its position is saved in checkpoints and sent with a heal (it is a stateful sampler).
    """

    NOMINAL_LENGTH = 2**62

    def __init__(self, data: Sized | int, batch_size: int, world: FaultTolerantWorld, *, micro_batches: int = 1,
                 shuffle: bool = True, seed: int = 0):
        if not isinstance(world, FaultTolerantWorld):
            raise TypeError(f"FaultTolerantSampler needs the trainer's FaultTolerantWorld, got {type(world).__name__}: "
                            "add a FaultToleranceCallback")
        size = data if isinstance(data, int) else len(data)
        for name, value in (("batch_size", batch_size), ("micro_batches", micro_batches)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"FaultTolerantSampler({name}={value!r}) is invalid: expected an int >= 1")
        self.world, self.size, self.batch_size, self.micro_batches = world, size, batch_size, micro_batches
        self.shuffle, self.seed = shuffle, seed
        self.unit_size = micro_batches * world.dp_size * batch_size
        self.units_per_epoch = size // self.unit_size
        if self.units_per_epoch < 1:
            raise ValueError(
                f"FaultTolerantSampler: {size} samples are fewer than one unit ({micro_batches} micro-batch(es) x "
                f"{world.dp_size} rank(s) x batch_size {batch_size} = {self.unit_size})"
            )
        self.position = 0  # units used by committed steps
        self._last: tuple[int, int, int] | None = None  # (committed count, first unit, participants) of the last step
        self._attempt: int | None = None
        self._perm: tuple[int, torch.Tensor] | None = None

    def __len__(self) -> int:
        return self.NOMINAL_LENGTH

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_indices()

    def next_indices(self) -> list[int]:
        attempt, committed, participants, replica_rank, micro = self.world.step_slot()
        if micro >= self.micro_batches:
            raise FaultToleranceError(
                f"micro-batch {micro + 1} of a step, but FaultTolerantSampler(micro_batches={self.micro_batches}): "
                "set it to TrainingParameters.gradient_accumulation_steps"
            )
        if attempt != self._attempt:  # the first batch of a new step
            if self._last is not None and committed > self._last[0]:  # the previous step was committed
                self.position = self._last[1] + self._last[2]
            self._last = (committed, step_units(self.position, participants, self.units_per_epoch), participants)
            self._attempt = attempt
        unit = self._last[1] + replica_rank
        epoch, within = divmod(unit, self.units_per_epoch)
        start = within * self.unit_size + (micro * self.world.dp_size + self.world.dp_rank) * self.batch_size
        return self._permutation(epoch)[start : start + self.batch_size].tolist()

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            if self.shuffle:
                order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + epoch))
            else:
                order = torch.arange(self.size)
            self._perm = (epoch, order)
        return self._perm[1]

    @property
    def data_epoch(self) -> int:
        """The data epoch of the units the committed steps have reached."""
        return self.position // self.units_per_epoch

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "last": self._last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])
        self._last = tuple(state["last"]) if state["last"] is not None else None  # type: ignore[assignment]
        self._attempt = None  # the next batch starts a step


def main(argv: list[str] | None = None) -> int:
    """``python -m dream_trainer.ft lighthouse [...]``: run a lighthouse until SIGINT/SIGTERM."""
    parser = argparse.ArgumentParser(prog="python -m dream_trainer.ft", description="fault tolerance tools (torchft)")
    sub = parser.add_subparsers(dest="command", required=True)
    lh = sub.add_parser("lighthouse", help="run a torchft lighthouse until interrupted")
    lh.add_argument("--bind", default="127.0.0.1:29510", help="host:port to listen on (port 0: a free one)")
    lh.add_argument("--min-replicas", type=int, default=1, help="groups needed to form a quorum")
    lh.add_argument("--join-timeout-ms", type=int, default=1000)
    lh.add_argument("--quorum-tick-ms", type=int, default=20)
    lh.add_argument("--heartbeat-timeout-ms", type=int, default=1000,
                    help="a group silent this long is left out of the next quorum")
    args = parser.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with Lighthouse(bind=args.bind, min_replicas=args.min_replicas, join_timeout_ms=args.join_timeout_ms,
                    quorum_tick_ms=args.quorum_tick_ms, heartbeat_timeout_ms=args.heartbeat_timeout_ms) as server:
        print(f"lighthouse listening: {server.address}   (FaultToleranceParameters(lighthouse={server.address!r}))",
              flush=True)
        while not stop.wait(0.5):
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

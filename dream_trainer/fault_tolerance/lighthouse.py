"""`Lighthouse`: a torchft lighthouse (the coordinator every replica group talks to) in
this process, and the command line that runs one::

    python -m dream_trainer.fault_tolerance lighthouse --bind 127.0.0.1:29510 --min-replicas 1

or in Python, ``with Lighthouse(bind="127.0.0.1:0") as lh: ... lh.address``.
"""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any

from dream_trainer.fault_tolerance.addresses import LIGHTHOUSES
from dream_trainer.fault_tolerance.world import quiet_torchft


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


def main(argv: list[str] | None = None) -> int:
    """``python -m dream_trainer.fault_tolerance lighthouse [...]``: run a lighthouse until SIGINT/SIGTERM."""
    parser = argparse.ArgumentParser(prog="python -m dream_trainer.fault_tolerance",
                                     description="fault tolerance tools (torchft)")
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


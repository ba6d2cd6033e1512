"""Rendezvous with a roll call, and a heartbeat that names the ranks a failed run lost.

torch's ``env://`` rendezvous waits for every rank inside the store's constructor and, when
one never comes, says only how many did ("1/2 clients joined"). Here the store is made
without that wait; every rank then signs in under its own key (with its node and host), and
the wait reads which keys are missing, so the timeout names the rank, node and host.

While the world is up, a daemon thread adds 1 to this rank's counter in the same store every
`HEARTBEAT_S` seconds, over its own connection (never on the step path); with it, it
publishes which collective this rank is in and watches for a peer that never enters the
one this rank waits in (`dream_trainer.world.watchdog`). When a collective
fails, `Heartbeat.explain` tells why: a rank that posted its own failure (`post_failure`) is
named with it; otherwise the counters are read twice, a few beats apart, and the ranks whose
counter stood still are named (killed, or their node lost). When the store itself is gone,
the rank that hosts it is named.

Waiting is done in short polls, so a signal (torchelastic stopping the ranks of a failed
attempt, say) is handled at once rather than after the timeout. Every key of an attempt,
the process groups' included, lives under a prefix rank 0 chooses for it (`roll_call`): a
store that outlives a restart never hands out a dead attempt's keys.

The store rank 0 serves listens on the address the other ranks connect to (``MASTER_ADDR``:
``127.0.0.1`` for the ``--nproc`` launcher's ranks, node 0's address on several nodes;
`listen_host`), not on every interface as c10d's ``TCPStore`` server does.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from dream_trainer.cluster import ClusterEnvironment
from dream_trainer.world.sockets import listen_on

__all__ = ["HEARTBEAT_S", "Heartbeat", "RendezvousError", "is_communication_error", "listen_host", "roll_call"]

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # how often a rank's counter moves; a lost rank is named ~3 beats after a failure


class RendezvousError(RuntimeError):
    """A rank never arrived at the rendezvous, or the rank hosting the store is unreachable."""


_PREFIX = "dream_trainer"
_POLL_S = 0.1


def _agent_store() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _store_host(roster: Roster) -> str:
    return "torchelastic's agent on node 0" if _agent_store() else roster.name(0)


@dataclass
class Roster:
    """Who signed in: rank -> (node, host)."""

    cluster: ClusterEnvironment
    places: dict[int, tuple[int, str]]

    def name(self, rank: int) -> str:
        """``rank 3 (node 1, host gpu-7)``; the node from the even ranks-per-node layout when
        the rank never signed in."""
        if rank in self.places:
            node, host = self.places[rank]
            return f"rank {rank} (node {node}, host {host})"
        node = rank // max(self.cluster.local_world_size, 1)
        hosts = sorted({h for n, h in self.places.values() if n == node})
        return f"rank {rank} (node {node}{', host ' + hosts[0] if hosts else ''})"


def listen_host(cluster: ClusterEnvironment, addr: str) -> str | None:
    """The address rank 0's store listens on: the one `addr` (``MASTER_ADDR``, what the
    other ranks connect to) names on this machine, an IPv4 one first. None (every interface,
    c10d's default) when `addr` is a name that resolves to loopback here while ranks on other
    nodes must reach it (a node's own name mapped to 127.0.1.1 in ``/etc/hosts``: they
    resolve it to the node's real address, which a loopback listener would not answer), or
    does not resolve."""
    try:
        return str(ipaddress.ip_address(addr))  # an address means the same to every rank
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    inet4 = [info[4][0] for info in infos if info[0] == socket.AF_INET]
    address = str((inet4 or [infos[0][4][0]])[0])
    loopback = ipaddress.ip_address(address.split("%")[0]).is_loopback
    return None if loopback and cluster.num_nodes > 1 and addr != "localhost" else address


def _serve(cluster: ClusterEnvironment, addr: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """Rank 0's store server, listening on `listen_host` only (c10d's would listen on
    every interface); on every interface, with a warning, when that address is not one of
    this machine's (a virtual address routed to it, say). The server is c10d's
    ``multi_tenant`` one: a later store of this process on that port (another trainer in this
    process, or torch's own ``env://`` rendezvous) shares it instead of failing to bind."""
    host = listen_host(cluster, addr)
    if host is not None:
        try:
            fd = listen_on(host, port)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:  # a server of this process holds the port: c10d shares it
                return dist.TCPStore(addr, port, cluster.world_size, is_master=True, timeout=timeout,
                                     wait_for_workers=False, multi_tenant=True)
            if exc.errno != errno.EADDRNOTAVAIL:
                raise
            logger.warning("the rendezvous store listens on every interface: MASTER_ADDR=%s (%s) is not an address "
                           "of this machine (%s)", addr, host, exc.strerror)
        else:
            return dist.TCPStore(host, port, cluster.world_size, is_master=True, timeout=timeout,
                                 wait_for_workers=False, multi_tenant=True, master_listen_fd=fd)
    elif cluster.num_nodes > 1:
        logger.warning("the rendezvous store listens on every interface: MASTER_ADDR=%s resolves to loopback (or to "
                       "nothing) on rank 0's node; set MASTER_ADDR to the node's address to listen there only", addr)
    return dist.TCPStore(addr, port, cluster.world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                         multi_tenant=True)


def _store(cluster: ClusterEnvironment, timeout: timedelta, server: bool) -> dist.TCPStore:
    """A client (or, on rank 0 without torchelastic's agent store, the server: `_serve`) of
    the run's store, without waiting for the other ranks. A client first polls the port
    (quietly, and so that signals are handled) until the store listens or `timeout` passes."""
    addr = cluster.master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = cluster.master_port or int(os.environ.get("MASTER_PORT", "29500"))
    error = None if server else _wait_for_port(addr, port, time.monotonic() + timeout.total_seconds())
    if error is None:
        try:
            if server:
                return _serve(cluster, addr, port, timeout)
            return dist.TCPStore(addr, port, None, is_master=False, timeout=timeout, wait_for_workers=False)
        except (RuntimeError, OSError) as exc:
            error = exc
    raise RendezvousError(
        f"the rendezvous store at {addr}:{port} ({_store_host(Roster(cluster, {}))}) could not be reached within "
        f"{timeout.total_seconds():g} s (init_timeout_s): {str(error).splitlines()[0]}"
    ) from error


def _wait_for_port(addr: str, port: int, deadline: float) -> OSError | None:
    """Poll until something listens at ``addr:port``; the last error after `deadline`."""
    while True:
        try:
            socket.create_connection((addr, port), timeout=1.0).close()
            return None
        except OSError as exc:
            if time.monotonic() >= deadline:
                return exc
            time.sleep(4 * _POLL_S)


def roll_call(cluster: ClusterEnvironment, timeout: timedelta) -> tuple[dist.Store, Roster, str]:
    """Make (or join) the run's store, sign in, and wait up to `timeout` for every rank.
    Returns the attempt's store (prefixed: for ``init_process_group``), who is where, and the
    attempt's key prefix; raises `RendezvousError` naming the ranks that did not come.

    torchelastic's agent store outlives a restart, with the previous attempt's keys in it
    (addresses of dead processes: gloo would connect to them), and workers are not told the
    rendezvous round. So the attempt is named by rank 0: each rank says hello with a fresh
    token, rank 0 acknowledges each token it reads with its own, and a rank that sees its
    own token acknowledged signs in under ``<rank 0's token>/arrived/<rank>``. Stale hellos
    and acks carry tokens no live process has, and are never taken for current ones."""
    deadline = time.monotonic() + timeout.total_seconds()
    rank, world_size = cluster.rank, cluster.world_size
    store = _store(cluster, timeout, server=rank == 0 and not _agent_store())
    token = secrets.token_hex(8)
    attempt: str | None = token if rank == 0 else None
    acked: dict[int, str] = {}  # rank 0: the token it last acknowledged, per rank
    try:
        hello = json.dumps([cluster.node_rank, socket.gethostname(), token])
        store.set(f"{_PREFIX}/hello/{rank}", hello)
        if rank == 0:
            store.set(f"{_PREFIX}/{attempt}/arrived/0", hello)
        while True:
            if rank == 0:
                _acknowledge(store, world_size, token, acked)
            elif attempt is None and store.check([f"{_PREFIX}/ack/{rank}"]):
                seen, given = json.loads(store.get(f"{_PREFIX}/ack/{rank}"))
                if seen == token:
                    attempt = given
                    store.set(f"{_PREFIX}/{attempt}/arrived/{rank}", hello)
            keys = [f"{_PREFIX}/{attempt}/arrived/{r}" for r in range(world_size)]
            if attempt is not None and store.check(keys):
                break
            if time.monotonic() >= deadline:
                missing = [0] if attempt is None else [r for r, key in enumerate(keys) if not store.check([key])]
                roster = Roster(cluster, {} if attempt is None else _places(store, keys))
                raise RendezvousError(
                    f"{len(missing)} of {world_size} ranks did not arrive within {timeout.total_seconds():g} s "
                    f"(init_timeout_s): {', '.join(roster.name(r) for r in missing)}"
                )
            time.sleep(_POLL_S)  # signal handlers run here
        roster = Roster(cluster, _places(store, keys))
    except (RuntimeError, OSError) as exc:
        if isinstance(exc, RendezvousError):
            raise
        raise RendezvousError(f"the rendezvous store, hosted by {_store_host(Roster(cluster, {}))}, went away "
                              f"while waiting for the other ranks: {str(exc).splitlines()[0]}") from exc
    prefix = f"{_PREFIX}/{attempt}/"
    return dist.PrefixStore(prefix, store), roster, prefix


def _acknowledge(store: dist.Store, world_size: int, token: str, acked: dict[int, str]) -> None:
    """Rank 0: answer every hello whose token is new with this attempt's token."""
    for r in range(1, world_size):
        if store.check([f"{_PREFIX}/hello/{r}"]):
            seen = json.loads(store.get(f"{_PREFIX}/hello/{r}"))[2]
            if acked.get(r) != seen:
                store.set(f"{_PREFIX}/ack/{r}", json.dumps([seen, token]))
                acked[r] = seen


def _places(store: dist.Store, keys: list[str]) -> dict[int, tuple[int, str]]:
    """rank -> (node, host) of those signed in."""
    places = {}
    for r, key in enumerate(keys):
        if store.check([key]):
            node, host, _ = json.loads(store.get(key))
            places[r] = (int(node), str(host))
    return places


def is_communication_error(exc: BaseException) -> bool:
    """Whether `exc` is a collective or store failure (a peer gone, a timeout) rather than an
    error of this rank's own."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        mark in text for mark in ("gloo", "Gloo", "NCCL", "Connection closed", "Connection reset", "timed out",
                                  "Timed out", "Broken pipe")
    )


class Heartbeat:
    """This rank's counter in the run's store, moved by a daemon thread; reads the others'
    to name the ranks a failed collective lost (see the module docstring). `tick`, when
    given, runs in that thread after each beat, with the heartbeat's store (the collective
    watchdog: `dream_trainer.world.watchdog`)."""

    def __init__(self, cluster: ClusterEnvironment, roster: Roster, prefix: str,
                 tick: Callable[[dist.Store], None] | None = None):
        self.cluster, self.roster, self._tick = cluster, roster, tick
        # Its own connection, with a short timeout: a beat never blocks for long on a lost store.
        self._store = dist.PrefixStore(prefix, _store(cluster, timedelta(seconds=10 * HEARTBEAT_S), server=False))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="dream-trainer-heartbeat", daemon=True)
        self._thread.start()

    def _key(self, kind: str, rank: int) -> str:
        return f"{kind}/{rank}"

    def _beat(self) -> None:
        key = self._key("beat", self.cluster.rank)
        while not self._stop.is_set():
            try:
                self._store.add(key, 1)
            except (RuntimeError, OSError):
                return  # the store is gone: `explain` finds out for itself
            if self._tick is not None:
                self._tick(self._store)
            self._stop.wait(HEARTBEAT_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * HEARTBEAT_S)

    def post_failure(self, exc: BaseException) -> None:
        """Tell the other ranks this rank failed of its own, and why (best effort)."""
        try:
            self._store.set(self._key("failed", self.cluster.rank), f"{type(exc).__name__}: {exc}"[:300])
        except (RuntimeError, OSError):
            pass

    def explain(self) -> str | None:
        """Why the run's collectives failed: the ranks that failed or stopped answering, or
        None when every rank still beats (then the cause is elsewhere)."""
        others = [r for r in range(self.cluster.world_size) if r != self.cluster.rank]
        try:
            failed = {r: self._store.get(self._key("failed", r)).decode()
                      for r in others if self._store.check([self._key("failed", r)])}
            if failed:
                return "; ".join(f"{self.roster.name(r)} failed: {why}" for r, why in sorted(failed.items()))
            before = [self._store.add(self._key("beat", r), 0) for r in others]
            time.sleep(3 * HEARTBEAT_S)
            after = [self._store.add(self._key("beat", r), 0) for r in others]
        except (RuntimeError, OSError):
            return f"the run's store, hosted by {_store_host(self.roster)}, is unreachable: that rank or its node was lost"
        lost = [r for r, b, a in zip(others, before, after, strict=True) if a == b]
        if not lost:
            return None
        return (f"{', '.join(self.roster.name(r) for r in lost)} stopped answering "
                f"(the process was killed, or its node was lost)")

"""How a replica group reaches the lighthouse and its peers: the lighthouse's address
(`lighthouse_address`) and whether it answers (`check_lighthouse`), a heartbeat that fits
its timeout (`check_heartbeat`), the address peers reach this group at
(`resolve_hostname`). Checked when a `FaultTolerantWorld` is made and launched, before
anything is built."""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

from dream_trainer.configs import FaultToleranceParameters
from dream_trainer.errors import FaultToleranceError

LIGHTHOUSES: dict[str, tuple[int, int]] = {}
"""``{address: (heartbeat_timeout_ms, join_timeout_ms)}`` of the lighthouses this process serves."""


def lighthouse_address(params: FaultToleranceParameters) -> str:
    """The lighthouse to use: `params.lighthouse`, else ``$TORCHFT_LIGHTHOUSE``."""
    address = params.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
    if not address:
        raise FaultToleranceError(
            "no lighthouse: set FaultToleranceParameters(lighthouse='http://host:port') or TORCHFT_LIGHTHOUSE "
            "(start one with `python -m dream_trainer.fault_tolerance lighthouse`)"
        )
    FaultToleranceParameters(lighthouse=address)  # the same check as the field's
    return address.rstrip("/")


def host_port(address: str) -> tuple[str, int]:
    url = urlparse(address)
    return url.hostname or "", url.port or (443 if url.scheme == "https" else 80)


def check_lighthouse(address: str, timeout_s: float) -> None:
    """Fail at once, with a clear message, when nothing answers at the lighthouse's address
    (torchft itself would wait for its quorum timeout)."""
    host, port = host_port(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return
    except OSError as exc:
        raise FaultToleranceError(
            f"the lighthouse at {address} is unreachable ({exc.__class__.__name__}: {exc}) within "
            f"connect_timeout_s={timeout_s:g}: start it first (`python -m dream_trainer.fault_tolerance lighthouse "
            f"--bind {host}:{port}`) or fix FaultToleranceParameters.lighthouse / TORCHFT_LIGHTHOUSE"
        ) from None


def check_heartbeat(params: FaultToleranceParameters, address: str) -> None:
    """`heartbeat_interval` must be at most half the lighthouse's heartbeat timeout: a
    group silent for longer than the timeout is dead to the lighthouse, so with rarer
    heartbeats a live group drops out of quorums between them, and a joining group waits
    up to `heartbeat_interval` (many steps) to be let in. The timeout is the real one of a
    `Lighthouse` this process serves, else ``lighthouse_heartbeat_timeout_s`` (a remote
    lighthouse's settings cannot be read)."""
    known = LIGHTHOUSES.get(address)
    timeout_s = known[0] / 1000 if known else params.lighthouse_heartbeat_timeout_s
    if params.heartbeat_interval > timeout_s / 2:
        source = (f"the heartbeat_timeout_ms={known[0]} of the Lighthouse at {address}" if known else
                  f"FaultToleranceParameters.lighthouse_heartbeat_timeout_s={timeout_s:g}, the lighthouse's "
                  "--heartbeat-timeout-ms this group assumes (set it to the real one)")
        raise FaultToleranceError(
            f"FaultToleranceParameters.heartbeat_interval={params.heartbeat_interval:g} s is too long for a "
            f"heartbeat timeout of {timeout_s:g} s ({source}): it must be at most half of it, <= "
            f"{timeout_s / 2:g} s; rarer heartbeats make the lighthouse drop this live group between them and keep "
            "a joining group waiting for many steps"
        )


def _is_loopback(host: str) -> bool:
    try:
        return all(info[4][0].startswith("127.") or info[4][0] == "::1" for info in socket.getaddrinfo(host, None))
    except OSError:
        return False


def resolve_hostname(hostname: str | None, lighthouse: str) -> str:
    """The address peers reach this group at (and its servers listen on, see
    `dream_trainer.fault_tolerance.transport`). torchft advertises ``socket.gethostname()`` by
    default, which peers cannot use when it does not resolve: an explicit `hostname` must
    resolve; without one, ``127.0.0.1`` when the lighthouse is on loopback (every group is
    on this machine: nothing needs to listen elsewhere), else this machine's hostname when
    it resolves, else an error."""
    if hostname is not None:
        try:
            socket.getaddrinfo(hostname, None)
        except OSError as exc:
            raise FaultToleranceError(
                f"FaultToleranceParameters.hostname={hostname!r} does not resolve ({exc}): peers could not reach "
                "this group; give an address or a name in DNS/hosts"
            ) from None
        return hostname
    if _is_loopback(host_port(lighthouse)[0]):
        return "127.0.0.1"
    own = socket.gethostname()
    try:
        socket.getaddrinfo(own, None)
        return own
    except OSError:
        pass
    raise FaultToleranceError(
        f"this machine's hostname {own!r} does not resolve, so peers could not reach this group: set "
        "FaultToleranceParameters(hostname=...) to an address the other groups can reach"
    )

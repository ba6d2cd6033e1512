"""This process's connections to its peers, found and shut down through Linux ``/proc``:
a failed rank releases its peers at once (`DistributedWorld.teardown(abort=True)`); and
`listen_on`, a listening socket on one address (c10d's ``TCPStore`` server, given none,
listens on every interface)."""

from __future__ import annotations

import os
import socket

__all__ = ["listen_on", "shutdown_sockets", "socket_inodes"]


def socket_inodes() -> dict[str, int]:
    """``{socket inode: fd}`` of this process's open sockets (Linux ``/proc``; else empty)."""
    fds = "/proc/self/fd"
    if not os.path.isdir(fds):
        return {}
    found = {}
    for fd in os.listdir(fds):
        try:
            link = os.readlink(f"{fds}/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            found[link] = int(fd)
    return found


def shutdown_sockets(inodes: set[str]) -> int:
    """Shut down (without closing: their owners still hold the descriptors) the connected
    TCP sockets among `inodes` that are still open; the peer sees the connection closed."""
    released = 0
    for inode, fd in socket_inodes().items():
        if inode not in inodes:
            continue
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if sock.type == socket.SOCK_STREAM:
                sock.getpeername()  # connected only: a listener's shutdown would kill its thread
                sock.shutdown(socket.SHUT_RDWR)
                released += 1
        except OSError:
            pass
        finally:
            sock.detach()  # the descriptor stays with its owner
    return released


def listen_on(host: str, port: int) -> int:
    """The descriptor of a TCP socket listening on `host`:`port` only (a free port for 0),
    for ``TCPStore(..., master_listen_fd=fd)``, which owns it from then on. Raises
    `OSError` when `host` is no address of this machine or the port is taken."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as c10d's own listener
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock.detach()

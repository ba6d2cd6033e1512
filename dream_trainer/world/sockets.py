"""This process's connections to its peers, found and shut down through Linux ``/proc``:
a failed rank releases its peers at once (`DistributedWorld.teardown(abort=True)`)."""

from __future__ import annotations

import os
import socket

__all__ = ["shutdown_sockets", "socket_inodes"]


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

"""What a `FaultTolerantWorld` listens on, and how it receives a heal.

A heal is data from a peer: torchft 0.2's `HTTPTransport` loads it with
``weights_only=False`` (a peer could make the receiver run any code). `HealTransport`
loads it with ``weights_only=True`` plus the types registered with
``dream_trainer.allow_types`` (`dream_trainer.serialization`): anything else is refused
with `UnsafeStateError` naming what the data asked for, and nothing it names is called.
It fetches heals only over ``http://``: the address comes from the peer.

The servers a group starts listen on the address of the interface the run is configured
for (`listen_address`: the address of `FaultToleranceParameters.hostname`, ``127.0.0.1`` when
the lighthouse is on loopback) rather than on every interface, as torchft's do: the heal
server (`HealTransport`), the Manager's gRPC server (`manager_bound_to`) and a lone
process's store (`bound_store`). The lighthouse of `dream_trainer.fault_tolerance.Lighthouse` listens
where its ``bind`` says (``127.0.0.1`` by default). What still listens on every interface
is listed in ``docs/fault_tolerance.md`` (Security).
"""

from __future__ import annotations

import ipaddress
import pickle
import socket
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from http.server import ThreadingHTTPServer
from typing import Any
from urllib.parse import urlparse

from torchft.checkpointing import http_transport
from torchft.checkpointing.http_transport import HTTPTransport

from dream_trainer.errors import FaultToleranceError
from dream_trainer.serialization import allowed, refusal

__all__ = ["HealTransport", "bound_store", "listen_address", "manager_bound_to", "raise_refused_heal"]

_PATCH = threading.Lock()  # one torchft constructor at a time runs with a patched server class


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.split("%")[0]).is_loopback


def _route_to(host: str) -> str:
    """This machine's address on the route to `host` (no packet is sent)."""
    family, _, _, _, addr = socket.getaddrinfo(host, 1, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(addr)
        return probe.getsockname()[0]


def listen_address(hostname: str, lighthouse_host: str) -> tuple[str, str]:
    """``(bind, advertised)``: the address to listen on, `hostname`'s (what peers are told
    to reach), and the name to advertise, `hostname`. When `hostname` resolves to loopback
    here while the lighthouse is on another machine (a name mapped to 127.0.1.1 in
    /etc/hosts), both are this machine's address on the route to the lighthouse: listening
    on loopback would make this group unreachable."""
    try:
        address = str(ipaddress.ip_address(hostname))
    except ValueError:
        infos = socket.getaddrinfo(hostname, None, type=socket.SOCK_STREAM)
        inet4 = [info[4][0] for info in infos if info[0] == socket.AF_INET]
        address = (inet4 or [infos[0][4][0]])[0]
    if _is_loopback(address) and lighthouse_host:
        try:
            route = _route_to(lighthouse_host)
        except OSError:
            return address, hostname
        if not _is_loopback(route):
            return route, route
    return address, hostname


def url_host(host: str) -> str:
    """`host` as the host part of a URL or a ``host:port`` (IPv6 in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


@contextmanager
def _replaced(module: Any, name: str, replacement: Any) -> Iterator[None]:
    with _PATCH:
        original = getattr(module, name)
        setattr(module, name, replacement)
        try:
            yield
        finally:
            setattr(module, name, original)


def _cannot_listen(what: str, host: str, advertised: str, exc: OSError) -> Exception:
    return FaultToleranceError(
        f"{what} cannot listen on {host} (the address of this group's hostname {advertised!r}): {exc}; set "
        "FaultToleranceParameters(hostname=...) to an address of this machine that peers reach"
    )


def _server_class(host: str) -> type:
    class _BoundHTTPServer(ThreadingHTTPServer):
        """torchft's heal server (``_IPv6HTTPServer``) listening on `host` only."""

        address_family = _family(host)
        request_queue_size = 1024

        def __init__(self, server_address: Any, handler: Any) -> None:
            super().__init__((host, server_address[1]), handler)

    return _BoundHTTPServer


class HealTransport(HTTPTransport):  # type: ignore[misc]
    """torchft's HTTP heal transport, listening on `host` only, advertising `advertised`
    (torchft advertises ``socket.gethostname()``), receiving heals as data (see the
    module docstring). Unchunked: the chunked form sends a pytree spec, which is not data."""

    def __init__(self, timeout: timedelta, host: str, advertised: str) -> None:
        self._advertised = advertised
        try:
            with _replaced(http_transport, "_IPv6HTTPServer", _server_class(host)):
                super().__init__(timeout=timeout, num_chunks=0)
        except OSError as exc:
            raise _cannot_listen("the heal server", host, advertised, exc) from None

    def address(self) -> str:
        return f"http://{url_host(self._advertised)}:{self._server.socket.getsockname()[1]}/checkpoint/"

    def shutdown(self, wait: bool = True) -> None:
        """Stop serving; with `wait`, also close the listening socket (torchft leaves it
        open, and its ``wait=False`` sets a flag its server never reads)."""
        if not wait:
            self._server._BaseServer__shutdown_request = True  # the loop ends within its poll interval
            return
        self._server.shutdown()
        self._thread.join()
        self._server.server_close()

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        scheme = urlparse(metadata).scheme
        if scheme != "http":
            from dream_trainer.checkpoint import CheckpointError

            raise CheckpointError(f"a peer's heal address {metadata!r} is not an http:// URL: refused (heals are "
                                  "fetched only over http from the peer's heal server)")
        return super().recv_checkpoint(src_rank, metadata, step, timeout)

    @classmethod
    def _load_from_address(cls, address: str, timeout: timedelta) -> object:
        """The heal at `address`, loaded as data: ``UnsafeStateError`` for anything else."""
        from torch.distributed._serialization import _streaming_load

        with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
            try:
                with allowed():
                    return _streaming_load(f, weights_only=True)
            except pickle.UnpicklingError as exc:
                raise refusal(exc, f"the heal from {address}") from None


def raise_refused_heal(manager: Any, group_id: int) -> None:
    """Raise the error of this step's heal when it was refused (unsafe or damaged data):
    torchft reports it to the Manager and leaves the step uncommitted (nothing of it is
    applied), so the group would heal again, and be refused again, at every step."""
    from dream_trainer.checkpoint import CheckpointError

    error = manager.errored()
    refused = error.original_exception if error is not None else None
    if isinstance(refused, CheckpointError):
        raise type(refused)(f"replica group {group_id} cannot heal from its peer: {refused}") from None


@contextmanager
def manager_bound_to(host: str) -> Iterator[None]:
    """While a torchft ``Manager`` is constructed inside: its gRPC server listens on
    `host` (torchft binds ``[::]:port``, every interface)."""
    import torchft.manager as manager_module

    original = manager_module.ManagerServer

    def bound(*args: Any, bind: str, **kwargs: Any) -> Any:
        port = bind.rsplit(":", 1)[1]
        return original(*args, bind=f"{url_host(host)}:{port}", **kwargs)

    with _replaced(manager_module, "ManagerServer", bound):
        yield


def bound_store(host: str, advertised: str) -> Any:
    """A ``TCPStore`` server listening on `host` only (by default it listens on every
    interface, whatever its host name), on a free port."""
    import torch

    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        sock.listen(128)
        port = sock.getsockname()[1]
    except OSError as exc:
        sock.close()
        raise _cannot_listen("the group's store", host, advertised, exc) from None
    # The store owns the socket from here (it closes it).
    return torch.distributed.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                      master_listen_fd=sock.detach(), use_libuv=True)

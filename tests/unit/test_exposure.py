"""What a run exposes and what it lets others point it at (issue 39, item 5).

- The rendezvous store rank 0 serves (`dream_trainer.world.rendezvous`, the store of the
  ``--nproc`` launcher's ranks and of a SLURM run) listens on the address its peers use
  (``MASTER_ADDR``), not on every interface as c10d's ``TCPStore`` does by default: read
  from this process's sockets in ``/proc/net/tcp{,6}``.
- A DCP checkpoint's ``.metadata`` names the files its tensors and values are read from;
  a crafted one could point reads anywhere (an absolute path, ``..``, a symlink out of the
  directory). Loading confines every storage path to the checkpoint's directory.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dream_trainer.checkpoint import _dcp_load, load_checkpoint
from dream_trainer.cluster import ClusterEnvironment
from dream_trainer.serialization import UnsafeStateError, safe_reader
from dream_trainer.testing.fault_tolerance import listening
from dream_trainer.world import rendezvous

LINUX_PROC = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux /proc/net")
TIMEOUT = timedelta(seconds=10)
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _local_address() -> str | None:
    """A non-loopback IPv4 address of this machine, or None."""
    candidates = []
    try:
        candidates.append(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # no packet is sent
            probe.connect(("192.0.2.1", 9))
            candidates.append(probe.getsockname()[0])
    except OSError:
        pass
    for address in candidates:
        if not address.startswith("127."):
            try:
                with socket.socket() as s:
                    s.bind((address, 0))
                return address
            except OSError:
                continue
    return None


def _served_at(cluster: ClusterEnvironment) -> list[tuple[str, int]]:
    """Where rank 0's store for `cluster` listens (this process's listening sockets on its port)."""
    store = rendezvous._store(cluster, TIMEOUT, server=True)
    try:
        store.set("probe", "1")
        return [s for s in listening([os.getpid()]) if s[1] == cluster.master_port]
    finally:
        del store


# --------------------------------------------------------------------- a) the rendezvous store
@LINUX_PROC
def test_the_store_of_a_local_run_listens_on_loopback_only():
    """What the ``--nproc`` launcher gives its ranks (MASTER_ADDR=127.0.0.1, one node):
    rank 0's store listens on 127.0.0.1 and nowhere else (c10d alone: ``::``)."""
    port = _free_port()
    cluster = ClusterEnvironment(source="torchrun", world_size=2, local_world_size=2, num_nodes=1,
                                 master_addr="127.0.0.1", master_port=port)
    assert _served_at(cluster) == [("127.0.0.1", port)]


@LINUX_PROC
def test_the_store_of_a_multi_node_run_listens_on_the_master_address_only():
    """Several nodes, MASTER_ADDR a (non-loopback) address of this machine: the store
    listens there, and a connection to the same port on loopback is refused."""
    address = _local_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    port = _free_port(address)
    cluster = ClusterEnvironment(source="slurm", world_size=4, local_world_size=2, num_nodes=2,
                                 master_addr=address, master_port=port)
    store = rendezvous._store(cluster, TIMEOUT, server=True)
    try:
        assert [s for s in listening([os.getpid()]) if s[1] == port] == [(address, port)]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        client = rendezvous._store(cluster, TIMEOUT, server=False)  # a peer reaches it at MASTER_ADDR
        store.set("k", "v")
        assert client.get("k") == b"v"
    finally:
        del store


def _resolving(monkeypatch, name: str, address: str) -> None:
    real = socket.getaddrinfo

    def fake(host, *args, **kwargs):
        if host == name:
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, 0))]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", fake)


def test_where_the_store_listens(monkeypatch):
    """An address is used as it is; a name, where it resolves here. A node's own name that
    resolves to loopback here (127.0.1.1 from /etc/hosts) while other nodes must reach it
    leaves the store on every interface (None: they resolve the name to the node's real
    address, which loopback would not answer)."""
    one, two = (ClusterEnvironment(source="slurm", world_size=2 * n, local_world_size=2, num_nodes=n) for n in (1, 2))
    assert rendezvous.listen_host(one, "127.0.0.1") == "127.0.0.1"
    assert rendezvous.listen_host(two, "127.0.0.1") == "127.0.0.1"  # every node's 127.0.0.1 is its own
    assert rendezvous.listen_host(two, "10.1.2.3") == "10.1.2.3"
    assert rendezvous.listen_host(two, "::1") == "::1"
    _resolving(monkeypatch, "gpu-7", "10.1.2.3")
    assert rendezvous.listen_host(two, "gpu-7") == "10.1.2.3"
    _resolving(monkeypatch, "gpu-8", "127.0.1.1")
    assert rendezvous.listen_host(one, "gpu-8") == "127.0.1.1"
    assert rendezvous.listen_host(two, "gpu-8") is None


# --------------------------------------------------------------------- b) DCP storage paths
def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """A real DCP checkpoint of a small state, saved in this process."""
    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return state


def _point_reads_at(path: Path, relative_path: str) -> None:
    """Rewrite the checkpoint's metadata: every storage entry read from `relative_path`."""
    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own file, just written by dcp.save
    for info in metadata.storage_data.values():
        info.relative_path = relative_path
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def _template() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(2, 3), "b": torch.zeros(3)}


def _moved_out(tmp_path: Path) -> tuple[Path, Path]:
    """A checkpoint whose data file was moved out of its directory: (checkpoint, the file)."""
    ckpt = tmp_path / "ckpt"
    _checkpoint(ckpt)
    (data,) = ckpt.glob("*.distcp")
    outside = tmp_path / "elsewhere" / data.name
    outside.parent.mkdir()
    shutil.move(data, outside)
    return ckpt, outside


def test_a_normal_checkpoint_still_loads(tmp_path):
    state = _checkpoint(tmp_path / "ckpt")
    loaded = load_checkpoint(tmp_path / "ckpt", _template())
    assert all(torch.equal(loaded[k], state[k]) for k in state)


@pytest.mark.parametrize("form", ["absolute", "dotdot"])
def test_metadata_pointing_reads_outside_the_checkpoint_is_refused(tmp_path, form):
    """The data file lies outside the checkpoint and the metadata points at it (by its
    absolute path, or ``../``): DCP alone would read it (the test can fail); loading
    refuses, naming the path."""
    ckpt, outside = _moved_out(tmp_path)
    pointer = str(outside) if form == "absolute" else f"../elsewhere/{outside.name}"
    _point_reads_at(ckpt, pointer)
    dcp.load(_template(), checkpoint_id=str(ckpt), no_dist=True)  # torch's own reader follows it
    with pytest.raises(UnsafeStateError, match="outside the checkpoint") as info:
        load_checkpoint(ckpt, _template())
    assert repr(pointer) in str(info.value) and str(ckpt) in str(info.value)


def test_a_symlink_out_of_the_checkpoint_is_refused(tmp_path):
    ckpt, outside = _moved_out(tmp_path)
    (ckpt / outside.name).symlink_to(outside)
    dcp.load(_template(), checkpoint_id=str(ckpt), no_dist=True)  # torch's own reader follows it
    with pytest.raises(UnsafeStateError, match="outside the checkpoint") as info:
        load_checkpoint(ckpt, _template())
    assert repr(outside.name) in str(info.value) and str(outside) in str(info.value)


def test_a_relative_path_inside_the_checkpoint_still_loads(tmp_path):
    """``sub/../file`` stays inside: allowed (only escapes are refused)."""
    ckpt = tmp_path / "ckpt"
    state = _checkpoint(ckpt)
    (data,) = ckpt.glob("*.distcp")
    (ckpt / "sub").mkdir()
    _point_reads_at(ckpt, f"sub/../{data.name}")
    loaded = load_checkpoint(ckpt, _template())
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_the_metadata_a_load_is_planned_with_is_checked_too(tmp_path):
    """The reader checks the metadata DCP sets it up with (whoever read it), not only
    what it reads itself; and a load through DCP alone (no earlier metadata read) raises
    the refusal, not DCP's "metadata is None"."""
    ckpt, outside = _moved_out(tmp_path)
    _point_reads_at(ckpt, str(outside))
    with open(ckpt / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    with pytest.raises(UnsafeStateError, match=re.escape(f"points a read at {str(outside)!r}")):
        safe_reader(str(ckpt)).set_up_storage_reader(metadata, False)
    with pytest.raises(UnsafeStateError, match=re.escape(f"points a read at {str(outside)!r}")):
        _dcp_load(_template(), ckpt, no_dist=True)

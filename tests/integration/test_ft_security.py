"""Fault tolerance and what a peer can do: a heal is received as data (a crafted one is
refused, its command never runs), and a group's servers listen on the interface the run is
configured for (loopback for a local run), not on every interface.

Nothing a local run starts listens on every interface (asserted below, documented in
docs/security.md): torchft's heal server and Manager gRPC server (bound by dream_trainer),
a lone process's store (dream_trainer's, bound likewise), the in-group store of a
multi-process group (``MASTER_ADDR:MASTER_PORT``, which rank 0 of the ``--nproc``
launcher's rendezvous serves on ``MASTER_ADDR``: `dream_trainer.world.rendezvous`), and
gloo's pair sockets (gloo binds the address of this machine's hostname, or of
``GLOO_SOCKET_IFNAME``: loopback on this test machine, a LAN address on most clusters)
listen on loopback here. The lighthouse of `dream_trainer.fault_tolerance.Lighthouse`
listens where its ``bind`` says (``127.0.0.1`` by default).

Every process is ended whatever happens; the tests wait on events (gate files, exits),
never on timings.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlparse

import pytest
import torch

if importlib.util.find_spec("torchft") is None:
    pytest.skip("torchft is not installed", allow_module_level=True)

from dream_trainer.checkpoint import CheckpointError  # noqa: E402
from dream_trainer.fault_tolerance import Lighthouse  # noqa: E402
from dream_trainer.serialization import UnsafeStateError  # noqa: E402
from dream_trainer.testing.fault_tolerance import ReplicaGroup, descendants, listening, start_together, wait_until  # noqa: E402

HERE = Path(__file__).resolve().parent
TIMEOUT = timedelta(seconds=20)


@pytest.fixture
def lighthouse():
    with Lighthouse(bind="127.0.0.1:0", heartbeat_timeout_ms=1000, join_timeout_ms=200) as server:
        yield server


def _worker(root, group, lighthouse, *args, nproc=1):
    argv = [sys.executable, str(HERE / "ft_worker.py"), "--group", str(group), "--root", str(root), *args]
    if nproc > 1:
        argv += ["--nproc", str(nproc), "--parallel", "ddp"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHFT_LIGHTHOUSE=lighthouse.address)
    env.pop("GLOO_SOCKET_IFNAME", None)  # gloo binds where the machine's hostname says
    group_dir = Path(root) / "ft" / "ft" / f"replica_group_{group}"
    return ReplicaGroup(argv, group_dir, env, output=Path(root) / f"group{group}.log")


class Payload:
    """A crafted object: unpickling it calls ``os.mkdir(path)``."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


# --------------------------------------------------------------------- a heal is data
@pytest.mark.filterwarnings("ignore:The given buffer is not writable")  # torch, reading a heal stream
def test_a_crafted_heal_is_refused_and_its_command_never_runs(tmp_path):
    """The transport a FaultTolerantWorld uses: a state whose unpickling would run
    ``os.mkdir`` is refused with UnsafeStateError naming it, and the directory never
    appears; torchft's own transport (weights_only=False) does run it (the payload is
    live: this test can fail). Plain data, DTensor placements included, still heals."""
    from torch.distributed.tensor import Replicate, Shard
    from torchft.checkpointing.http_transport import HTTPTransport

    from dream_trainer.fault_tolerance.transport import HealTransport

    peer = HealTransport(TIMEOUT, host="127.0.0.1", advertised="127.0.0.1")
    receiver = HealTransport(TIMEOUT, host="127.0.0.1", advertised="127.0.0.1")
    try:
        state = {"user": {"trainer": {"w": torch.arange(4.0), "placements": (Shard(0), Replicate()), "n": 3}},
                 "torchft": {"step": 5, "batches_committed": 10}}
        peer.send_checkpoint([1], 5, state, TIMEOUT)
        healed = receiver.recv_checkpoint(0, peer.metadata(), 5, TIMEOUT)
        assert torch.equal(healed["user"]["trainer"]["w"], torch.arange(4.0))
        assert healed["user"]["trainer"]["placements"] == (Shard(0), Replicate()) and healed["torchft"]["step"] == 5

        marker = tmp_path / "ran"
        peer.disallow_checkpoint()
        peer.send_checkpoint([1], 6, {"user": {"trainer": {"w": torch.ones(2), "x": Payload(marker)}}}, TIMEOUT)
        with pytest.raises(UnsafeStateError, match=r"the heal from http://127\.0\.0\.1:\d+/checkpoint/6/full asks "
                                                   r"for posix\.mkdir.*refused and nothing it names was executed"):
            receiver.recv_checkpoint(0, peer.metadata(), 6, TIMEOUT)
        assert not marker.exists()
        HTTPTransport._load_from_address(f"{peer.metadata()}6/full", TIMEOUT)  # torchft's receive runs it
        assert marker.is_dir()

        # The address to fetch from comes from the peer: only http.
        with pytest.raises(CheckpointError, match=r"heal address 'file:///etc/' is not an http:// URL"):
            receiver.recv_checkpoint(0, "file:///etc/", 6, TIMEOUT)
    finally:
        peer.shutdown()
        receiver.shutdown()


def test_a_group_refuses_a_crafted_heal_and_fails_clearly(tmp_path, lighthouse):
    """Two groups whose heals carry that payload (a malicious peer), in the first quorum
    together: the group that heals (init_sync: one of them, at step 0) refuses it, applies
    nothing and fails at once with UnsafeStateError (not a hang, not an endless retry);
    the directory never appears; the other group trains on alone to the end."""
    marker = tmp_path / "ran"
    groups = [_worker(tmp_path, g, lighthouse, "--steps", "4", "--evil-heal", str(marker)) for g in (0, 1)]
    try:
        start_together(groups, tmp_path / "go")
        codes = sorted(group.wait(timeout=120) for group in groups)
    finally:
        for group in groups:
            group.kill()
    assert codes == [0, 1]
    refused = next(g for g in groups if g.returncode == 1)
    output = refused.output.read_text()
    assert "UnsafeStateError: replica group " in output and " cannot heal from its peer: the heal from http://" \
        "127.0.0.1:" in output and "asks for posix.mkdir" in output, output[-3000:]
    assert "got exception in recovery" not in output  # one error, not torchft's traceback first
    assert not marker.exists()
    events = refused.events()
    assert not [e for e in events if e["event"] in ("heal", "step")]  # nothing applied, nothing trained
    assert [e["status"] for e in events if e["event"] == "end"] == ["failed"]
    survivor = next(g for g in groups if g.returncode == 0)
    assert [e["step"] for e in survivor.events() if e["event"] == "step" and e["committed"]][-1] == 4


# --------------------------------------------------------------------- what listens where
def _every_interface(ip):
    return ipaddress.ip_address(ip).is_unspecified


def _environ(pid):
    try:
        text = Path(f"/proc/{pid}/environ").read_text()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in text.split("\0") if "=" in item)


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux /proc/net")
def test_what_a_local_run_listens_on(tmp_path, lighthouse):
    """A local run (lighthouse on 127.0.0.1): a group of 2 ranks (a launcher's rendezvous)
    and a lone process, held before their first quorum (their Managers, heal servers and
    stores are up). The lighthouse, every heal server, every Manager gRPC server, the
    lone process's store and the in-group store of the 2-rank group (MASTER_PORT) listen
    on loopback only; nothing of the run listens on every interface. Then the 2-rank group
    trains to the end."""
    pair, lone = _worker(tmp_path, 0, lighthouse, "--steps", "3", nproc=2), _worker(tmp_path, 1, lighthouse)
    groups = [pair, lone]
    try:
        for group, gate in ((pair, tmp_path / "go-0"), (lone, tmp_path / "go-1")):
            group.start([*group.argv, "--gate", str(gate)])
        wait_until(lambda: all((g.dir / f"go-{i}.ready").exists() for i, g in enumerate(groups)), groups, 300,
                   "both groups up")
        sockets = {g: listening([group.proc.pid, *descendants(group.proc.pid)]) for g, group in enumerate(groups)}
        store_ports = {int(env["MASTER_PORT"]) for env in map(_environ, descendants(pair.proc.pid))
                       if "MASTER_PORT" in env}
        own = listening([os.getpid()])
        lone.kill()  # never in a quorum: the 2-rank group's first quorum goes on without it
        (tmp_path / "go-0").touch()
        assert pair.wait(timeout=300) == 0
    finally:
        for group in groups:
            group.kill()
    lighthouse_port = urlparse(lighthouse.address).port
    assert [s for s in own if s[1] == lighthouse_port] == [("127.0.0.1", lighthouse_port)]
    addresses = {g: [json.loads(p.read_text()) for p in sorted(group.dir.glob("addresses.rank*.json"))]
                 for g, group in enumerate(groups)}
    assert [len(addresses[0]), len(addresses[1])] == [2, 1]
    for g in (0, 1):
        servers = [urlparse(a["heal"]).port for a in addresses[g]] + \
                  [urlparse(a["manager"]).port for a in addresses[g] if "manager" in a]
        assert len(servers) == len(addresses[g]) + 1  # a heal server per rank, one Manager server per group
        for port in servers:
            assert [ip for ip, p in sockets[g] if p == port] == ["127.0.0.1"], (g, port, sockets[g])
    assert len(store_ports) == 1, store_ports
    assert [ip for ip, p in sockets[0] if p in store_ports] == ["127.0.0.1"], (sockets[0], store_ports)
    everywhere = {g: {p for ip, p in sockets[g] if _every_interface(ip)} for g in (0, 1)}
    assert everywhere == {0: set(), 1: set()}, sockets  # the lone process's own store: loopback too

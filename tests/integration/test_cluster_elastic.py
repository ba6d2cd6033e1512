"""A node lost for good under ``torchrun --nnodes 1:2``: FSDP2 sharded over two "nodes" of 2
ranks (4-way), a checkpoint on a validation step, then one node dies (its agent and its
ranks, SIGKILL); the other node's agent restarts its ranks on one node (2-way), which resume
the 4-way checkpoint and finish the run. The token loader's position is global, so the
survivors train on the same global batches as a run that never lost a node: the losses
track the demo on one node (2 DDP ranks) from the same seed, and no step is trained twice.

Two torchrun invocations on this machine with a c10d rendezvous on 127.0.0.1; node 0 starts
first, so its agent hosts the rendezvous store (the node that dies must not be the one
holding it)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_cluster_launch import ARGS, DEMO, TIMEOUT_S, _descendants, _free_port, _losses, _run, _start


def _elastic_node(node: int, port: int, root: Path) -> subprocess.Popen[str]:
    """``torchrun --nnodes 1:2`` with 2 ranks, one restart allowed. A rendezvous round closes
    at once with 2 nodes, or 30 s after the first joined (its last call: time enough for node 1
    to start on a busy machine, which then makes the first world 4 ranks)."""
    return _start([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic",
                   "--rdzv-conf", "last_call_timeout=30", "--max-restarts", "1", "--monitor-interval", "0.2",
                   str(DEMO), *ARGS, "--parallel", "fsdp", "--root-dir", str(root)], root,
                  {"GLOO_SOCKET_IFNAME": "lo"})


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_fsdp2_over_two_nodes_loses_one_and_finishes_on_the_other(tmp_path):
    reference_root = tmp_path / "reference"
    reference_root.mkdir()
    reference = _start([sys.executable, str(DEMO), "--nproc", "2", *ARGS, "--root-dir", str(reference_root),
                        "--run-name", "ref"], reference_root, {})
    port = _free_port()
    first = _elastic_node(0, port, tmp_path)
    procs = [first]
    run = tmp_path / "gpt" / "torchrun-elastic"
    failed, shards = None, []
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not _listening(port):  # node 0's agent hosts the store
            if first.poll() is not None or time.monotonic() > deadline:
                failed = "node 0 never listened"
                break
            time.sleep(0.05)
        if failed is None:
            second = _elastic_node(1, port, tmp_path)
            procs.append(second)
            while not (run / "checkpoints" / "step_000000010").is_dir():
                if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                    failed = "no checkpoint at step 10"
                    break
                time.sleep(0.05)
            else:
                for pid in [second.pid, *_descendants(second.pid)]:  # the whole node: its agent and its 2 ranks
                    os.kill(pid, signal.SIGKILL)  # (torchrun starts its ranks in sessions of their own)
                shards = sorted(p.name for p in (run / "checkpoints" / "step_000000010").glob("*.distcp"))
    finally:
        if failed is not None:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
        outs = _run(procs + [reference])
    assert failed is None, failed + "\n----\n" + "\n----\n".join(o[-3000:] for o in outs)
    assert len(shards) == 4, shards  # the checkpoint of a 4-rank world: both nodes were in it
    assert first.returncode == 0, outs[0][-4000:]
    ref = _losses(reference_root / "gpt" / "ref" / "logs")
    assert sorted(ref) == [5, 10, 15, 20, 25, 30], outs[-1][-3000:]
    records = [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    logged = [r["step"] for r in records if "train/loss" in r]
    # Resumed from step 10 on one node, not restarted from scratch (steps 5 and 10 would show
    # twice); a step the 4-rank world logged after 10, before the kill, is trained again.
    assert logged[-1] == 30 and logged.count(5) == logged.count(10) == 1, logged
    # 4 FSDP ranks, then 2, against 2 DDP ranks: the same global batches, other reduction orders.
    losses = _losses(run / "logs")
    assert losses == pytest.approx(ref, rel=1e-4), (losses, ref)

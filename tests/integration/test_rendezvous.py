"""The world's roll call and heartbeat (`dream_trainer.world.rendezvous`) across real
processes on loopback: a rank that never arrives, the rank hosting the store missing, a
rank killed mid-run and a rank failing of its own are each named by the others, within the
configured timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_cluster_launch import _free_port

WORKER = Path(__file__).with_name("rendezvous_worker.py")
ROOT = Path(__file__).resolve().parents[2]
BOUND_S = 60  # a generous bound for every case (the timeouts used are 3 s)


def _ranks(ranks: list[int], port: int, *args: str) -> dict[int, subprocess.Popen[str]]:
    """Ranks of a 2-rank world, one per "node" (``LOCAL_WORLD_SIZE=1``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "DREAM_TRAINER_"))}
    env.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return {r: subprocess.Popen([sys.executable, str(WORKER), *args],
                                env={**env, "RANK": str(r), "LOCAL_RANK": "0", "GROUP_RANK": str(r)},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
            for r in ranks}


def _finish(procs: dict[int, subprocess.Popen[str]]) -> dict[int, str]:
    outs = {}
    try:
        for r, proc in procs.items():
            outs[r] = proc.communicate(timeout=BOUND_S)[0]
    except subprocess.TimeoutExpired:
        pytest.fail("a rank did not end within the bound")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    return outs


def test_a_rank_that_never_arrives_is_named_when_the_init_timeout_passes():
    procs = _ranks([0], _free_port(), "--init-timeout", "3")
    out = _finish(procs)[0]  # fails the test unless the rank ends within BOUND_S
    assert procs[0].returncode != 0
    assert "RendezvousError: 1 of 2 ranks did not arrive within 3 s (init_timeout_s): rank 1 (node 1)" in out, out[-2000:]


def test_a_missing_rank_zero_is_named_as_the_store_host():
    port = _free_port()
    procs = _ranks([1], port, "--init-timeout", "3")
    out = _finish(procs)[1]
    assert procs[1].returncode != 0
    assert f"the rendezvous store at 127.0.0.1:{port} (rank 0 (node 0)) could not be reached within 3 s" in out, out[-2000:]


@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_killed_mid_run_is_named_by_the_other(victim):
    procs = _ranks([0, 1], _free_port(), "--init-timeout", "30", "--victim", str(victim), "--die-at", "20")
    outs = _finish(procs)
    survivor = 1 - victim
    assert procs[victim].returncode == -signal.SIGKILL and procs[survivor].returncode == 1, outs
    if victim == 1:
        assert "dream_trainer: rank 1 (node 1, host " in outs[0] and "stopped answering" in outs[0], outs[0][-2000:]
    else:  # the store lived in rank 0: its loss is what the survivor can tell
        assert "dream_trainer: the run's store, hosted by rank 0 (node 0, host " in outs[1], outs[1][-2000:]


def test_a_rank_failing_of_its_own_is_named_with_its_error():
    procs = _ranks([0, 1], _free_port(), "--init-timeout", "30", "--victim", "1", "--fail-at", "20")
    outs = _finish(procs)
    assert procs[0].returncode == procs[1].returncode == 1, outs
    assert "ValueError: boom" in outs[1]
    assert "dream_trainer: rank 1 (node 1, host " in outs[0] and "failed: ValueError: boom" in outs[0], outs[0][-2000:]

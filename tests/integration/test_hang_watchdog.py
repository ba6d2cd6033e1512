"""A hang names the rank (`dream_trainer.world.watchdog`): two real processes, a real trainer
(DDP over gloo), rank 1 stuck at step 3 — in its data loader, or blocked in a callback. Rank 0,
waiting in the step's gradient reduction, names rank 1 (the collective's number and name,
the step, the phase and rank 1's Python stack) within seconds; both processes end with a
clear error, exit status 1, long before the collective timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dream_trainer.launch import free_port

WORKER = Path(__file__).with_name("hang_worker.py")
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120  # the collective timeout: without the watchdog rank 0 would wait this long
BOUND_S = 110  # every process must have ended by then (a hang fails the test, never blocks it)


def _run(root: Path, mode: str) -> tuple[dict[int, subprocess.Popen[str]], dict[int, str], dict[int, float]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "DREAM_TRAINER_"))}
    env.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    args = [sys.executable, str(WORKER), str(root), mode, "--hang-report", "2", "--timeout", str(TIMEOUT_S)]
    procs = {r: subprocess.Popen(args, env={**env, "RANK": str(r), "LOCAL_RANK": "0", "GROUP_RANK": str(r)},
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for r in (0, 1)}
    outs, ended = {}, {}
    deadline = time.monotonic() + BOUND_S
    try:
        for r, proc in procs.items():
            outs[r] = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
            ended[r] = time.time()
    except subprocess.TimeoutExpired:
        pytest.fail(f"a rank did not end within {BOUND_S} s (the collective timeout is {TIMEOUT_S} s)")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    return procs, outs, ended


@pytest.mark.parametrize("mode", ["data", "callback"])
def test_a_rank_stuck_outside_a_collective_is_named_and_both_ranks_stop(tmp_path, mode):
    procs, outs, ended = _run(tmp_path, mode)
    zero, one = outs[0], outs[1]
    assert procs[0].returncode == 1 and procs[1].returncode == 1, (zero[-3000:], one[-3000:])
    assert "status=failed exit_code=1" in zero and "status=failed exit_code=1" in one
    # Rank 0 waited in the gradient reduction and names rank 1, where it is and its stack.
    assert "rank 1 (node 1, host " in zero and "has not entered collective #" in zero, zero[-3000:]
    assert "(backward: gradient reduction); it was last seen at step 3 in " in zero, zero[-3000:]
    if mode == "data":
        assert "in data (fetching the next batch)" in zero
        assert "in __getitem__" in zero and "time.sleep(600)" in zero, zero[-3000:]
    else:
        assert "in the step's end (post_train_step" in zero
        assert "in post_train_step" in zero and "threading.Event().wait(600)" in zero, zero[-3000:]
    assert "ERROR dream_trainer.world.watchdog: a collective hang: rank 0 (node 0, host " in zero
    assert "dream_trainer: rank 0 (node 0, host " in zero  # the note on the error rank 0's fit() raised
    # Rank 1 was stopped where it was stuck, with an error that says why.
    assert "CollectiveHang: rank 0 (node 0, host " in one, one[-3000:]
    assert "reported that this rank has not entered collective #" in one
    # Both ended long before the collective timeout would have ended rank 0's wait.
    stuck_at = float((tmp_path / "stuck_at").read_text())
    assert max(ended.values()) - stuck_at < TIMEOUT_S, (ended, stuck_at)

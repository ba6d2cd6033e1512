"""spawn_world: results per rank; a failing rank ends the others promptly with its traceback."""

import os
import time

import pytest
import torch.distributed as dist

from dream_trainer.testing import SpawnError, spawn_world


def _rank_info(offset):
    dist.init_process_group("gloo")
    t = __import__("torch").tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(t)
    return dist.get_rank(), os.environ["MASTER_ADDR"], t.item(), os.getpid()


def _one_rank_fails():
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ValueError("rank one is broken")
    dist.barrier()  # rank 0 would wait here forever
    return "unreachable"


def test_results_in_rank_order():
    results = spawn_world(2, _rank_info, 10)
    assert [(r[0], r[1], r[2]) for r in results] == [(0, "127.0.0.1", 21.0), (1, "127.0.0.1", 21.0)]
    for *_, pid in results:  # every process has ended
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_failing_rank_ends_the_run_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(SpawnError, match=r"(?s)rank 1.*ValueError: rank one is broken"):
        spawn_world(2, _one_rank_fails, timeout=60)
    assert time.monotonic() - start < 30  # the blocked rank 0 was terminated, not waited for

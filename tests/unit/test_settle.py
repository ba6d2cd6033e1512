"""The wait at exit for gloo's worker threads (`dream_trainer.world.settle`): a runnable
worker is waited for (up to the timeout), idle ones are not, and a real gloo group's workers
are idle once its collectives returned."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from dream_trainer.world import settle
from dream_trainer.world.settle import runnable_workers, settle_workers

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
NAME = "dt_test_worker"


def _busy(ready: threading.Event, stop: threading.Event) -> None:
    """A thread named like a worker that stays runnable: matmuls release the GIL, so it
    computes (state R) while the test thread polls."""
    Path(f"/proc/self/task/{threading.get_native_id()}/comm").write_text(NAME)
    a = torch.randn(256, 256)
    ready.set()
    while not stop.is_set():
        for _ in range(50):
            a = torch.tanh(a @ a)


def test_a_runnable_worker_is_waited_for_then_released_when_it_sleeps():
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(target=_busy, args=(ready, stop), daemon=True)
    threading_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the matmuls on this thread itself
    thread.start()
    try:
        assert ready.wait(30)
        seen = any(runnable_workers((NAME,)) for _ in range(200))
        assert seen, "the busy thread was never runnable"
        started = time.monotonic()
        assert settle_workers(timeout_s=0.3, names=(NAME,)) is False  # it never went quiet
        assert time.monotonic() - started >= 0.3
    finally:
        stop.set()
        thread.join(30)
        torch.set_num_threads(threading_threads)
    assert settle_workers(timeout_s=5.0, names=(NAME,)) is True  # gone: nothing to wait for


def test_a_gloo_groups_workers_are_idle_after_its_collectives(monkeypatch):
    import torch.distributed as dist

    from dream_trainer import DeviceParameters, DistributedWorld

    monkeypatch.setattr(settle, "_installed", False)
    registered = []
    monkeypatch.setattr(settle.atexit, "register", registered.append)
    world = DistributedWorld(DeviceParameters.SINGLE_DEVICE())
    world.launch()
    try:
        out = [None]
        dist.all_gather_object(out, {"step": 3})
        assert out == [{"step": 3}]
        names = {Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in __import__("os").listdir("/proc/self/task")}
        assert "pt_gloo_runloop" in names  # the threads the exit hook watches exist under this name
        assert settle_workers(timeout_s=5.0) is True
    finally:
        world.teardown()
    world2 = DistributedWorld(DeviceParameters.SINGLE_DEVICE())
    world2.launch()
    world2.teardown()
    assert registered == [settle_workers]  # installed once per process


def test_a_world_destroys_its_group_only_once_the_workers_are_idle():
    """A group's destructor joins its worker threads under the GIL: a worker still releasing
    its last work (it needs the GIL) would hang that join. The world's teardown waits for
    runnable workers first; here a thread under the workers' own name stays runnable for
    0.3 s after the collective."""
    import torch.distributed as dist

    from dream_trainer import DeviceParameters, DistributedWorld

    world = DistributedWorld(DeviceParameters.SINGLE_DEVICE())
    world.launch()
    ready, stop = threading.Event(), threading.Event()
    threading_threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def worker() -> None:
        _busy(ready, stop)

    thread = threading.Thread(target=worker, daemon=True)
    try:
        out = [None]
        dist.all_gather_object(out, 1)
        thread.start()
        assert ready.wait(30)
        Path(f"/proc/self/task/{thread.native_id}/comm").write_text(settle.WORKER_NAMES[0])
        threading.Timer(0.3, stop.set).start()
        started = time.monotonic()
        world.teardown()
        waited = time.monotonic() - started
    finally:
        stop.set()
        thread.join(30)
        torch.set_num_threads(threading_threads)
    assert not dist.is_initialized()
    assert 0.25 <= waited < 2.0, waited  # it waited for the worker, and not until the timeout

"""Let gloo's worker threads finish before the interpreter is finalized.

A gloo collective runs on one of its process group's worker threads (``pt_gloo_runloop``).
The caller's ``wait()`` returns when the work completes, but the worker drops its reference
to the work (and so to the work's tensors) a moment later. When Python has already dropped
its own references, the tensors' Python objects are kept alive by torch and released by that
worker, which must take the GIL to do it. If the process has meanwhile reached interpreter
finalization (a short run, a busy machine: the worker was not scheduled in between), taking
the GIL exits the worker thread from inside C++ code and the process aborts with
``terminate called without an active exception`` (exit status 134) after a run that
succeeded (pytorch/pytorch#179291 describes the same). This was seen once in this project's CI
and reproduced 7 times in 67 two-rank ``summarize`` runs on a loaded 2-core machine (none in
90 with this wait), the core dump showing a gloo worker in ``~AsyncAllgatherWork`` ->
``decref_pyobject`` -> ``take_gil`` -> ``pthread_exit`` while the main thread was in
``Py_FinalizeEx``'s collection.

The same late release can also deadlock a live process: the last reference to a gloo group
dropped under the GIL (``dist.destroy_process_group()``, or a DDP module's reducer collected
when the function that made it returns) destroys the group, whose destructor joins its worker
threads, still holding the GIL; a worker that is releasing its last work waits for the GIL
and the join never returns. Seen as a hang of `benchmarks/parallel.py --smoke` (about 1 run
in 20 on the 2-core machine): rank 0 in ``~ProcessGroupGloo`` -> ``std::thread::join`` under
``Reducer`` deallocation, its worker in ``~AsyncAllreduceWork`` -> ``gil_scoped_acquire``,
rank 1 waiting for it in the next run's rendezvous.

`settle_workers` waits, with the GIL released, until none of the process's gloo worker
threads is runnable (Linux ``/proc``: none in state ``R`` at two checks a couple of
milliseconds apart); a worker waiting for the GIL gets it while this thread sleeps. It runs
from an ``atexit`` hook that the world installs when it creates a gloo process group
(`install_exit_settle`): after the program's last collective, before finalization; and
before a world destroys its group (`destroy_settled`), so the group's threads are idle when
anything joins them.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from pathlib import Path

import torch.distributed as dist

logger = logging.getLogger(__name__)

WORKER_NAMES = ("pt_gloo_runloop",)
"""The OS names (``/proc/self/task/*/comm``) of the threads that release a collective's work."""

_installed = False


def runnable_workers(names: tuple[str, ...] = WORKER_NAMES) -> list[int]:
    """The thread ids of this process's threads named in `names` that are runnable (state
    ``R``); empty where ``/proc`` is not there."""
    task = Path("/proc/self/task")
    busy = []
    try:
        tids = os.listdir(task)
    except OSError:
        return []
    for tid in tids:
        try:
            if (task / tid / "comm").read_text().strip() not in names:
                continue
            state = (task / tid / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # the thread ended meanwhile
        if state == "R":
            busy.append(int(tid))
    return busy


def settle_workers(timeout_s: float = 2.0, names: tuple[str, ...] = WORKER_NAMES) -> bool:
    """Sleep in 2 ms steps (the GIL released) until no thread named in `names` is runnable
    at two checks in a row, or `timeout_s` passes. True when they settled."""
    deadline = time.monotonic() + timeout_s
    calm = 0
    while True:
        calm = 0 if runnable_workers(names) else calm + 1
        if calm >= 2:
            return True
        if time.monotonic() >= deadline:
            logger.debug("gloo worker threads still runnable after %.1f s at exit", timeout_s)
            return False
        time.sleep(0.002)


def install_exit_settle() -> None:
    """Run `settle_workers` at interpreter exit, once per process."""
    global _installed
    if not _installed:
        _installed = True
        atexit.register(settle_workers)


def destroy_settled() -> None:
    """``dist.destroy_process_group()`` once gloo's workers have settled (see the module
    docstring: destroying a group joins its threads under the GIL)."""
    settle_workers()
    dist.destroy_process_group()

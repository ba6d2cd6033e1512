"""`spawn_world`: run a function on N gloo ranks on loopback and collect the results."""

from __future__ import annotations

import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dream_trainer.launch import free_port
from dream_trainer.world.settle import destroy_settled


class SpawnError(RuntimeError):
    """A rank of `spawn_world` failed, died or timed out."""


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
            env: dict[str, str], results: Any) -> None:
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        GLOO_SOCKET_IFNAME="lo",
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        # Plain pickle bytes: a tensor sent through the queue as-is would be shared by file
        # descriptor, which dies with this process.
        value = pickle.dumps(fn(*args))
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            destroy_settled()  # the group's threads idle first (dream_trainer/world/settle.py)


def spawn_world(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` in `world_size` fresh processes and return each rank's result.

    Each process gets ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``, ``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE`` and ``GLOO_SOCKET_IFNAME=lo`` (plus `env`), so
    ``DistributedWorld`` / ``trainer.fit()`` join a gloo group on loopback. `fn` and its
    arguments and result must be picklable (define `fn` at module level).

    Every process is ended before this returns: when a rank fails, dies or the `timeout`
    passes, the others are terminated (then killed) and `SpawnError` is raised with each
    failed rank's traceback.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} is invalid: expected >= 1")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, fn, args, dict(env or {}), results), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    dead_since: dict[int, float] = {}
    try:
        while len(values) + len(errors) < world_size:
            if errors:
                break  # one rank failed: the others may hang in a collective
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(values))
                errors.update({r: f"timed out after {timeout:.0f}s" for r in missing})
                break
            try:
                rank, ok, value = results.get(timeout=0.1)
            except queue.Empty:
                now = time.monotonic()
                for rank, proc in enumerate(procs):
                    if rank in values or rank in errors or proc.exitcode is None:
                        continue
                    # Give the queue a moment to deliver a result sent just before exit.
                    if now - dead_since.setdefault(rank, now) > 2.0:
                        errors[rank] = f"process exited with code {proc.exitcode} without a result"
                continue
            if ok:
                values[rank] = pickle.loads(value)
            else:
                errors[rank] = value
    finally:
        _end(procs, grace=1.0 if errors else 10.0)
        results.close()
    if errors:
        detail = "\n".join(f"--- rank {r} ---\n{msg}" for r, msg in sorted(errors.items()))
        raise SpawnError(f"{len(errors)} of {world_size} rank(s) failed:\n{detail}")
    return [values[r] for r in range(world_size)]


def _end(procs: list[Any], grace: float) -> None:
    end = time.monotonic() + grace
    for proc in procs:
        proc.join(timeout=max(0.0, end - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)

"""Initializing sharded models exactly as one process would.

``fully_shard`` and ``parallelize_module`` turn parameters into DTensors before they are
initialized (the models are built on the meta device). Calling ``init_weights()`` on them
directly draws each rank's shard from the rank's own random stream: on CPU every rank draws
the same numbers, so every shard of a weight is the same block repeated (DTensor warns that
its random ops "may not have complete support"); on CUDA DTensor's RNG tracker gives each
shard its own offset, but the values still differ from a single-process run.

`full_size_parameters` makes the result independent of the layout: for the duration of
``init_weights()`` each DTensor parameter (and buffer) is replaced, in its module, by a
plain full-size tensor; afterwards each rank copies its own part of the full tensor into the
DTensor (no communication: every rank computed the same full tensor from the same seed)
and the DTensors are put back. The cost is one full copy of the parameters per rank while
it runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


def shared_parameters(models: Iterable[nn.Module]) -> list[list[tuple[nn.Module, str]]]:
    """The parameters registered in more than one place (tied weights, e.g. an embedding
    shared with the output head): ``[[(module, name), ...], ...]``, one list per tensor."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for model in models:
        for module in model.modules():
            for name, param in module._parameters.items():
                if param is not None:
                    slots.setdefault(id(param), []).append((module, name))
    return [places for places in slots.values() if len(places) > 1]


def tie(groups: list[list[tuple[nn.Module, str]]]) -> None:
    """Make each group of `shared_parameters` one tensor again: ``module.to_empty()``
    gives every place its own new tensor, untying them."""
    for (first, first_name), *rest in groups:
        param = first._parameters[first_name]
        for module, name in rest:
            module._parameters[name] = param


def sharded_tensors(models: Iterable[nn.Module]) -> list[tuple[nn.Module, str, bool, Any]]:
    """``(module, name, is_parameter, dtensor)`` for every DTensor parameter and buffer
    registered in `models` (a tied tensor appears once per module that holds it)."""
    from torch.distributed.tensor import DTensor

    found = []
    for model in models:
        for module in model.modules():
            for is_param, table in ((True, module._parameters), (False, module._buffers)):
                found.extend((module, name, is_param, t) for name, t in table.items() if isinstance(t, DTensor))
    return found


@contextmanager
def full_size_parameters(models: Iterable[nn.Module], device: torch.device) -> Iterator[int]:
    """Inside: every DTensor parameter/buffer of `models` is a full-size plain tensor on
    `device` (same dtype and ``requires_grad``; tied tensors stay tied). On a normal exit
    each rank keeps its part of the full values in the DTensors; on an error the DTensors
    are restored untouched. Yields the number of tensors swapped (0: nothing sharded)."""
    entries = sharded_tensors(models)
    full: dict[int, torch.Tensor] = {}
    for module, name, is_param, dtensor in entries:
        if id(dtensor) not in full:
            plain = torch.empty(dtensor.shape, dtype=dtensor.dtype, device=device)
            full[id(dtensor)] = nn.Parameter(plain, requires_grad=dtensor.requires_grad) if is_param else plain
        (module._parameters if is_param else module._buffers)[name] = full[id(dtensor)]
    try:
        yield len(full)
        _scatter(entries, full)
    finally:
        for module, name, is_param, dtensor in entries:
            (module._parameters if is_param else module._buffers)[name] = dtensor


@torch.no_grad()
def _scatter(entries: list[tuple[nn.Module, str, bool, Any]], full: dict[int, torch.Tensor]) -> None:
    from torch.distributed.tensor import distribute_tensor

    done: set[int] = set()
    for _, _, _, dtensor in entries:
        if id(dtensor) in done:
            continue
        done.add(id(dtensor))
        values = full[id(dtensor)].detach().to(dtensor.to_local().device)
        # src_data_rank=None: each rank cuts its own part out of its (identical) full tensor.
        dtensor.copy_(distribute_tensor(values, dtensor.device_mesh, dtensor.placements, src_data_rank=None))

"""Stragglers: a rank slower than the others, named at log steps.

A slow rank is invisible in the step time: every rank waits for it in the step's
collectives, so every rank's step takes as long as its. What differs is the time each rank
works on its own before it has to meet the others. Per optimizer step, this rank measures
(host clocks, no device sync, nothing sent):

- its work: from each micro-batch's arrival (after the data wait) to its first collective
  (`CollectiveTracker` marks both: the transfer to the device, ``pre_train_step`` and the
  start of ``training_step`` up to the backward's gradient reduction, the first agreement or
  the step's end);
- its data wait (``step_stats.data_wait_s``).

At each log step of the trainer (``log_every_n_steps``: the same steps on every rank) the
per-step means since the previous log step are summed into a ``world_size x 2`` CPU tensor
(one small all-reduce, on log steps only). A rank whose mean exceeds ``straggler_factor``
times the median of the *other* ranks (and by more than `MIN_GAP_S`) is named, on rank 0::

    rank 1 (node 1, host gpu-7) is a straggler: compute 212.4 ms/step vs median 3.1 ms of the other ranks

Comparing with the others' median (not everyone's) is what makes two ranks work: with two,
the median of all is their mean, which a slow rank drags up with it.

Host time is not device time: on CUDA, the work measured is the time the host took to reach
its first collective (data transfer, Python, kernel launches), not the GPU's compute, which
runs behind it; a slow GPU shows only where the host waits for it. Under layouts that
communicate in the forward (FSDP, TP, CP, PP) the first collective comes at the forward's
start, so the work measured is the host's work before it (the CPU-side stragglers: data
transforms, callbacks, a busy host), which is where PyTorch's own analysis finds most of them.
"""

from __future__ import annotations

import logging
import math
import statistics
from typing import Any

import torch

__all__ = ["MIN_GAP_S", "WARMUP_STEPS", "StragglerMeter", "find_stragglers"]

logger = logging.getLogger(__name__)

WARMUP_STEPS = 2
"""The first optimizer steps of a `fit()` are left out: compilation, and communication in the
forward that later steps do not have (DDP's first forward syncs the module's state, its second
one the rebuilt buckets), which make every rank wait for the slowest there."""

MIN_GAP_S = 0.002
"""A rank is a straggler only when it is also this much slower than the others' median (per
step): on steps of a few milliseconds a factor alone would name noise."""


def find_stragglers(values: list[float], factor: float,
                    min_gap_s: float = MIN_GAP_S) -> tuple[float, list[tuple[int, float, float]]]:
    """Compare each rank's per-step time in `values` (by rank) with the median of the other
    ranks'. Returns the largest ratio (a rank's time over its reference; 1.0 when no
    reference is above 0) and the stragglers, slowest first: ``(rank, its time, the others'
    median)`` for each rank over `factor` times that median and `min_gap_s` above it."""
    worst, found = 1.0, []
    for rank, value in enumerate(values):
        others = values[:rank] + values[rank + 1:]
        if not others:
            continue
        reference = statistics.median(others)
        if reference > 0:
            worst = max(worst, value / reference)
        if value > factor * reference and value - reference > min_gap_s:
            found.append((rank, value, reference))
    found.sort(key=lambda item: item[1] / item[2] if item[2] > 0 else math.inf, reverse=True)
    return worst, found


class StragglerMeter:
    """This rank's work and data wait per optimizer step since the last log step; `report`
    compares them across ranks (see the module docstring)."""

    def __init__(self) -> None:
        self.work_s = self.data_s = 0.0
        self.steps = self.warmup = 0

    def start(self) -> None:
        """A `fit()` starts: its first `WARMUP_STEPS` steps are not counted."""
        self.warmup = WARMUP_STEPS

    def add(self, work_s: float, data_s: float) -> None:
        """One optimizer step's work before its first collective and its data wait."""
        if self.warmup:
            self.warmup -= 1
            return
        self.work_s += work_s
        self.data_s += data_s
        self.steps += 1

    def report(self, world: Any) -> dict[str, float]:
        """At a log step, on every rank (one all-reduce of a ``world_size x 2`` CPU tensor):
        the metrics (``train/straggler_ratio``; ``train/straggler_rank`` and
        ``train/data_straggler_rank`` when a rank is one) and, on rank 0, a warning per
        straggler. Starts the next window. Nothing (no collective) with one rank, when
        ``straggler_factor`` is None or when no step was counted (warm-up: the same steps on
        every rank)."""
        steps, factor = self.steps, world.device_parameters.straggler_factor
        mine = [self.work_s / max(steps, 1), self.data_s / max(steps, 1)]
        self.work_s = self.data_s = 0.0
        self.steps = 0
        if factor is None or world.world_size == 1 or not steps:
            return {}
        table = torch.zeros(world.world_size, 2, dtype=torch.float64)
        table[world.rank] = torch.tensor(mine, dtype=torch.float64)
        world.all_reduce(table, "sum")  # a CPU tensor (gloo): no device sync
        rows = table.tolist()
        ratio, slow = find_stragglers([row[0] for row in rows], factor)
        _, slow_data = find_stragglers([row[1] for row in rows], factor)
        metrics = {"train/straggler_ratio": ratio}
        if slow:
            metrics["train/straggler_rank"] = float(slow[0][0])
        if slow_data:
            metrics["train/data_straggler_rank"] = float(slow_data[0][0])
        if world.rank == 0:
            for what, found in (("compute", slow), ("data", slow_data)):
                for rank, value, reference in found:
                    logger.warning("%s is a straggler: %s %.1f ms/step vs median %.1f ms of the other ranks "
                                   "(straggler_factor=%g)", world.collectives.rank_name(rank), what,
                                   value * 1e3, reference * 1e3, factor)
        return metrics

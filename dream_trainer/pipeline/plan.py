"""Pipeline planning, with no process group: the schedules, their expected bubbles, the
automatic choice, which stages a rank holds and how the layers are cut into stages. Every
plan (and every bad one) is testable in one process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from dream_trainer.pipeline.cost import DeviceCost, ModelCost

SINGLE = ("1F1B", "GPipe")  # on a tie, 1F1B: fewer micro-batches in flight
"""Schedules with one stage per rank."""
MULTI = ("Interleaved1F1B", "InterleavedZeroBubble")
"""Schedules with several stages per rank. torch's ``ZBVZeroBubble`` is not offered: in
torch 2.13 its forward-only step (validation) runs backward actions and fails."""
SCHEDULES = (*SINGLE, *MULTI)

Split = Union[str, tuple[int, ...]]


@dataclass(kw_only=True)
class PipelineParameters:
    """How a pipeline-parallel model (``DeviceParameters.pipeline_parallel > 1``) runs.

    Attributes:
        schedule: ``"auto"`` (the fastest by the cost model, `dream_trainer.pipeline.cost`,
            which counts compute, the bubble, transfers and memory; said in the log at
            WARNING, with why), or one of ``1F1B``, ``GPipe``, ``Interleaved1F1B``,
            ``InterleavedZeroBubble`` (``torch.distributed.pipelining``).
        microbatches: pipeline micro-batches each batch of a rank is cut into (it must
            divide the batch). None: 2 x pipeline_parallel.
        stages_per_rank: model stages each rank holds: 1 for GPipe and 1F1B, at least 2 for
            the interleaved schedules. None: what the schedule needs (1, or 2); with
            ``"auto"``, both are candidates.
        split: how the declared layers are cut into stages: ``"layers"`` (equal counts, the
            first stages taking one more when they do not divide), ``"parameters"`` (balanced
            parameter counts), or the number of layers of each stage, in order (a tuple
            summing to the layer count).
        sample_tokens: tokens (positions) in each sample, for the cost model: what crosses
            a stage boundary is a micro-batch's tokens x the hidden size. None: unknown, and
            ``"auto"`` falls back to the smallest expected bubble (and says so).
    """

    schedule: str = "auto"
    microbatches: int | None = None
    stages_per_rank: int | None = None
    split: Split = "layers"
    sample_tokens: int | None = None

    def __post_init__(self) -> None:
        owner = "PipelineParameters"
        if self.schedule not in ("auto", *SCHEDULES):
            raise ValueError(f"{owner}.schedule={self.schedule!r} is invalid: expected 'auto' or one of {SCHEDULES}")
        for name in ("microbatches", "stages_per_rank", "sample_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{owner}.{name}={value!r} is invalid: expected an int >= 1 or None")
        if isinstance(self.split, list):
            self.split = tuple(self.split)
        if isinstance(self.split, tuple):
            if not self.split or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.split):
                raise ValueError(f"{owner}.split={self.split!r} is invalid: expected layer counts >= 1")
        elif self.split not in ("layers", "parameters"):
            raise ValueError(f"{owner}.split={self.split!r} is invalid: expected 'layers', 'parameters' or a tuple "
                             "of layer counts per stage")


@dataclass(frozen=True)
class PipelineChoice:
    """The schedule a run uses: its name, stages per rank, micro-batches and expected
    bubble (the idle fraction of a rank's step time, from `expected_bubble`), why it was
    chosen and the other candidates ``(name, stages per rank, expected bubble)``, with their
    estimated step seconds by the cost model when it ran (`estimates`, in the same order)."""

    schedule: str
    stages_per_rank: int
    microbatches: int
    bubble: float
    candidates: tuple[tuple[str, int, float], ...] = ()
    why: str = ""
    estimates: tuple[float, ...] = ()

    def describe(self, pp: int) -> str:
        """One line: ``pipeline: schedule X, ... (why; alternatives: ...)``."""
        mine = (self.schedule, self.stages_per_rank)
        if self.estimates:
            others = ", ".join(f"{name} x{v}: ~{t * 1e3:.3g} ms" for (name, v, _), t
                               in zip(self.candidates, self.estimates, strict=True) if (name, v) != mine)
            label = "estimated step"
        else:
            others = ", ".join(f"{name} x{v}: {b:.1%}" for name, v, b in self.candidates if (name, v) != mine)
            label = "expected bubble"
        reasons = "; ".join(filter(None, (self.why or f"expected bubble {self.bubble:.1%}",
                                          f"alternatives ({label}): {others}" if others else "")))
        return (f"pipeline: schedule {self.schedule}, {pp} ranks x {self.stages_per_rank} stage(s), "
                f"{self.microbatches} micro-batches ({reasons})")


GLOO_LEFT_OUT = ("InterleavedZeroBubble",)
"""What ``"auto"`` leaves out when the stages talk over gloo (CPU ranks): measured slowest
there (docs/benchmarks.md, "Pipeline schedules"): its separate weight-gradient actions and
extra transfers cost more than the bubble it saves, which `expected_bubble` (free
communication) does not count."""


def expected_bubble(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> float:
    """The idle fraction of a rank's step, with a stage's forward, backward-for-inputs and
    backward-for-weights taking one unit each (a full backward two) and free communication:
    GPipe and 1F1B idle ``3(p-1)`` units of ``3m`` (Huang et al. 2019; Narayanan et al.
    2021); interleaving v stages per rank divides that by v; the zero-bubble schedules fill
    it with weight gradients: ZB-H1 idles ``(p-1)`` units (F + I - W) (Qi et al. 2023),
    interleaved over v stages."""
    p, v, m = pp, stages_per_rank, microbatches
    if p == 1:
        return 0.0
    work = 3.0 * v * m  # units of one stage's F + I + W, per rank
    if schedule in ("GPipe", "1F1B", "Interleaved1F1B"):
        idle = 3.0 * (p - 1)
    elif schedule == "InterleavedZeroBubble":
        idle = 1.0 * (p - 1)
    else:
        raise ValueError(f"schedule={schedule!r}: expected one of {SCHEDULES}")
    return idle / (work + idle)


def check_schedule(schedule: str, pp: int, stages_per_rank: int, microbatches: int, n_layers: int,
                   sharded_stages: bool = False) -> str | None:
    """Why `schedule` cannot run with these sizes (None: it can)."""
    v, m, stages = stages_per_rank, microbatches, pp * stages_per_rank
    if schedule == "InterleavedZeroBubble" and sharded_stages:
        return ("InterleavedZeroBubble with FSDP2 inside the stages (dp_shard > 1) trains other weights than one "
                "process (torch 2.13); with replicated stages (dp_replicate, dp_shard=1) it matches")
    if schedule in SINGLE and v != 1:
        return f"{schedule} holds 1 stage per rank, not {v}"
    if schedule in MULTI and v < 2:
        return f"{schedule} needs at least 2 stages per rank"
    if stages > n_layers:
        return f"{stages} stages ({pp} ranks x {v}) but only {n_layers} layers"
    if schedule == "1F1B" and m < stages:
        return f"1F1B needs at least as many micro-batches as stages ({stages}), got {m}"
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and m % max(1, m // pp):
        return f"{schedule} needs micro-batches in whole rounds of {pp} (a multiple of {pp}, or fewer), got {m}"
    return None


def choose_schedule(params: PipelineParameters, pp: int, batch: int, n_layers: int,
                    sharded_stages: bool = False, gloo: bool = False,
                    cost: tuple[ModelCost, DeviceCost] | None = None) -> PipelineChoice:
    """The schedule for `params` on `pp` ranks, for batches of `batch` samples per rank and
    `n_layers` layers, FSDP2 inside the stages or not, the stages talking over gloo (CPU)
    or not: the one asked for (checked), or with ``"auto"`` the candidate with the shortest
    step by the cost model (`cost`: the model's and the device's, `dream_trainer.pipeline.cost`)
    among those that fit the device's memory (ties: less activation memory, fewer stages per
    rank, the order of `SCHEDULES`). Without `cost`: the smallest expected bubble, less
    `GLOO_LEFT_OUT` over gloo, where it measured slowest (it stays a fallback).

    Raises:
        ValueError: the micro-batches do not divide the batch, or no schedule fits; the
            message names the sizes that would.
    """
    m = params.microbatches if params.microbatches is not None else 2 * pp
    if batch % m:
        counts = [d for d in range(1, batch + 1) if batch % d == 0]
        raise ValueError(f"PipelineParameters.microbatches={m} does not divide the {batch} samples of each rank's batch; "
                         f"counts that do: {counts}")
    auto = params.schedule == "auto"
    names = SCHEDULES if auto else (params.schedule,)
    candidates, refusals = [], []
    for name in names:
        for v in ([params.stages_per_rank] if params.stages_per_rank else [1] if name in SINGLE else [2]):
            why = check_schedule(name, pp, v, m, n_layers, sharded_stages)
            if why is None:
                candidates.append((name, v, expected_bubble(name, pp, v, m)))
            else:
                refusals.append(why)
    if not candidates:
        fits = [d for d in range(pp, batch + 1) if batch % d == 0]
        raise ValueError(f"no pipeline schedule fits {pp} ranks, {m} micro-batches and {n_layers} layers: "
                         f"{'; '.join(refusals)}. Micro-batch counts that divide the batch of {batch}: {fits}")
    if cost is not None:
        return _by_cost(params, pp, m, batch, candidates, refusals, cost)
    preferred = [c for c in candidates if not (gloo and c[0] in GLOO_LEFT_OUT)] or candidates
    best = min(preferred, key=lambda c: (round(c[2], 9), c[1], SCHEDULES.index(c[0])))
    if not auto:
        why = f"asked for; expected bubble {best[2]:.1%}"
    else:
        why = f"auto: the smallest expected bubble, {best[2]:.1%}"
        left = sorted({c[0] for c in candidates} - {c[0] for c in preferred})
        if left:
            why += f", {', '.join(left)} left out over gloo (CPU): measured slowest there"
        why += " (no cost model: set PipelineParameters.sample_tokens)"
    return PipelineChoice(best[0], best[1], m, best[2], tuple(candidates), why)


def _by_cost(params: PipelineParameters, pp: int, m: int, batch: int, candidates: list[tuple[str, int, float]],
             refusals: list[str], cost: tuple[ModelCost, DeviceCost]) -> PipelineChoice:
    """`choose_schedule` with the cost model: every candidate estimated; those that do not fit
    the device's memory refused (all of them: the error names each and its need)."""
    from dream_trainer.pipeline.cost import estimate, fits

    model, device = cost
    estimates = [estimate(name, pp, v, m, batch, model, device) for name, v, _ in candidates]
    fitting = [(c, e) for c, e in zip(candidates, estimates, strict=True) if fits(e, pp, model, device) is None]
    if not fitting:
        why = "; ".join(f"{c[0]} x{c[1]} {fits(e, pp, model, device)}" for c, e in zip(candidates, estimates, strict=True))
        others = f" (other refusals: {'; '.join(refusals)})" if refusals else ""
        raise ValueError(f"no pipeline schedule fits the device's memory with {m} micro-batches: {why}{others}; "
                         "use more pipeline ranks or micro-batches")
    (name, v, bubble), best = min(fitting, key=lambda ce: (round(ce[1].step_s, 9), ce[1].peak_bytes, ce[0][1],
                                                          SCHEDULES.index(ce[0][0])))
    lead = "asked for" if params.schedule != "auto" else "auto: the fastest by the cost model"
    why = f"{lead} ({device.name}), {best.describe()}"
    left = [f"{c[0]} x{c[1]}" for c, e in zip(candidates, estimates, strict=True) if fits(e, pp, model, device)]
    if left:
        why += f"; {', '.join(left)} left out: over the device's memory"
    return PipelineChoice(name, v, m, bubble, tuple(candidates), why, tuple(e.step_s for e in estimates))


def stage_ids(schedule: str, pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The stages `pp_rank` holds: ``pp_rank + k * pp`` (looped)."""
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def split_layers(n_layers: int, n_stages: int, split: Split, layer_sizes: list[int] | None = None) -> list[range]:
    """The layers of each stage. ``"layers"``: equal counts (the first stages take one more
    when they do not divide); ``"parameters"``: contiguous runs balancing `layer_sizes` (the
    parameter count of each layer); a tuple: those counts.

    Raises:
        ValueError: a tuple of the wrong length or sum, or more stages than layers; the
            message suggests the equal split.
    """
    if n_stages > n_layers:
        raise ValueError(f"{n_stages} pipeline stages but only {n_layers} layers: use at most {n_layers} stages")
    even = [n_layers // n_stages + (1 if s < n_layers % n_stages else 0) for s in range(n_stages)]
    if isinstance(split, tuple):
        if len(split) != n_stages or sum(split) != n_layers:
            raise ValueError(f"PipelineParameters.split={split!r} is invalid: {n_stages} stages of {n_layers} layers "
                             f"need {n_stages} counts summing to {n_layers}, e.g. {tuple(even)}")
        counts = list(split)
    elif split == "parameters":
        counts = _balanced(layer_sizes or [1] * n_layers, n_stages)
    else:
        counts = even
    starts = [sum(counts[:s]) for s in range(n_stages)]
    return [range(start, start + count) for start, count in zip(starts, counts)]


def _balanced(sizes: list[int], parts: int) -> list[int]:
    """Counts of `parts` contiguous, non-empty runs of `sizes` whose largest sum is smallest
    (dynamic programming over the cut points)."""
    n = len(sizes)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    counts, i = [], n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        counts.append(i - j)
        i = j
    return counts[::-1]

"""The automatic schedule's cost model: each candidate's step time on a rank and its peak
activation memory, counting what the analytic bubble (`expected_bubble`) leaves out.

A rank's step, for schedule S with ``p`` ranks, ``v`` stages per rank and ``m`` micro-batches:

- **compute** ``C``: the model's training FLOPs for the rank's batch over ``p``, at the
  device's sustained FLOP/s; the zero-bubble schedules split each backward into an input
  and a weight part, which costs ``split_backward`` more of the backward (two thirds of C);
- **idle**: the bubble, in units of one stage's forward (``C / 3vm``), as `expected_bubble`
  counts it: ``3(p-1)`` units for GPipe/1F1B/Interleaved1F1B, ``p-1`` for zero bubble;
- **actions**: a fixed cost per compute action the schedule runs (dispatch, autograd
  bookkeeping): ``2vm`` of them (forward, backward), ``3vm`` with a split backward;
- **transfers**: each micro-batch crosses each stage boundary twice (activations forward,
  gradients back): a rank sends ``2vm (pv-1)/pv`` times on average, each costing a latency
  plus the micro-batch's boundary bytes over the link's bandwidth. Over gloo (CPU ranks)
  a transfer runs on the cores that compute, so all are counted; over NCCL they overlap
  compute, and only the pipeline's fill and drain, ``2(pv-1)``, are;
- **memory**: activations in flight on the first rank (the most): ``m`` micro-batches for
  GPipe, ``min(m, p)`` for 1F1B, ``min(vm, (v-1)p + 2(p-1) + 1)`` stage chunks for the
  interleaved schedules (torch's warm-up), each ``ACTIVATION_FACTOR`` x the boundary bytes
  x the chunk's layers. A candidate that does not fit the device with the rank's share of
  the model state is refused.

The device constants are estimates, stated in `DeviceCost`: the CPU ones are calibrated on
``benchmarks/pipeline.py``'s demo rows (docs/benchmarks.md, "Pipeline schedules"); the CUDA
ones are a table peak at an assumed 40 % MFU and NVLink-class links, not measured here.
Every rank computes the same numbers from the same inputs, so all choose the same schedule.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch
from torch import nn

ACTIVATION_FACTOR = 16.0
"""Activation elements a transformer layer keeps per token for its backward, in units of
its hidden size (Korthikanti et al. 2022 count ``34 s b h`` bytes at 16 bits, about 17
elements, with the attention scores not kept, as fused attention does)."""

STATE_BYTES_PER_PARAMETER = 16.0
"""Parameter, gradient and two AdamW moments in float32."""


@dataclass(frozen=True)
class DeviceCost:
    """What the cost model assumes of one rank and its links.

    Attributes:
        name: what it describes (said in the choice's reason).
        flops_per_s: sustained training FLOP/s of one rank.
        latency_s: fixed cost of one stage-to-stage transfer.
        bytes_per_s: a transfer's bandwidth.
        action_s: the schedule's cost per compute action.
        split_backward: extra compute of a split (input, weight) backward, a fraction of
            the backward.
        overlapped: transfers overlap compute (NCCL); else each is on the critical path (gloo).
        memory_bytes: what a rank may hold (None: not limited by the model).
    """

    name: str
    flops_per_s: float
    latency_s: float
    bytes_per_s: float
    action_s: float
    split_backward: float
    overlapped: bool
    memory_bytes: float | None = None


def cpu_gloo(threads: int | None = None) -> DeviceCost:
    """CPU ranks over gloo on one host, calibrated on the demo GPT's pipeline rows (2 ranks x
    1 thread, 2026-11-26/27): about 50 GFLOP/s a thread, ~1 ms a transfer plus 0.5 GB/s,
    0.5 ms an action, a split backward 20 % dearer."""
    threads = threads or torch.get_num_threads()
    return DeviceCost(f"CPU over gloo, {threads} thread(s) a rank", flops_per_s=50e9 * threads, latency_s=1e-3,
                      bytes_per_s=0.5e9, action_s=0.5e-3, split_backward=0.2, overlapped=False)


def cuda_nccl(device: torch.device, peak_flops: float | None = None) -> DeviceCost:
    """A CUDA rank over NCCL: `peak_flops` (dense, the training dtype's; None: 400 TFLOP/s)
    at an assumed 40 % MFU, 20 us and 100 GB/s a transfer, 50 us an action, a split
    backward 5 % dearer, the device's total memory."""
    memory = float(torch.cuda.get_device_properties(device).total_memory) if torch.cuda.is_available() else None
    peak = peak_flops or 400e12
    return DeviceCost(f"CUDA over NCCL, {peak / 1e12:,.0f} TFLOP/s peak at 40 % MFU", flops_per_s=0.4 * peak,
                      latency_s=20e-6, bytes_per_s=100e9, action_s=50e-6, split_backward=0.05, overlapped=True,
                      memory_bytes=memory)


@dataclass(frozen=True)
class ModelCost:
    """What the cost model needs of the model.

    Attributes:
        flops_per_sample: training FLOPs (forward and backward) of the whole model per sample.
        boundary_bytes_per_sample: what crosses a stage boundary per sample (tokens x hidden
            size x element bytes).
        n_layers: the layers cut into stages.
        state_bytes: parameters, gradients and optimizer state of the whole model on one
            rank before the pipeline splits it.
    """

    flops_per_sample: float
    boundary_bytes_per_sample: float
    n_layers: int
    state_bytes: float = 0.0


@dataclass(frozen=True)
class Estimate:
    """One candidate's estimated step on a rank (seconds) and peak memory (bytes)."""

    step_s: float
    compute_s: float
    idle_s: float
    actions_s: float
    transfer_s: float
    peak_bytes: float

    def describe(self) -> str:
        ms = 1e3
        return (f"~{self.step_s * ms:.3g} ms/step: compute {self.compute_s * ms:.3g}, idle {self.idle_s * ms:.3g}, "
                f"transfers {self.transfer_s * ms:.3g}, per-action {self.actions_s * ms:.3g}; activations "
                f"{_bytes(self.peak_bytes)}")


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def in_flight(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> int:
    """Stage chunks whose activations the first rank holds at once (see the module docstring)."""
    p, v, m = pp, stages_per_rank, microbatches
    if schedule == "GPipe":
        return m * v
    if schedule == "1F1B":
        return min(m, p)
    return min(v * m, (v - 1) * p + 2 * (p - 1) + 1)


def estimate(schedule: str, pp: int, stages_per_rank: int, microbatches: int, batch: int, model: ModelCost,
             device: DeviceCost) -> Estimate:
    """The step of one rank training `batch` samples with this schedule (module docstring)."""
    p, v, m = pp, stages_per_rank, microbatches
    split = schedule == "InterleavedZeroBubble"
    compute = model.flops_per_sample * batch / p / device.flops_per_s
    unit = compute / (3 * v * m)
    idle = unit * (p - 1) * (1 if split else 3)
    if split:
        compute *= 1 + device.split_backward * 2 / 3
    actions = device.action_s * v * m * (3 if split else 2)
    chunks = p * v
    per_transfer = device.latency_s + model.boundary_bytes_per_sample * batch / m / device.bytes_per_s
    count = 2 * (chunks - 1) if device.overlapped else 2 * v * m * (chunks - 1) / chunks
    peak = (in_flight(schedule, p, v, m) * ACTIVATION_FACTOR * model.boundary_bytes_per_sample * batch / m
            * model.n_layers / chunks)
    return Estimate(compute + idle + actions + count * per_transfer, compute, idle, actions, count * per_transfer, peak)


def fits(estimate_: Estimate, pp: int, model: ModelCost, device: DeviceCost) -> str | None:
    """Why the candidate does not fit the device's memory (None: it fits, or no limit)."""
    if device.memory_bytes is None:
        return None
    need = estimate_.peak_bytes + model.state_bytes / pp
    if need <= 0.9 * device.memory_bytes:
        return None
    return (f"needs ~{_bytes(need)} a rank (activations {_bytes(estimate_.peak_bytes)}, model state "
            f"{_bytes(model.state_bytes / pp)}), over 90 % of the device's {_bytes(device.memory_bytes)}")


def hidden_size(layer: nn.Module) -> int | None:
    """A layer's hidden size: the most common dimension among its parameters' shapes (a
    transformer block's model width), None for a layer without parameters."""
    sizes = collections.Counter(d for p in layer.parameters() for d in p.shape)
    return sizes.most_common(1)[0][0] if sizes else None


def model_cost(layers: list[nn.Module], whole: nn.Module, flops_per_sample: float | None, sample_tokens: int | None,
               element_bytes: int, state_shards: int = 1) -> ModelCost | None:
    """The `ModelCost` of a model cut at `layers`, or None when the FLOPs or the tokens per
    sample are unknown (the choice then falls back to the expected bubble, and says so)."""
    width = hidden_size(layers[0]) if layers else None
    if not flops_per_sample or not sample_tokens or width is None:
        return None
    parameters = sum(p.numel() for p in whole.parameters())
    return ModelCost(float(flops_per_sample), float(sample_tokens * width * element_bytes), len(layers),
                     parameters * STATE_BYTES_PER_PARAMETER / max(state_shards, 1))

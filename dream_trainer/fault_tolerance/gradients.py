"""`GradientBuckets`: the cross-group gradient all-reduce of a `FaultTolerantWorld`,
bucketed and started during the backward pass, as gradients become ready.

The optimizer's parameters are cut into buckets of about `bucket_mb` each (the first one
1 MB, as DDP's; in reverse order, the order in which backward produces gradients; one dtype
and device per bucket). A post-accumulate-grad hook on every parameter marks it ready:
autograd calls it for plain parameters, FSDP2 calls it for its sharded parameters once their
gradient is reduce-scattered (as this torch does; an FSDP2 that does not call them leaves
every bucket to `finish`: correct, without overlap). When the last parameter of a bucket is
ready and every bucket before it has started, its all-reduce starts, while backward goes on.
`finish` (in ``trainer.step``) starts the buckets backward did not (a parameter without a
gradient counts as zeros), waits for every all-reduce, and copies the averages back into the
gradients.

Every group starts the same all-reduces in the same order (bucket 0, 1, 2, ...) whatever
the timing: a bucket starts only after the ones before it, and `finish` starts the rest.
That is what makes the collectives of different groups match. Hooks start nothing unless
`active()` says so: on the last micro-batch of a step, between its quorum and its vote.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


_FIRST_BUCKET = 2**20  # bytes: the first bucket (the last layers' gradients) is small, to start early


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class LateGradientError(RuntimeError):
    """A gradient was accumulated after its bucket's all-reduce had started."""


class GradientBuckets:
    """Bucketed cross-group all-reduce of gradients (see the module docstring).

    Args:
        allreduce: starts an averaging all-reduce of a flat tensor in place, returns its work
            (torchft's ``Manager.allreduce``: errors are reported to the Manager, not raised).
        report_error: tells the Manager that this step's gradients are wrong (not committed).
        active: whether a ready gradient may start its bucket now.
        bucket_mb: the size of a bucket.
    """

    def __init__(self, allreduce: Callable[[torch.Tensor], Any], report_error: Callable[[Exception], None],
                 active: Callable[[], bool], bucket_mb: float = 25.0):
        self._allreduce, self._report, self._active = allreduce, report_error, active
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.overlap = True  # False after a late gradient: every all-reduce starts in `finish`
        self.started_in_backward = 0  # buckets started by hooks in the last step (for tests and benchmarks)
        self._params: list[torch.nn.Parameter] = []
        self._buckets: list[list[torch.nn.Parameter]] = []
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, index in the flat order)
        self._expected: list[int] = []  # per bucket: how many of its parameters get a hook call
        self._handles: list[Any] = []
        self._begin()

    @property
    def buckets(self) -> int:
        """How many buckets (all-reduces per step)."""
        return len(self._buckets)

    def _begin(self) -> None:
        self._missing = list(self._expected)
        self._seen = bytearray(len(self._where))
        self._next = 0  # the next bucket to start
        self._pending: list[tuple[Any, Any, torch.Tensor, list[torch.Tensor]]] = []
        self._late = False

    # ------------------------------------------------------------------ buckets and hooks
    def bind(self, parameters: list[torch.nn.Parameter]) -> None:
        """Cut `parameters` into buckets and hook them (again only if they changed)."""
        if parameters is self._params:
            return
        if len(parameters) == len(self._params) and all(a is b for a, b in zip(parameters, self._params)):
            self._params = parameters
            return
        self.close()
        self._params = parameters
        self._buckets, self._where, self._expected = [], {}, []
        sizes: dict[tuple[torch.dtype, torch.device], int] = {}
        open_bucket: dict[tuple[torch.dtype, torch.device], int] = {}
        for p in reversed(parameters):
            with torch.no_grad():
                local = _local(p)
            key, nbytes = (local.dtype, local.device), local.numel() * local.element_size()
            b = open_bucket.get(key)
            cap = min(self.bucket_bytes, _FIRST_BUCKET) if b == 0 else self.bucket_bytes  # start early, as DDP
            if b is None or sizes[key] + nbytes > cap and self._buckets[b]:
                b = open_bucket[key] = len(self._buckets)
                self._buckets.append([])
                self._expected.append(0)
                sizes[key] = 0
            sizes[key] += nbytes
            self._where[id(p)] = (b, len(self._where))
            self._buckets[b].append(p)
            if p.requires_grad:
                self._expected[b] += 1
                self._handles.append(p.register_post_accumulate_grad_hook(self._ready))
        self._begin()

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _ready(self, param: torch.nn.Parameter) -> None:
        """The hook: `param`'s gradient is complete for this backward."""
        if not (self.overlap and self._active()):
            return
        b, i = self._where[id(param)]
        if b < self._next:  # its bucket is already on the wire without this
            self._late = True
            return
        if not self._seen[i]:
            self._seen[i] = 1
            self._missing[b] -= 1
        while self._next < len(self._buckets) and self._missing[self._next] == 0:
            self._start(self._next)
            self.started_in_backward += 1

    @torch.no_grad()  # the gradients of a create_graph backward require grad: nothing to record
    def _start(self, b: int) -> None:
        tensors = []
        for p in self._buckets[b]:
            if p.grad is None:  # a missing gradient counts as zeros
                p.grad = torch.zeros_like(p)
            tensors.append(_local(p.grad))
        flat = torch._utils._flatten_dense_tensors(tensors)
        # torchft waits for a work on the stream it was started on (FSDP2 runs the hooks on its own).
        stream = torch.accelerator.current_stream() if torch.accelerator.is_available() else None
        try:
            work = self._allreduce(flat)
        except Exception as exc:  # noqa: BLE001 - never raised: the step will not be committed
            self._report(exc)
            work = None
        self._pending.append((work, stream, flat, tensors))
        self._next = b + 1

    # ------------------------------------------------------------------ the step
    def reset(self) -> None:
        """A new step: forget the last one (its all-reduces were all waited for in `finish`)."""
        self.started_in_backward = 0
        self._begin()

    @torch.no_grad()
    def finish(self, parameters: list[torch.nn.Parameter], healthy: Callable[[], bool]) -> None:
        """Start the buckets backward did not, wait for each and copy its averages into the
        gradients while `healthy()` (no error reported to the Manager: otherwise the step is
        not committed and its gradients are dropped)."""
        if self._next == 0:
            self.bind(parameters)
        elif parameters is not self._params:
            self._check_same(parameters)
        for b in range(self._next, len(self._buckets)):
            self._start(b)
        pending, late = self._pending, self._late
        self._begin()
        for work, stream, flat, tensors in pending:
            if work is not None:
                _wait(work, stream)  # errors are reported to the Manager, not raised
            if healthy():  # copied while the next buckets are still on the wire
                torch._foreach_copy_(tensors, torch._utils._unflatten_dense_tensors(flat, tensors))
        if late:
            self.overlap = False
            self._report(LateGradientError(  # the world logs it, once
                "a gradient was accumulated after its bucket's cross-group all-reduce had started (a second "
                "backward in the last micro-batch of a step?): this step is not committed, and from now on the "
                "all-reduce starts after backward (no overlap)"
            ))

    def _check_same(self, parameters: list[torch.nn.Parameter]) -> None:
        if len(parameters) != len(self._params) or any(a is not b for a, b in zip(parameters, self._params)):
            raise RuntimeError("trainer.step() got other parameters than the ones whose gradients are being "
                               "all-reduced across the replica groups (one optimizer, fixed parameters)")
        self._params = parameters


def _wait(work: Any, stream: Any) -> None:
    """Wait for `work` on the stream it was started on, then make the current stream wait
    for that one (torchft asserts the former; on the CPU there are no streams)."""
    if stream is None:
        work.wait()
        return
    from torchft.utils import get_stream_context

    current = torch.accelerator.current_stream()
    with get_stream_context(stream):
        work.wait()
    current.wait_stream(stream)

"""`BatchTransfer`: how batches reach the world's device, owned by the world as
``world.transfer`` (the trainer moves every training and validation batch through it).

On CUDA its copies run on a side stream of their own, so the copy of the next batch overlaps
the step still running on the GPU, and the compute stream waits for it (a device-side wait,
not a host one) only where the batch is first used. From pinned host memory the copies never
block the training thread (`TokenLoader` pins its batches on CUDA; use
``DataLoader(pin_memory=True)`` for your own): a batch in pageable memory is copied too, and
warned about once. Nothing here reads a value from the device: no host-device sync.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

logger = logging.getLogger(__name__)

PAGEABLE_WARN_BYTES = 1 << 20
"""A batch in pageable host memory at least this large is warned about (once)."""


class BatchTransfer:
    """Moves batches to the world's device (see the module docstring). Needs no trainer:
    the world calls `start` with its device when it is launched.

    Attributes:
        device: where batches go (None before `start`).
        moves: whether batches need moving (`device` is not the CPU).
        copies: host-to-device tensor copies issued so far (a test can count them).
        pageable_bytes: bytes copied from pageable (unpinned) host memory so far.
    """

    def __init__(self) -> None:
        self.device: torch.device | None = None
        self.moves = False  # whether batches need moving (a device that is not the CPU)
        self._stream: Any = None
        self.copies = 0
        self.pageable_bytes = 0
        self._warned = False

    def start(self, device: torch.device) -> None:
        """Send batches to `device` from now on (a CUDA device gets its copy stream)."""
        self.device = device
        self.moves = device.type != "cpu"
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __call__(self, batch: Any) -> Any:
        """`batch` with every tensor on the device (nested lists, tuples and dicts keep their
        structure). Tensors already there are kept as they are."""
        if not self.moves:
            return batch
        leaves, spec = tree_flatten(batch)
        moving = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.device != self.device]
        if not moving:
            return batch
        self._check_pinned([leaves[i] for i in moving])
        if self._stream is None:  # another accelerator: its non-blocking copies as they are
            for i in moving:
                leaves[i] = leaves[i].to(self.device, non_blocking=True)
        else:
            self._copy_on_side_stream(leaves, moving)
        self.copies += len(moving)
        moved = tree_unflatten(leaves, spec)
        weight = getattr(batch, "loss_weight", None)  # a weighted share of the global batch (data.weighted)
        if weight is not None and getattr(moved, "loss_weight", None) != weight:
            moved.loss_weight = weight  # a named tuple's pytree rebuild drops its attributes
        return moved

    def _copy_on_side_stream(self, leaves: list[Any], moving: list[int]) -> None:
        """Copy on the side stream; the compute stream waits for the copies (a device-side
        wait, not a host one), and the copied tensors are marked as used on it, so the
        allocator does not hand their memory to the side stream again too early."""
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            for i in moving:
                leaves[i] = leaves[i].to(self.device, non_blocking=True)
        compute.wait_stream(self._stream)
        for i in moving:
            leaves[i].record_stream(compute)

    def _check_pinned(self, tensors: list[torch.Tensor]) -> None:
        host = [t for t in tensors if t.device.type == "cpu" and not t.is_pinned()]
        size = sum(t.numel() * t.element_size() for t in host)
        self.pageable_bytes += size
        if size >= PAGEABLE_WARN_BYTES and not self._warned:
            self._warned = True
            logger.warning(
                "batches reach %s from pageable host memory (%.1f MB in this one): each copy blocks the training "
                "thread and cannot overlap the step. Pin them: DataLoader(pin_memory=True), or a loader that pins "
                "(dream_trainer.data.TokenLoader does on CUDA)", self.device, size / 2**20)

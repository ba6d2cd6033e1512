"""Context parallelism: the sequence dimension sharded over the mesh's ``cp`` dimension,
attention computed by PyTorch's ring attention.

Each of the ``cp`` ranks of a group holds ``1/cp`` of every sequence: with causal attention
the sequence is cut into ``2 x cp`` chunks and rank ``r`` keeps chunks ``r`` and
``2cp - 1 - r`` (head and tail: every rank does the same share of the causal work, the
layout PyTorch's ring attention expects). Inside `ContextParallel.region` every call of
``torch.nn.functional.scaled_dot_product_attention`` is ring attention over the group:
each rank's queries meet every rank's keys and values, passed around the ring.

- **CUDA**: PyTorch's context parallel (``torch.distributed.tensor.experimental``), which
  dispatches SDPA's flash, memory-efficient and cuDNN kernels to its ring.
- **CPU**: PyTorch's CP has no ring for SDPA's CPU kernel; dream_trainer runs PyTorch's
  ring algorithm (forward and backward) around that kernel
  (``_scaled_dot_product_flash_attention_for_cpu``), so CP trains on CPU and gloo too.

Position-dependent parts of a model (learned or rotary position embeddings) must see each
token's place in the whole sequence: use `sequence_positions` instead of ``arange``."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ContextParallel", "head_tail_indices", "sequence_positions"]

_SEQ_DIM = 2  # SDPA's (batch, heads, sequence, head_dim)
_active = threading.local()


def head_tail_indices(length: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The positions (in the whole sequence of `length`) that rank `rank` of `cp` holds:
    chunks ``rank`` and ``2cp - 1 - rank`` of ``2cp`` equal chunks."""
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"rank {rank} of context_parallel={cp}: need 0 <= rank < cp")
    if length % (2 * cp):
        raise ValueError(
            f"sequence length {length} is not divisible by 2 x context_parallel = {2 * cp} (each rank holds two "
            f"equal chunks of it): use a sequence length that is a multiple of {2 * cp}")
    chunk = length // (2 * cp)
    starts = (rank * chunk, (2 * cp - 1 - rank) * chunk)
    return torch.cat([torch.arange(s, s + chunk, device=device) for s in starts])


def sequence_positions(length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Positions of the `length` tokens a model sees: ``arange(length)``, or, inside a
    context-parallel region, where this rank's tokens are in the whole sequence. Use it
    for position embeddings."""
    region = getattr(_active, "region", None)
    if region is None:
        return torch.arange(length, device=device)
    positions = region.positions
    if positions.numel() != length:
        raise ValueError(
            f"sequence_positions({length}) inside a context-parallel region whose shard holds {positions.numel()} "
            f"tokens (of {positions.numel() * region.cp}): pass the sharded sequence's length")
    return positions if device is None else positions.to(device)


class ContextParallel:
    """Context parallelism over `mesh` (the world's ``cp`` submesh): shards a batch's
    sequences (`shard`) and runs attention as ring attention (`region`)."""

    def __init__(self, mesh: DeviceMesh, seq_dim: int = 1):
        self.mesh, self.seq_dim = mesh, seq_dim
        self.cp, self.rank = mesh.size(), mesh.get_local_rank()
        self.group = mesh.get_group()
        self.positions = torch.empty(0, dtype=torch.long)

    def shard(self, tensors: Any) -> Any:
        """This rank's part of each tensor in `tensors` (a tensor or a tuple/list of them)
        along `seq_dim`; every tensor must have the same sequence length."""
        items = tensors if isinstance(tensors, (tuple, list)) else (tensors,)
        lengths = {t.shape[self.seq_dim] for t in items if isinstance(t, torch.Tensor) and t.ndim > self.seq_dim}
        if len(lengths) != 1:
            raise ValueError(
                f"context parallel shards the sequence dimension ({self.seq_dim}) of a step's inputs and targets; "
                f"their lengths there differ or are missing: {sorted(lengths)}")
        (length,) = lengths
        index = head_tail_indices(length, self.cp, self.rank, items[0].device)
        self.positions = index
        out = [t.index_select(self.seq_dim, index) if isinstance(t, torch.Tensor) else t for t in items]
        return type(tensors)(out) if isinstance(tensors, (tuple, list)) else out[0]

    @contextlib.contextmanager
    def sharded_step(self, inputs: Any, target: Any, device: torch.device) -> Iterator[tuple[Any, Any]]:
        """Within: this rank's part of the sequences of `inputs` and `target` (`shard`;
        tuples are sharded as one), and attention as ring attention (`region`) while the
        step runs, forward and backward. Yields the sharded ``(inputs, target)``."""
        if isinstance(inputs, torch.Tensor):
            inputs, target = self.shard((inputs, target))
        else:
            inputs, target = self.shard(inputs), self.shard(target)
        with self.region(device):
            yield inputs, target

    @contextlib.contextmanager
    def region(self, device: torch.device) -> Iterator[None]:
        """Within: SDPA is ring attention over the group, and `sequence_positions` gives
        this rank's positions (of the last `shard`)."""
        from torch.distributed.tensor.experimental._context_parallel import _attention

        if getattr(_active, "region", None) is not None:
            raise RuntimeError("context-parallel regions do not nest")
        _active.region = self
        try:
            if device.type == "cuda":  # PyTorch's CP; its ring reads the option in backward too
                with _balanced(True):
                    _attention._enable_context_parallel_dispatcher_impl(seq_dim=_SEQ_DIM, mesh=self.mesh)
                    try:
                        yield
                    finally:
                        _attention._disable_context_parallel_dispatcher_impl()
            else:
                original = F.scaled_dot_product_attention
                F.scaled_dot_product_attention = self._ring_sdpa  # what model code looks up at call time
                try:
                    yield
                finally:
                    F.scaled_dot_product_attention = original
        finally:
            _active.region = None

    @torch.compiler.disable  # a compiled block runs around it (dynamo cannot trace the ring's collectives)
    def _ring_sdpa(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                   dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                   enable_gqa: bool = False) -> torch.Tensor:
        if attn_mask is not None or dropout_p or enable_gqa:
            raise NotImplementedError(
                "context-parallel attention takes no attn_mask, dropout_p=0 and enable_gqa=False (got "
                f"attn_mask={'a tensor' if attn_mask is not None else None}, dropout_p={dropout_p}, "
                f"enable_gqa={enable_gqa}): use is_causal for causal masking, or context_parallel=1")
        return _RingAttention.apply(query, key, value, is_causal, scale, self.group)


@contextlib.contextmanager
def _balanced(is_causal: bool) -> Iterator[Any]:
    """PyTorch's ring attention, told the head-tail layout (causal; full attention does not
    depend on the order of the sequence, and the ring refuses the option without a mask)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    before = _attention._cp_options.enable_load_balance
    _attention._cp_options.enable_load_balance = is_causal
    try:
        yield _attention
    finally:
        _attention._cp_options.enable_load_balance = before


class _RingAttention(torch.autograd.Function):
    """Ring attention around SDPA's CPU kernel: PyTorch's ring algorithm
    (``_templated_ring_attention`` and its backward) with the CPU flash-attention op."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool,
                scale: float | None, group: Any) -> torch.Tensor:
        with _balanced(is_causal) as attention:
            out, logsumexp, *_ = attention._templated_ring_attention(
                group, _SEQ_DIM, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
                query=query, key=key, value=value, is_causal=is_causal, dropout_p=0.0, scale=scale)
        ctx.save_for_backward(query, key, value, out, logsumexp)
        ctx.is_causal, ctx.scale, ctx.group = is_causal, scale, group
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, out, logsumexp = ctx.saved_tensors
        with _balanced(ctx.is_causal) as attention:
            grad_q, grad_k, grad_v, *_ = attention._templated_ring_attention_backward(
                ctx.group, _SEQ_DIM, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                grad_out=grad_out.contiguous(), grad_out_name="grad_out", query=query, key=key, value=value,
                out=out, logsumexp=logsumexp, is_causal=ctx.is_causal, dropout_p=0.0, scale=ctx.scale)
        return grad_q, grad_k, grad_v, None, None, None

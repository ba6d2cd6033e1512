"""Context parallelism: the sequence dimension sharded over the mesh's ``cp`` dimension,
attention computed by PyTorch's ring attention.

Each of the ``cp`` ranks of a group holds ``1/cp`` of every sequence: with causal attention
the sequence is cut into ``2 x cp`` chunks and rank ``r`` keeps chunks ``r`` and
``2cp - 1 - r`` (head and tail: every rank does the same share of the causal work, the
layout PyTorch's ring attention expects). Inside `ContextParallel.region` every call of
``torch.nn.functional.scaled_dot_product_attention`` is ring attention over the group:
each rank's queries meet every rank's keys and values, passed around the ring. A
``TorchFunctionMode`` routes the calls, so a model that imported the function by name is
ringed too; a region in which no attention ran, and ``nn.MultiheadAttention``, fail.

The same rules on every device: causal attention runs load-balanced over the head-tail
shards, full attention (``is_causal=False``) without balancing (`load_balanced`); one kind
per step; no ``attn_mask`` or dropout; ``enable_gqa=True`` repeats the key and value heads
to the query heads before the ring (`repeat_kv_heads`).

- **CUDA**: PyTorch's context parallel (``torch.distributed.tensor.experimental``): the
  shards as DTensors, whose dispatch sends SDPA's flash, memory-efficient and cuDNN kernels
  to its ring.
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
from torch.overrides import TorchFunctionMode

__all__ = ["ContextParallel", "head_tail_indices", "load_balanced", "repeat_kv_heads", "sequence_positions"]

_SEQ_DIM = 2  # SDPA's (batch, heads, sequence, head_dim)
_active = threading.local()
_SDPA = F.scaled_dot_product_attention  # the builtin, however a model imported it
_BYPASSES = (F.multi_head_attention_forward, torch._native_multi_head_attention)  # attention without SDPA


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
        self.calls = 0  # attention calls in the current (or last) region
        self._device: torch.device | None = None  # the region's; None outside one
        self._causal: bool | None = None  # the region's is_causal, from its first attention call

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
        """Within: every call of ``scaled_dot_product_attention`` is ring attention over the
        group, however the model imported it (a `_RingMode` sees the call itself, not an
        attribute of ``torch.nn.functional``), and `sequence_positions` gives this rank's
        positions (of the last `shard`). A region in which no attention ran fails: the
        model's attention then saw only this rank's part of each sequence."""
        if getattr(_active, "region", None) is not None:
            raise RuntimeError("context-parallel regions do not nest")
        from torch.distributed.tensor.experimental._context_parallel import _attention

        _active.region, self._device, self._causal, self.calls = self, device, None, 0
        before = _attention._cp_options.enable_load_balance
        try:
            with _cuda_dispatcher(device), _RingMode(self):
                yield
        finally:
            _attention._cp_options.enable_load_balance = before
            _active.region, self._device, self._causal = None, None, None
        if not self.calls:
            raise RuntimeError(
                f"context_parallel={self.cp}: no torch.nn.functional.scaled_dot_product_attention call ran in the "
                "context-parallel region, so the model's attention (if any) saw only this rank's part of each "
                "sequence. Compute attention with scaled_dot_product_attention, or use context_parallel=1")

    @torch.compiler.disable  # a compiled block runs around it (dynamo cannot trace the ring's collectives)
    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                  enable_gqa: bool = False) -> torch.Tensor:
        """Ring attention over the group: what ``scaled_dot_product_attention`` is in a region."""
        if self._device is None:
            raise RuntimeError("ContextParallel.attention runs inside a context-parallel region (ContextParallel.region)")
        if attn_mask is not None or dropout_p:
            raise NotImplementedError(
                "context-parallel attention takes no attn_mask and dropout_p=0 (got "
                f"attn_mask={'a tensor' if attn_mask is not None else None}, dropout_p={dropout_p}): use is_causal "
                "for causal masking, or context_parallel=1")
        if enable_gqa:
            key, value = repeat_kv_heads(query, key, value)
        self._agree_causal(is_causal)
        self.calls += 1
        if self._device.type == "cuda":
            return self._cuda_ring(query, key, value, is_causal, scale)
        return _RingAttention.apply(query, key, value, is_causal, scale, self.group)

    def _agree_causal(self, is_causal: bool) -> None:
        """Set the ring's load balancing (`load_balanced`) for the region at its first
        attention call; PyTorch's ring on CUDA reads that option in backward too, so every
        call of a region must agree on `is_causal` (on both devices)."""
        from torch.distributed.tensor.experimental._context_parallel import _attention

        if self._causal is None:
            self._causal = bool(is_causal)
            _attention._cp_options.enable_load_balance = load_balanced(is_causal)
        elif self._causal != bool(is_causal):
            raise NotImplementedError(
                f"context-parallel attention with is_causal={bool(is_causal)} after is_causal={self._causal} in the "
                "same step: the ring's load balancing (causal only) holds for the whole step, forward and backward. "
                "Use one kind of attention per step, or context_parallel=1")

    def _cuda_ring(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool,
                   scale: float | None) -> torch.Tensor:
        """PyTorch's context parallel: the local shards as DTensors sharded on the sequence,
        SDPA on them (its flash, memory-efficient or cuDNN kernel, dispatched to the ring by
        `_cuda_dispatcher`), the local output back."""
        from torch.distributed.tensor.experimental._context_parallel._attention import _ContextParallel

        style = _ContextParallel(seq_dim=_SEQ_DIM, attention_type=_ContextParallel.AttentionType.SDPA)
        args, kwargs = style.sdpa_input_fn(None, (query, key, value), {"is_causal": is_causal, "scale": scale},
                                           self.mesh)
        return style.sdpa_output_fn(None, None, F.scaled_dot_product_attention(*args, **kwargs), self.mesh)


def load_balanced(is_causal: bool) -> bool:
    """Whether the ring runs with head-tail load balancing, on every device: for causal
    attention (the shards' causal work is balanced by `head_tail_indices`); not for full
    attention, whose work is the same on every rank whatever the order of the sequence
    (and PyTorch's ring refuses the option without ``is_causal``)."""
    return bool(is_causal)


def repeat_kv_heads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention (``enable_gqa=True``): the keys' and values' heads repeated
    to the queries' (as SDPA does), before the ring."""
    heads, kv_heads = query.shape[-3], key.shape[-3]
    if kv_heads != value.shape[-3] or heads % kv_heads:
        raise ValueError(
            f"enable_gqa=True with {heads} query heads, {kv_heads} key heads and {value.shape[-3]} value heads: the "
            "key and value heads must be equal in number and divide the query heads")
    groups = heads // kv_heads
    return key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)


class _RingMode(TorchFunctionMode):
    """Routes ``scaled_dot_product_attention`` to the region's ring (`ContextParallel.attention`),
    whatever name the model called it by; refuses attention that bypasses it."""

    def __init__(self, region: ContextParallel):
        super().__init__()
        self.region = region

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is _SDPA:
            return self.region.attention(*args, **(kwargs or {}))
        if func in _BYPASSES:
            raise NotImplementedError(
                f"{getattr(func, '__name__', func)} in a context-parallel region: it computes attention without "
                "scaled_dot_product_attention, so not over the whole sequence. Use scaled_dot_product_attention "
                "(nn.MultiheadAttention does not), or context_parallel=1")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _cuda_dispatcher(device: torch.device) -> Iterator[None]:
    """On CUDA, DTensor's dispatch of SDPA's kernels to PyTorch's ring, for the region
    (its backward runs in it too); nothing on other devices."""
    if device.type != "cuda":
        yield
        return
    from torch.distributed.tensor.experimental._context_parallel import _attention

    _attention._enable_cp_dtensor_dispatcher()
    try:
        yield
    finally:
        _attention._disable_cp_dtensor_dispatcher()


@contextlib.contextmanager
def _balanced(is_causal: bool) -> Iterator[Any]:
    """PyTorch's ring attention, its load balancing set as `load_balanced` decides."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    before = _attention._cp_options.enable_load_balance
    _attention._cp_options.enable_load_balance = load_balanced(is_causal)
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

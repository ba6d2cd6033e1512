"""`TokenLoader`: a stateful loader over a token file whose position belongs to the run, not
to a rank; `TokenDataset`: the same samples as a map-style dataset (e.g. for validation).

The loader yields this rank's micro-batches of each global batch of the run's order (see
`dream_trainer.data.tokens.GlobalOrder`): ``(inputs, targets)``, two ``int64`` tensors of
shape ``(micro_batch_size, seq_len)`` (with ``return_ids=True`` a third: the sample ids);
with ``document_info=True`` a `DocumentBatch` that adds position and document ids (see
`dream_trainer.data.documents`). Targets the loss must skip are ``ignore_index`` (-100): the
padding of ``mode="documents"``, and with ``mask_document_boundaries=True`` a window's
targets that start the next document.
Its position is one cursor (seed, epoch, samples consumed) that every rank holds alike; the
trainer saves it once per run (``trainer.data`` in a checkpoint), so it loads into any
number of ranks: a resume seeks to it, it never replays batches.

Under fault tolerance (a world with a quorum, ``world.step_slot()``) the global batch stays
the run's: each step's global batch of ``G`` samples is split over its ``S = participants x
ranks per group x accumulation`` micro-batch slots (the micro-batch shrinks as groups join,
grows as they leave, the accumulation stays). Slot ``k = (replica_rank * ranks + dp_rank) *
accumulation + micro_index`` takes positions ``[k*G//S, (k+1)*G//S)`` of the step's global
batch: every sample exactly once, sizes differing by at most one; only ``G < S`` (an empty
slot) is refused. When ``S`` does not divide ``G`` every micro-batch of the step carries a
``loss_weight`` of ``n * S / G`` (``n``: its samples; a `dream_trainer.data.weighted`
batch, still a tuple or a `DocumentBatch`) that `AbstractTrainer.backward` multiplies the
mean loss by, so the update is the whole global batch's mean loss's, as with an even split.
That weighting is by samples: with masked targets (``ignore_index``: documents' padding,
masked boundaries) a sample-weighted mean of per-micro-batch token means is not the global
batch's token mean (neither is an even split's). The cursor moves only when a step is
committed: a step that is not committed is retried on the same samples, and a group that
heals takes the cursor of the peer it heals from.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from dream_trainer.data.blend import BlendOrder, TokenBlend
from dream_trainer.data.documents import (
    IGNORE_INDEX,
    DocumentBatch,
    check_ignore_index,
    check_pad_id,
    sample_arrays,
)
from dream_trainer.data.order import WINDOW
from dream_trainer.data.tokens import GlobalOrder, TokenFile, split_global_batch
from dream_trainer.data.weighted import with_loss_weight

__all__ = ["TokenDataset", "TokenLoader"]

logger = logging.getLogger(__name__)


def _open(data: TokenFile | str | Path, dtype: str | None) -> TokenFile:
    return data if isinstance(data, TokenFile) else TokenFile(data, dtype=dtype)


def _gather(file: TokenFile, ids: np.ndarray, seq_len: int, mode: str, pad_id: int, pin: bool = False, *,
            ignore_index: int = IGNORE_INDEX, mask_boundaries: bool = False,
            document_info: bool = False) -> list[torch.Tensor]:
    """``[inputs, targets]`` of samples `ids` (with `document_info`: ``+ [position_ids,
    document_ids]``): one read of the memory map. `pin`: each in pinned host memory,
    contiguous (what a non-blocking copy to a GPU needs: a strided view of pinned memory is
    copied through pageable memory)."""
    if mode == "windows" and not (mask_boundaries or document_info) and not pin:  # the plain windows, as ever
        rows = (ids.astype(np.int64) * seq_len)[:, None] + np.arange(seq_len + 1)
        batch = torch.from_numpy(np.asarray(file.tokens[rows], dtype=np.int64))
        return [batch[:, :-1], batch[:, 1:]]
    arrays = sample_arrays(file, ids, seq_len, mode, pad_id=pad_id, ignore_index=ignore_index,
                           mask_boundaries=mask_boundaries, document_info=document_info)
    if not pin:
        return [torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for a in arrays]
    out = []
    for array in arrays:
        tensor = torch.empty((len(ids), seq_len), dtype=torch.int64, pin_memory=True)
        np.copyto(tensor.numpy(), array, casting="unsafe")  # the file's uint16/uint32 ids, widened
        out.append(tensor)
    return out


class _Options:
    """The sample options `TokenDataset` and `TokenLoader` share, checked once."""

    file: TokenFile
    seq_len: int

    def _set_options(self, owner: str, mode: str, pad_id: int, ignore_index: int, mask_document_boundaries: bool,
                     document_info: bool) -> None:
        self.mode, self.pad_id = mode, check_pad_id(pad_id, owner)
        self.ignore_index = check_ignore_index(ignore_index, owner)
        self.mask_document_boundaries, self.document_info = bool(mask_document_boundaries), bool(document_info)

    def _arrays(self, ids: np.ndarray, pin: bool = False) -> list[torch.Tensor]:
        return _gather(self.file, ids, self.seq_len, self.mode, self.pad_id, pin, ignore_index=self.ignore_index,
                       mask_boundaries=self.mask_document_boundaries, document_info=self.document_info)


class TokenDataset(_Options, Dataset[Any]):
    """Sample ``i`` of a token file as ``(inputs, targets)`` (``seq_len`` tokens each; with
    ``document_info=True`` a `DocumentBatch` whose ``sample_ids`` is ``i``): a map-style
    dataset, for a ``DataLoader`` with a ``DistributedSampler`` (validation). The options are
    `TokenLoader`'s."""

    def __init__(self, data: TokenFile | str | Path, seq_len: int, *, mode: str = "windows", pad_id: int = 0,
                 dtype: str | None = None, ignore_index: int = IGNORE_INDEX, mask_document_boundaries: bool = False,
                 document_info: bool = False):
        self._set_options("TokenDataset", mode, pad_id, ignore_index, mask_document_boundaries, document_info)
        self.file, self.seq_len = _open(data, dtype), seq_len
        self._len = self.file.n_samples(seq_len, mode)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | DocumentBatch:
        if not 0 <= index < self._len:
            raise IndexError(f"sample {index} of {self._len}")
        rows = [t[0] for t in self._arrays(np.asarray([index]))]
        return DocumentBatch(*rows, torch.tensor(index)) if self.document_info else (rows[0], rows[1])


class TokenLoader(_Options):
    """This rank's micro-batches of the run's global batches from a token file (see the
    module docstring).

    Args:
        data: a `TokenFile` or its path; or a blend of several (`dream_trainer.data.blend`):
            a `TokenBlend`, ``[(file, weight), ...]`` (named by the files' stems) or ``{name:
            (file, weight)}``. A blend's sample ids (`return_ids`, ``sample_ids``) are ``(n, 2)``
            rows ``[source index, id in the source]``; `source_counts` and `log_metrics` give
            its exact per-source counts.
        seq_len: tokens per sample (each sample reads ``seq_len + 1``: inputs and targets).
        global_batch_size: samples per optimizer step over all data-parallel ranks.
        world: the trainer's world (``dp_rank``/``dp_size``; a fault-tolerant world's quorum).
            Without one, `dp_rank` and `dp_size`.
        micro_batch_size: samples per forward pass on one rank; the accumulation is
            ``global_batch_size / (dp_size * micro_batch_size)``. None: one micro-batch per
            rank and step.
        seed: the order's seed (a blend's: an int >= 0). mode: ``"windows"`` (sample ``i``: tokens ``i * seq_len`` to
            ``(i + 1) * seq_len`` of the stream, and the next one) or ``"documents"``
            (sample ``i``: document ``i``, cropped to ``seq_len + 1`` tokens; a shorter one's
            inputs are right-padded with `pad_id`, its targets there are `ignore_index`).
        shuffle: False: the file's order (epoch after epoch); a blend's sources each in
            their file's order, a step's global batch not mixed (source after source).
        pad_id: the inputs' padding in ``mode="documents"``: a token id (an int >= 0; the
            model embeds it, the loss never sees it).
        ignore_index: the target of a position the loss skips (a negative int; -100 is what
            ``cross_entropy`` ignores by default).
        mask_document_boundaries: ``mode="windows"``: the target of each document's last
            token (the first token of the next document) is `ignore_index`: no loss for
            predicting a document from the one before it.
        document_info: yield a `DocumentBatch`: ``inputs``, ``targets``, ``position_ids``
            (restarting at 0 at every document boundary and at the sample's start),
            ``document_ids`` (the file's index of each token's document; -1: padding) and
            ``sample_ids`` (with `return_ids`), for positions and a block-causal attention
            mask (`dream_trainer.data.documents.block_causal_mask`).
        return_ids: yield the sample ids as a third element.
        pin_memory: yield the batches in pinned host memory, every tensor contiguous (their
            copy to a GPU is then non-blocking and overlaps the step). None: pin when
            `world`'s device is CUDA.
        prefetch: micro-batches read ahead on a background thread (into pinned memory when
            pinning), so a read from cold storage overlaps the step instead of stalling it.
            None: 2 when pinning (a GPU), else 0 (the step and the read would share the CPU).
            Not with a fault-tolerant quorum (each micro-batch there waits for the step's
            quorum).
        allow_different_data: the saved position records the token file's fingerprint
            (`TokenFile.fingerprint`: sizes, vocabulary, checksum); a resume on a file with
            another one is refused unless this is True (a blend: also other sources, weights or
            sizes; it then goes on from the saved step with this blend's apportionment).

    Use `for_trainer` in ``configure_dataloaders``: it takes the global and micro-batch sizes
    from ``TrainingParameters`` and the world and seed from the trainer.
    """

    global_position = True
    """The trainer saves this loader's `state_dict` once per run, the same on every rank."""

    NOMINAL_LENGTH = 2**62

    def __init__(self, data: TokenFile | str | Path | TokenBlend | Any, seq_len: int, global_batch_size: int, *,
                 world: Any = None,
                 dp_rank: int = 0, dp_size: int = 1, micro_batch_size: int | None = None, seed: int = 0,
                 mode: str = "windows", shuffle: bool = True, pad_id: int = 0, dtype: str | None = None,
                 return_ids: bool = False, pin_memory: bool | None = None, ignore_index: int = IGNORE_INDEX,
                 mask_document_boundaries: bool = False, document_info: bool = False,
                 allow_different_data: bool = False, prefetch: int | None = None):
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"TokenLoader(seq_len={seq_len!r}): expected an int >= 1")
        self._set_options("TokenLoader", mode, pad_id, ignore_index, mask_document_boundaries, document_info)
        if isinstance(data, (list, tuple, dict)):  # [(file, weight), ...] or {name: (file, weight)}
            data = TokenBlend(data, dtype=dtype)
        self.blend: TokenBlend | None = data if isinstance(data, TokenBlend) else None
        self.file = None if self.blend is not None else _open(data, dtype)  # type: ignore[assignment]
        self.seq_len, self.return_ids = seq_len, return_ids
        if world is not None:
            dp_rank, dp_size = world.dp_rank, world.dp_size
        self.world, self.dp_rank, self.dp_size = world, dp_rank, dp_size
        if pin_memory is None:
            pin_memory = getattr(getattr(world, "device", None), "type", None) == "cuda"
        self.pin_memory = bool(pin_memory)
        if prefetch is None:
            prefetch = 2 if self.pin_memory else 0
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"TokenLoader(prefetch={prefetch!r}): expected an int >= 0 (micro-batches read ahead)")
        self.prefetch = prefetch
        self.micro_batch_size, self.accumulation_steps = split_global_batch(global_batch_size, dp_size, micro_batch_size)
        self.global_batch_size = global_batch_size
        self.order: GlobalOrder | BlendOrder
        if self.blend is not None:
            self.order = BlendOrder(self.blend, seq_len, mode, global_batch_size, seed=seed, shuffle=shuffle,
                                    allow_different_data=allow_different_data)
            self._init_steps()
            return
        n_samples = self.file.n_samples(seq_len, mode)
        if global_batch_size > n_samples:
            raise ValueError(f"TokenLoader: global_batch_size={global_batch_size} is more than the {n_samples} samples "
                             f"of {self.file.path} (seq_len={seq_len}, mode={mode!r})")
        self.order = GlobalOrder(n_samples, global_batch_size, seed=seed, shuffle=shuffle,
                                 fingerprint=self.file.fingerprint(), allow_different_data=allow_different_data)
        self._init_steps()

    def _init_steps(self) -> None:
        self.follows_quorum = callable(getattr(self.world, "step_slot", None))
        self._micro = 0  # micro-batches of the current step handed out (without a quorum)
        self._attempt: int | None = None  # the quorum's step attempt being served
        self._pending: int | None = None  # committed steps when the served step began (with a quorum)

    @classmethod
    def for_trainer(cls, trainer: Any, data: TokenFile | str | Path | TokenBlend | Any, seq_len: int,
                    **kwargs: Any) -> TokenLoader:
        """A loader for `trainer`: ``TrainingParameters.global_batch_size`` (required) and
        ``micro_batch_size``, the trainer's world and seed; `kwargs` as in the constructor."""
        training = trainer.training_parameters
        if training.global_batch_size is None:
            raise ValueError("TokenLoader.for_trainer needs TrainingParameters(global_batch_size=...)")
        kwargs.setdefault("seed", trainer.seed or 0)
        return cls(data, seq_len, training.global_batch_size, world=trainer.world,
                   micro_batch_size=training.micro_batch_size, **kwargs)

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps per pass over the data (an epoch's remainder is dropped); a blend's
        epoch is nominal: ``sum(samples of its sources) // global_batch_size`` steps."""
        return self.order.n_samples // self.global_batch_size

    def __len__(self) -> int:
        """Micro-batches per epoch on this rank; with a quorum, nominal (it never ends: train
        by ``max_steps``)."""
        return self.NOMINAL_LENGTH if self.follows_quorum else self.steps_per_epoch * self.accumulation_steps

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` unless the cursor is in it already (the trainer calls it at
        every epoch's start, also after a resume). Ignored with a quorum."""
        if not self.follows_quorum and epoch != self.order.epoch:
            self.order.epoch, self.order.consumed, self._micro = epoch, 0, 0

    def source_counts(self) -> dict[str, int]:
        """A blend's samples taken so far from each source (exact: the apportionment of the
        global batches the cursor has passed; a step counts once its last micro-batch is
        handed out, or with a quorum once it is committed)."""
        if not isinstance(self.order, BlendOrder):
            raise ValueError(f"source_counts() counts a blend's sources; this loader reads one file, {self.file.path}")
        return dict(zip(self.order.blend.names, self.order.counts()))

    def log_metrics(self, prefix: str = "data/") -> dict[str, float]:
        """For ``trainer.log_dict``: a blend's ``{prefix}samples/<source>`` (`source_counts`)
        and ``{prefix}epochs/<source>`` (passes over that source, fractional); ``{}`` for one file."""
        if not isinstance(self.order, BlendOrder):
            return {}
        metrics: dict[str, float] = {}
        for (name, taken), size in zip(self.source_counts().items(), self.order.sizes):
            metrics[f"{prefix}samples/{name}"] = float(taken)
            metrics[f"{prefix}epochs/{name}"] = taken / size
        return metrics

    def __iter__(self) -> Iterator[Any]:
        if self.follows_quorum:
            return self._quorum_batches()
        return self._epoch_batches()

    def _epoch_batches(self) -> Iterator[Any]:
        """The rest of the cursor's epoch (the next epoch when it is used up). The cursor moves
        as batches are handed out, not as they are read ahead."""
        order = self.order
        if not order.has_batch():
            order.epoch, order.consumed, self._micro = order.epoch + 1, 0, 0
        if not self.prefetch:
            for ids, ends_step in self._planned():
                self._handed_out(ends_step)
                yield self._batch(ids)
            return
        reader = ThreadPoolExecutor(1, thread_name_prefix="TokenLoader-prefetch")
        ahead: deque[tuple[Future[Any], bool]] = deque()
        try:
            for ids, ends_step in self._planned():
                ahead.append((reader.submit(self._batch, ids), ends_step))
                if len(ahead) > self.prefetch:
                    yield self._take(ahead)
            while ahead:
                yield self._take(ahead)
        finally:  # also when the consumer stops early: reads not handed out are dropped
            reader.shutdown(wait=True, cancel_futures=True)  # a read under way finishes; the thread ends

    def _planned(self) -> Iterator[tuple[np.ndarray, bool]]:
        """``(sample ids, ends its step)`` of this rank's micro-batches for the rest of the
        cursor's epoch, from the cursor on; the cursor stays."""
        order, per_rank, micro = self.order, self.global_batch_size // self.dp_size, self.micro_batch_size
        epoch, consumed, first = order.epoch, order.consumed, self._micro
        left = (order.n_samples - consumed) // self.global_batch_size  # whole global batches in the epoch
        window = max(1, WINDOW // per_rank)  # this rank's shares of that many global batches at once
        for done in range(0, left, window):
            count = min(window, left - done)
            starts = consumed + (done + np.arange(count)) * self.global_batch_size + self.dp_rank * per_rank
            ids = order.ids_at(epoch, (starts[:, None] + np.arange(per_rank)).ravel())
            shares = ids.reshape(count, per_rank, *ids.shape[1:])  # a blend's ids are (source, id) rows
            for share in shares:
                for index in range(first, self.accumulation_steps):
                    yield share[index * micro:(index + 1) * micro], index == self.accumulation_steps - 1
                first = 0

    def _take(self, ahead: deque[tuple[Future[Any], bool]]) -> Any:
        future, ends_step = ahead.popleft()
        batch = future.result()
        self._handed_out(ends_step)
        return batch

    def _handed_out(self, ends_step: bool) -> None:
        """A micro-batch is handed out: on the step's last one the cursor moves, so that a
        checkpoint after this step holds the next position."""
        self._micro += 1
        if ends_step:
            self.order.advance()
            self._micro = 0

    def _quorum_batches(self) -> Iterator[Any]:
        world, order = self.world, self.order
        while True:
            attempt, committed, participants, replica_rank, micro_index = world.step_slot()
            if attempt != self._attempt:  # the first micro-batch of a step
                if self._pending is not None and committed > self._pending:  # the previous step was committed
                    order.advance()
                self._attempt, self._pending = attempt, committed
            ids, weight = self._quorum_ids(participants, replica_rank, micro_index)
            batch = self._batch(ids)
            yield batch if weight is None else with_loss_weight(batch, weight)

    def _quorum_ids(self, participants: int, replica_rank: int, micro_index: int) -> tuple[np.ndarray, float | None]:
        """Samples of one micro-batch when `participants` groups share the global batch, and
        its loss weight: None when the step's slots split the global batch evenly, else
        ``n * slots / global_batch_size`` (see the module docstring)."""
        total, ranks, accumulation = self.global_batch_size, self.dp_size, self.accumulation_steps
        slots = participants * ranks * accumulation
        if total < slots:
            raise ValueError(
                f"global_batch_size={total} is fewer samples than the {slots} micro-batch slots of a step "
                f"({participants} replica group(s) x {ranks} rank(s) x {accumulation} micro-batch(es)): a slot would "
                f"be empty; at most {total // (ranks * accumulation)} group(s) can share it")
        if micro_index >= accumulation:
            raise ValueError(f"micro-batch {micro_index + 1} of a step, but the loader's accumulation is "
                             f"{accumulation}: set TrainingParameters.global_batch_size/micro_batch_size for the trainer")
        slot = (replica_rank * ranks + self.dp_rank) * accumulation + micro_index
        start, stop = slot * total // slots, (slot + 1) * total // slots
        weight = None if total % slots == 0 else (stop - start) * slots / total
        return self.order.peek()[start:stop], weight

    def _arrays(self, ids: np.ndarray, pin: bool = False) -> list[torch.Tensor]:
        if self.blend is None:
            return super()._arrays(ids, pin)
        assert isinstance(self.order, BlendOrder)
        return self.order.gather(ids, lambda file, rows: _gather(
            file, rows, self.seq_len, self.mode, self.pad_id, ignore_index=self.ignore_index,
            mask_boundaries=self.mask_document_boundaries, document_info=self.document_info), pin)

    def _batch(self, ids: np.ndarray) -> tuple[torch.Tensor, ...] | DocumentBatch:
        tensors = self._arrays(ids, self.pin_memory)
        sample_ids = torch.from_numpy(ids.astype(np.int64)) if self.return_ids else None
        if self.document_info:
            return DocumentBatch(*tensors, sample_ids)
        return (*tensors, sample_ids) if self.return_ids else tuple(tensors)

    # ------------------------------------------------------------------ the position
    def state_dict(self) -> dict[str, Any]:
        """The run's position: plain integers, the same on every rank (see the module
        docstring): the order's cursor, the micro-batches of an unfinished step handed out,
        and (with a quorum) the committed steps when the step being served began."""
        return {"order": self.order.state_dict(), "micro": self._micro, "accumulation": self.accumulation_steps,
                "pending": -1 if self._pending is None else self._pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Seek to a saved position, from a run with any number of ranks. Refused: a
        position of another corpus, or one inside a step when the accumulation changed."""
        saved = state["order"]
        blend = isinstance(self.order, BlendOrder)
        if not blend and "blend" in saved:
            raise ValueError(f"the saved data position is of a blend of {[s['name'] for s in saved['sources']]}; "
                             f"this loader reads one file, {self.file.path}")
        if not blend and int(saved["n_samples"]) != self.order.n_samples:
            raise ValueError(f"the saved data position is over {saved['n_samples']} samples, {self.file.path} has "
                             f"{self.order.n_samples} (seq_len={self.seq_len}, mode={self.mode!r}): not the same data")
        if not blend and int(saved["global_batch_size"]) != self.global_batch_size:  # a blend refuses it
            logger.warning("the saved data position is of global_batch_size=%s, this run's is %d: the run goes on "
                           "from the same sample, with another global batch", saved["global_batch_size"],
                           self.global_batch_size)
        micro = int(state.get("micro", 0))
        if micro and int(state.get("accumulation", self.accumulation_steps)) != self.accumulation_steps:
            raise ValueError(f"the saved data position is {micro} micro-batch(es) into a step of "
                             f"{state['accumulation']}, but this run accumulates {self.accumulation_steps}: resume "
                             "from a checkpoint taken at a step boundary")
        self.order.load_state_dict(saved)
        self._micro = micro
        pending = int(state.get("pending", -1))
        self._pending = None if pending < 0 else pending
        self._attempt = None  # the next batch starts a step

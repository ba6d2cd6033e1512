"""Document-aware samples: where each token's document starts and ends, for the loss, the
positions and the attention of a model trained on a token file.

A token file knows its documents (``TokenFile.offsets``). From them a batch can carry, beside
``inputs`` and ``targets``:

- **a loss mask in the targets**: a target the loss must skip is `IGNORE_INDEX` (-100, what
  ``torch.nn.functional.cross_entropy`` ignores): the padding of ``mode="documents"`` (always),
  and in ``mode="windows"`` with ``mask_document_boundaries=True`` the first token of a
  document predicted from the end of the previous one;
- **position ids** (``int64``, ``(B, T)``) that restart at 0 at every document boundary
  inside a sample, and at the sample's start (a window that starts inside a document
  counts from 0 there: positions stay below ``seq_len``);
- **document ids** (``int64``, ``(B, T)``): the index in the file of the document each
  input token belongs to (-1: padding), for a block-causal attention mask
  (`block_causal_mask`, `flex_block_mask`): a token attends to the earlier tokens of its
  own document only.

`DocumentBatch` is that batch (a named tuple: the trainer's batch transfer moves every
tensor of it). Everything is computed with numpy on whole micro-batches (two
``searchsorted`` per sample over the offsets, then cumulative sums): no Python loop per
token or per sample.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from dream_trainer.data.tokens import TokenFile

__all__ = ["IGNORE_INDEX", "PAD_DOCUMENT", "DocumentBatch", "block_causal_mask", "flex_block_mask"]

IGNORE_INDEX = -100
"""The target of a position the loss skips: ``cross_entropy``'s default ``ignore_index``."""

PAD_DOCUMENT = -1
"""The document id of a padding position (``mode="documents"``)."""


class DocumentBatch(NamedTuple):
    """A micro-batch with its documents: every tensor ``int64``, ``(B, T)`` (one sample of a
    `TokenDataset`: ``(T,)``), contiguous, pinned where the loader pins.

    Attributes:
        inputs: token ids (padding: the loader's ``pad_id``).
        targets: the next token of each input; `IGNORE_INDEX` where the loss must skip it.
        position_ids: each input's position in its document, counted from the sample's start
            or the document's, whichever is later (0 at every boundary).
        document_ids: the index in the token file of each input's document; -1 for padding.
        sample_ids: the samples' ids (``(B,)``; a dataset's: a 0-d tensor); None unless the
            loader was asked for them (``return_ids=True``).
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor
    sample_ids: torch.Tensor | None = None


def check_pad_id(pad_id: Any, owner: str) -> int:
    """`pad_id` if it is a token id (an int >= 0); otherwise a ValueError naming it."""
    if isinstance(pad_id, bool) or not isinstance(pad_id, (int, np.integer)) or pad_id < 0:
        raise ValueError(f"{owner}(pad_id={pad_id!r}): the padding of the inputs must be a token id (an int >= 0: "
                         f"the model embeds it); the targets at padding are ignore_index={IGNORE_INDEX} already, so "
                         "the loss skips them")
    return int(pad_id)


def check_ignore_index(ignore_index: Any, owner: str) -> int:
    """`ignore_index` if it is a negative int (never a token id); otherwise a ValueError."""
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, np.integer)) or ignore_index >= 0:
        raise ValueError(f"{owner}(ignore_index={ignore_index!r}): must be a negative int (a token id would be "
                         f"skipped by the loss wherever it is a real target); cross_entropy's default is "
                         f"{IGNORE_INDEX}")
    return int(ignore_index)


def sample_arrays(file: TokenFile, ids: np.ndarray, seq_len: int, mode: str, *, pad_id: int, ignore_index: int,
                  mask_boundaries: bool, document_info: bool) -> list[np.ndarray]:
    """``[inputs, targets]`` (with `document_info`: ``+ [position_ids, document_ids]``) of
    samples `ids`, each ``(len(ids), seq_len)``: numpy arrays (views allowed) that the loader
    copies into its tensors."""
    ids = np.asarray(ids, dtype=np.int64)
    window = np.arange(seq_len + 1)
    if mode == "windows":
        first = ids * seq_len  # each sample's first token in the stream
        tokens = np.asarray(file.tokens[first[:, None] + window], dtype=np.int64)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        if not (mask_boundaries or document_info):
            return [inputs, targets]
        document, starts = _boundaries(file.offsets, first, seq_len + 1)
        if mask_boundaries:  # a target that starts a document
            targets = np.where(starts[:, 1:] > 0, ignore_index, targets)
        if not document_info:
            return [inputs, targets]
        starts, column = starts[:, :-1], window[:-1]
        documents = document[:, None] + np.cumsum(starts, axis=1)
        positions = column - np.maximum.accumulate(np.where(starts > 0, column, 0), axis=1)  # since the last start
        return [inputs, targets, positions, documents]
    # documents: sample i is document i, cropped to seq_len + 1 tokens, right-padded with pad_id
    starts = file.offsets[ids].astype(np.int64)
    lengths = np.minimum(file.offsets[ids + 1].astype(np.int64) - starts, seq_len + 1)
    real = window < lengths[:, None]
    tokens = np.full((len(ids), seq_len + 1), pad_id, dtype=np.int64)
    tokens[real] = file.tokens[(starts[:, None] + window)[real]]  # one read of the map for the batch
    inputs, targets = tokens[:, :-1], np.where(real[:, 1:], tokens[:, 1:], ignore_index)
    if not document_info:
        return [inputs, targets]
    positions = np.broadcast_to(window[:-1], inputs.shape)
    documents = np.where(real[:, :-1], ids[:, None], PAD_DOCUMENT)
    return [inputs, targets, positions, documents]


def _boundaries(offsets: np.ndarray, first: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """For spans of `length` tokens from `first` (``(B,)``): the document of each span's
    first token (``(B,)``), and how many documents start at each later token (``(B,
    length)``, 0 at column 0; more than 1 where empty documents lie between). Two
    ``searchsorted`` per span, not one per token: a window holds few boundaries."""
    lo = np.searchsorted(offsets, first.astype(np.uint64), side="right").astype(np.int64)  # offsets <= first
    hi = np.searchsorted(offsets, (first + length - 1).astype(np.uint64), side="right").astype(np.int64)
    counts, B = hi - lo, len(first)  # the offsets inside each span: documents that start there
    total = int(counts.sum())
    if not total:
        return lo - 1, np.zeros((B, length), dtype=np.int64)
    span = np.repeat(np.arange(B), counts)
    nth = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)  # 0, 1, .. within each span
    column = offsets[np.repeat(lo, counts) + nth].astype(np.int64) - first[span]
    return lo - 1, np.bincount(span * length + column, minlength=B * length).reshape(B, length)


# ---------------------------------------------------------------------- attention masks
def block_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """``(B, 1, T, T)`` bool for ``scaled_dot_product_attention(attn_mask=...)``: query ``t``
    attends to key ``s`` when ``s <= t`` and both are of the same document (padding, -1,
    attends to padding: no row is empty). Built on `document_ids`' device, no host sync."""
    if document_ids.dim() != 2:
        raise ValueError(f"block_causal_mask: document_ids of shape {tuple(document_ids.shape)}; expected (B, T)")
    T = document_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=document_ids.device).tril()
    return ((document_ids[:, :, None] == document_ids[:, None, :]) & causal)[:, None]


def flex_block_mask(document_ids: torch.Tensor, block_size: int = 128) -> Any:
    """The same mask as a ``torch.nn.attention.flex_attention.BlockMask`` (for
    ``flex_attention(q, k, v, block_mask=...)``): blocks of `block_size` x `block_size`
    with no allowed pair are skipped. Fast under ``torch.compile``; eager, flex attention
    computes the whole score matrix."""
    from torch.nn.attention.flex_attention import create_block_mask

    if document_ids.dim() != 2:
        raise ValueError(f"flex_block_mask: document_ids of shape {tuple(document_ids.shape)}; expected (B, T)")

    def same_document_causal(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (kv <= q) & (document_ids[b, q] == document_ids[b, kv])

    B, T = document_ids.shape
    return create_block_mask(same_document_causal, B, None, T, T, device=document_ids.device, BLOCK_SIZE=block_size)

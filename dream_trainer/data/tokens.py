"""Token files for language-model pretraining, and the global sample order over them.

**A token file** holds one corpus, already tokenized: a 32-byte header, the tokens (``uint16``
or ``uint32``), then the document boundaries (``n_docs + 1`` ``uint64`` offsets). It is
memory-mapped with numpy: opening it reads the header and the offsets, never the tokens.

    header: magic b"DTTOKENS" | version u32 | itemsize u32 (2 or 4) | n_tokens u64 | n_docs u64

A truncated file (smaller than its header says), a foreign or damaged header, offsets that
do not run from 0 to ``n_tokens``, or a file of another dtype than the one asked for is refused
with a `TokenFileError` naming the file and what is wrong.

**Samples** are fixed-length windows over the concatenated stream (``"windows"``: sample ``i``
is ``tokens[i * L : i * L + L + 1]``, inputs and their next-token targets), or one document
each (``"documents"``: cropped to ``L + 1`` tokens).

**The order** is one permutation of the samples per epoch, drawn from ``(seed, epoch)``: a
property of the run, not of a rank. A global batch is the next ``global_batch_size`` samples of
that order; `GlobalOrder.step_samples` splits it into the micro-batches of one data-parallel
rank. Which samples make up each global batch therefore does not depend on how many ranks
share it.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["GlobalOrder", "TokenFile", "TokenFileError", "split_global_batch", "write_tokens"]

MAGIC = b"DTTOKENS"
VERSION = 1
_HEADER = struct.Struct("<8sIIQQ")  # magic, version, itemsize, n_tokens, n_docs
_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
_NAMES = {"uint16": 2, "uint32": 4}


class TokenFileError(ValueError):
    """A token file that cannot be read as asked: damaged, truncated or of another dtype."""


def write_tokens(path: str | Path, documents: Iterable[Sequence[int] | np.ndarray], dtype: str = "uint16") -> Path:
    """Write `documents` (token id sequences) as one token file; returns its path. `dtype`:
    ``"uint16"`` (vocabularies up to 65,536) or ``"uint32"``. Written to a temporary name of
    this process and renamed, so a reader never sees a partial file (and ranks writing the
    same file at once do not mix their writes)."""
    if dtype not in _NAMES:
        raise ValueError(f"write_tokens(dtype={dtype!r}): use one of {sorted(_NAMES)}")
    np_dtype = _DTYPES[_NAMES[dtype]]
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
    offsets = [0]
    with tmp.open("wb") as f:
        f.write(b"\0" * _HEADER.size)
        for doc in documents:
            arr = np.asarray(doc)
            if arr.ndim != 1 or (arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np_dtype).max)):
                raise ValueError(f"write_tokens: a document holds ids outside {dtype} (0..{np.iinfo(np_dtype).max}) "
                                 "or is not one-dimensional")
            f.write(arr.astype(np_dtype).tobytes())
            offsets.append(offsets[-1] + arr.size)
        f.write(np.asarray(offsets, dtype="<u8").tobytes())
        f.seek(0)
        f.write(_HEADER.pack(MAGIC, VERSION, np_dtype.itemsize, offsets[-1], len(offsets) - 1))
    tmp.replace(path)
    return path


class TokenFile:
    """A token file, memory-mapped (see the module docstring). `dtype`, when given, must be
    the file's (``"uint16"`` or ``"uint32"``)."""

    def __init__(self, path: str | Path, dtype: str | None = None):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with self.path.open("rb") as f:
                head = f.read(_HEADER.size)
        except OSError as exc:
            raise TokenFileError(f"token file {self.path}: cannot be read ({exc.strerror or exc})") from exc
        if len(head) < _HEADER.size or head[:8] != MAGIC:
            raise TokenFileError(f"token file {self.path}: not a token file (no {MAGIC!r} header); "
                                 "write one with dream_trainer.data.write_tokens")
        _, version, itemsize, n_tokens, n_docs = _HEADER.unpack(head)
        if version != VERSION or itemsize not in _DTYPES:
            raise TokenFileError(f"token file {self.path}: version {version}, itemsize {itemsize}: "
                                 f"only version {VERSION} with 2- or 4-byte tokens is known")
        self.dtype = _DTYPES[itemsize]
        name = {2: "uint16", 4: "uint32"}[itemsize]
        if dtype is not None and dtype != name:
            raise TokenFileError(f"token file {self.path} holds {name} tokens, but dtype={dtype!r} was asked for")
        expected = _HEADER.size + n_tokens * itemsize + (n_docs + 1) * 8
        if size != expected:
            raise TokenFileError(f"token file {self.path}: {size} bytes, but its header describes {expected} "
                                 f"({n_tokens} tokens, {n_docs} documents): {'truncated' if size < expected else 'trailing bytes'}")
        self.tokens = np.memmap(self.path, dtype=self.dtype, mode="r", offset=_HEADER.size, shape=(n_tokens,))
        self.offsets = np.fromfile(self.path, dtype="<u8", count=n_docs + 1, offset=_HEADER.size + n_tokens * itemsize)
        if self.offsets[0] != 0 or self.offsets[-1] != n_tokens or np.any(np.diff(self.offsets.astype(np.int64)) < 0):
            raise TokenFileError(f"token file {self.path}: damaged document offsets (they must rise from 0 to {n_tokens})")

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def n_docs(self) -> int:
        return int(self.offsets.shape[0] - 1)

    def n_samples(self, seq_len: int, mode: str = "windows") -> int:
        """How many samples of ``seq_len + 1`` tokens the file gives in `mode`."""
        _check_mode(mode)
        return max(self.n_tokens - 1, 0) // seq_len if mode == "windows" else self.n_docs

    def sample(self, index: int, seq_len: int, mode: str = "windows", pad_id: int = 0) -> np.ndarray:
        """Sample `index` as ``seq_len + 1`` int64 tokens (a document shorter than that is
        right-padded with `pad_id`)."""
        _check_mode(mode)
        if mode == "windows":
            start = index * seq_len
            return np.asarray(self.tokens[start:start + seq_len + 1], dtype=np.int64)
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        out = np.full(seq_len + 1, pad_id, dtype=np.int64)
        doc = self.tokens[start:min(end, start + seq_len + 1)]
        out[:doc.shape[0]] = doc
        return out


def _check_mode(mode: str) -> None:
    if mode not in ("windows", "documents"):
        raise ValueError(f"mode={mode!r}: use 'windows' or 'documents'")


def split_global_batch(global_batch_size: int, dp_size: int, micro_batch_size: int | None = None) -> tuple[int, int]:
    """``(micro_batch_size, accumulation_steps)`` for a global batch over `dp_size`
    data-parallel ranks: ``global = dp_size * micro * accumulation``. Without a micro-batch
    size, one micro-batch per rank. A split that does not divide is refused, naming the
    sizes that would."""
    if global_batch_size < 1 or dp_size < 1:
        raise ValueError(f"global_batch_size={global_batch_size}, dp_size={dp_size}: both must be at least 1")
    if global_batch_size % dp_size:
        sizes = [d for d in range(1, global_batch_size + 1) if global_batch_size % d == 0]
        raise ValueError(f"global_batch_size={global_batch_size} cannot be split over {dp_size} data-parallel ranks; "
                         f"data-parallel sizes that divide it: {sizes}")
    per_rank = global_batch_size // dp_size
    micro = per_rank if micro_batch_size is None else micro_batch_size
    if micro < 1 or per_rank % micro:
        sizes = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
        raise ValueError(f"micro_batch_size={micro_batch_size} does not divide the {per_rank} samples each of "
                         f"{dp_size} ranks takes from global_batch_size={global_batch_size}; micro-batch sizes that "
                         f"do: {sizes}")
    return micro, per_rank // micro


@dataclass
class GlobalOrder:
    """The run's sample order and position: one permutation of `n_samples` per epoch, from
    ``(seed, epoch)`` (``shuffle=False``: the file's order), and a cursor (`epoch`, `consumed`
    samples of it) that is the same on every rank. A global batch that would run past the end
    of an epoch starts the next one (the remainder is dropped: every global batch has the
    same size)."""

    n_samples: int
    global_batch_size: int
    seed: int = 0
    epoch: int = 0
    consumed: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.global_batch_size <= self.n_samples:
            raise ValueError(f"global_batch_size={self.global_batch_size}: must be between 1 and the "
                             f"{self.n_samples} samples of an epoch")
        self._order: tuple[int, np.ndarray] | None = None

    def order(self, epoch: int) -> np.ndarray:
        """The permutation of epoch `epoch` (the same on every machine: numpy's PCG64)."""
        if self._order is None or self._order[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._order = (epoch, rng.permutation(self.n_samples) if self.shuffle else np.arange(self.n_samples))
        return self._order[1]

    def has_batch(self) -> bool:
        """Whether the cursor's epoch has a whole global batch left."""
        return self.consumed + self.global_batch_size <= self.n_samples

    def peek(self) -> np.ndarray:
        """The sample ids of the global batch at the cursor (moved to the next epoch first
        when this one is used up); the cursor stays."""
        if not self.has_batch():
            self.epoch, self.consumed = self.epoch + 1, 0
        return self.order(self.epoch)[self.consumed:self.consumed + self.global_batch_size]

    def advance(self) -> None:
        """Move the cursor past the global batch `peek` returns."""
        self.peek()
        self.consumed += self.global_batch_size

    def next_global_batch(self) -> np.ndarray:
        """The sample ids of the next global batch; advances the cursor."""
        batch = self.peek()
        self.advance()
        return batch

    def step_samples(self, dp_rank: int, dp_size: int, micro_batch_size: int | None = None) -> list[np.ndarray]:
        """This rank's micro-batches (sample ids) of the next global batch: rank ``r`` takes the
        ``r``-th contiguous share, cut into micro-batches in order. Every rank must call it
        once per optimizer step (the cursor is global)."""
        micro, accumulation = split_global_batch(self.global_batch_size, dp_size, micro_batch_size)
        share = self.next_global_batch()[dp_rank * micro * accumulation:(dp_rank + 1) * micro * accumulation]
        return [share[i * micro:(i + 1) * micro] for i in range(accumulation)]

    def state_dict(self) -> dict[str, int]:
        """The position: plain integers, independent of the number of ranks."""
        return {"seed": self.seed, "epoch": self.epoch, "consumed": self.consumed, "n_samples": self.n_samples,
                "global_batch_size": self.global_batch_size, "shuffle": int(self.shuffle)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Seek to a saved position (no batch is replayed). The corpus must be the same size."""
        if int(state["n_samples"]) != self.n_samples:
            raise ValueError(f"the saved data position is over {state['n_samples']} samples, this corpus has "
                             f"{self.n_samples}: not the same data")
        self.seed, self.epoch, self.consumed = int(state["seed"]), int(state["epoch"]), int(state["consumed"])
        self.shuffle = bool(state.get("shuffle", self.shuffle))
        self._order = None

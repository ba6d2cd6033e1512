"""Token files for language-model pretraining, and the global sample order over them.

**A token file** holds one corpus, already tokenized: a header, the tokens (``uint16`` or
``uint32``), then the document boundaries (``n_docs + 1`` ``uint64`` offsets). It is
memory-mapped with numpy: opening it reads the header and the offsets, never the tokens.

    version 2 (64 bytes): magic b"DTTOKENS" | version u32 | itemsize u32 | n_tokens u64 | n_docs u64
                          | vocab_size u64 | checksum algorithm u32 (1: xxh3_64) | 0 u32 | checksum u64 | 0 u64
    version 1 (32 bytes): magic | version | itemsize | n_tokens | n_docs    (still read; no vocabulary, no checksum)

Every token of a version-2 file is below its ``vocab_size``; its checksum is xxHash's
``xxh3_64`` of the token bytes, then the offset bytes, then the header's first 48 bytes (all
but the checksum). `TokenFile(..., verify=True)` (or ``python -m dream_trainer.data.prepare
--verify FILE``) recomputes both. `TokenWriter` writes a file in one pass with bounded
memory (the tokens are never held; the offsets spill to a side file), under a temporary
name, and renames it when it is complete and on disk.

A truncated file (smaller than its header says), a foreign or damaged header, offsets that
do not run from 0 to ``n_tokens``, or a file of another dtype or vocabulary than the one
asked for is refused with a `TokenFileError` naming the file and what is wrong.

**Samples** are fixed-length windows over the concatenated stream (``"windows"``: sample ``i``
is ``tokens[i * L : i * L + L + 1]``, inputs and their next-token targets), or one document
each (``"documents"``: cropped to ``L + 1`` tokens).

**The order** (`GlobalOrder`, from `dream_trainer.data.order`) is one permutation of the samples
per epoch, drawn from ``(seed, epoch)``: a property of the run, not of a rank.
"""

from __future__ import annotations

import glob
import os
import socket
import struct
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dream_trainer.data.order import GlobalOrder, split_global_batch
from dream_trainer.durable import fsync_dir

__all__ = ["GlobalOrder", "TokenFile", "TokenFileError", "TokenWriter", "split_global_batch", "write_tokens"]

MAGIC = b"DTTOKENS"
VERSION = 2
_HEADER_V1 = struct.Struct("<8sIIQQ")  # magic, version, itemsize, n_tokens, n_docs
_HEADER = struct.Struct("<8sIIQQQIIQQ")  # + vocab_size, checksum algorithm, 0, checksum, 0
_HASHED_HEADER = 48  # the header bytes the checksum covers: all before the checksum
_XXH3_64 = 1
_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
_NAMES = {"uint16": 2, "uint32": 4}
_CHUNK = 1 << 22  # tokens per read when verifying (offset bytes: 8x)
_OFFSET_BUFFER = 1 << 20  # document offsets a writer holds before they spill to its side file


class TokenFileError(ValueError):
    """A token file that cannot be read as asked: damaged, truncated, of another dtype or
    vocabulary, or failing its verification."""


def _xxh3() -> Any:
    """A fresh ``xxhash.xxh3_64`` hasher (the package is imported only here)."""
    try:
        import xxhash
    except ImportError as exc:
        raise ImportError("token files carry an xxh3_64 checksum, which needs the xxhash package: "
                          "pip install xxhash") from exc
    return xxhash.xxh3_64()


class TokenWriter:
    """Writes one token file (version 2) in a single pass: documents go in one by one
    (`add`) or many at a time (`write` with their ends), the tokens straight to disk. The
    checksum is computed on the way; memory stays bounded (a few MB of buffered offsets,
    then a side file). Use it as a context manager::

        with TokenWriter("corpus.tokens", dtype="uint16", vocab_size=50257) as out:
            for doc in docs:
                out.add(doc)

    The file is written under a temporary name unique to this host, process and writer,
    in the target's directory, flushed to disk (``fsync``) and renamed when `close` runs: a
    reader never sees a partial file, writers of the same path never mix, and on an error
    (an exception inside the ``with``, or `abort`) the temporary files are removed.

    Args:
        path: the file to write (replaced if it exists).
        dtype: ``"uint16"`` (vocabularies up to 65,536) or ``"uint32"``.
        vocab_size: every id must be below it (recorded in the header; `TokenFile` checks it
            with ``verify=True``). None: the largest id written + 1 (record the real
            vocabulary when you know it: only then does verification catch an id the model
            cannot embed).
    """

    def __init__(self, path: str | Path, dtype: str = "uint16", vocab_size: int | None = None):
        if dtype not in _NAMES:
            raise ValueError(f"TokenWriter(dtype={dtype!r}): use one of {sorted(_NAMES)}")
        self.dtype = _DTYPES[_NAMES[dtype]]
        self._dtype_name, limit = dtype, 1 << (8 * self.dtype.itemsize)
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer))
                                       or not 1 <= vocab_size <= limit):
            raise ValueError(f"TokenWriter(vocab_size={vocab_size!r}): expected an int from 1 to {limit} "
                             f"(what {dtype} holds), or None")
        self.vocab_size = None if vocab_size is None else int(vocab_size)
        self._limit = limit if vocab_size is None else self.vocab_size
        self.path = Path(path)
        self._hasher = _xxh3()
        self._tmp = self.path.with_name(f"{self.path.name}.tmp-{socket.gethostname()}-{os.getpid()}-"
                                        f"{uuid.uuid4().hex[:12]}")  # what `temporary_files` finds
        self._side_path = self._tmp.with_name(self._tmp.name + ".offsets")
        self._file: Any = self._tmp.open("xb")
        self._file.write(b"\0" * _HEADER.size)
        self._side: Any = None  # offsets spilled from the buffer, in order
        self._buffer, self._buffered = np.empty(_OFFSET_BUFFER, dtype="<u8"), 0
        self.n_tokens, self.n_docs, self._max, self._closed = 0, 0, -1, False
        self._last_end = 0

    @staticmethod
    def temporary_files(path: str | Path, pid: int | None = None) -> list[Path]:
        """The temporary files that writers of `path` in process `pid` (default: this one) on
        this host hold now, e.g. to remove them from a signal handler that must exit at once."""
        path = Path(path)
        pattern = f"{glob.escape(path.name)}.tmp-{glob.escape(socket.gethostname())}-{pid or os.getpid()}-*"
        return sorted(path.parent.glob(pattern))

    def __enter__(self) -> TokenWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def add(self, doc: Sequence[int] | np.ndarray) -> None:
        """Append one document (a sequence of token ids; if `write` left a document open,
        these tokens end it)."""
        arr = np.asarray(doc)
        self.write(arr, (arr.size,) if arr.ndim == 1 else ())

    def write(self, tokens: Sequence[int] | np.ndarray, ends: Sequence[int] | np.ndarray = ()) -> None:
        """Append `tokens`; a document ends after ``ends[i]`` of them (non-decreasing, at
        most ``len(tokens)``). Tokens after the last end continue the open document (a
        document may arrive in pieces); `close` ends it. Nothing is written if a check fails."""
        if self._closed:
            raise ValueError(f"TokenWriter({self.path}): already closed")
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"{self.path.name}: document {self.n_docs} is not one-dimensional (shape {arr.shape})")
        if arr.size and arr.dtype.kind not in "iub":
            raise ValueError(f"{self.path.name}: document {self.n_docs} holds {arr.dtype} values; token ids are ints")
        stops = np.asarray(ends, dtype=np.int64).reshape(-1)
        if stops.size and (stops[0] < 0 or stops[-1] > arr.size or np.any(np.diff(stops) < 0)):
            raise ValueError(f"{self.path.name}: ends={stops.tolist()[:8]}... must rise from 0 to the "
                             f"{arr.size} tokens written with them")
        if arr.size:
            low, high = int(arr.min()), int(arr.max())
            if low < 0 or high >= self._limit:
                at = int(np.flatnonzero((arr < 0) | (arr >= self._limit))[0])
                doc = self.n_docs + int(np.searchsorted(stops, at, side="right"))
                allowed = (f"the vocabulary of {self.vocab_size} (ids 0..{self.vocab_size - 1})" if self.vocab_size
                           else f"{self._dtype_name} (0..{self._limit - 1})")
                raise ValueError(f"{self.path.name}: document {doc} holds id {int(arr[at])}, outside {allowed}")
            data = np.ascontiguousarray(arr, dtype=self.dtype)
            self._file.write(memoryview(data).cast("B"))
            self._hasher.update(memoryview(data).cast("B"))
            self._max = max(self._max, high)
        if stops.size:
            self._record(self.n_tokens + stops.astype(np.uint64))
        self.n_tokens += int(arr.size)

    def _record(self, offsets: np.ndarray) -> None:
        """Keep document end offsets: in the buffer, spilled to the side file when full."""
        if self._buffered + offsets.size > self._buffer.size:
            self._spill(self._buffer[:self._buffered])
            self._buffered = 0
        if offsets.size > self._buffer.size:
            self._spill(offsets)
        else:
            self._buffer[self._buffered:self._buffered + offsets.size] = offsets
            self._buffered += offsets.size
        self.n_docs += int(offsets.size)
        self._last_end = int(offsets[-1])

    def _spill(self, offsets: np.ndarray) -> None:
        if self._side is None:
            self._side = self._side_path.open("xb+")
        self._side.write(np.ascontiguousarray(offsets, dtype="<u8").tobytes())

    def _put_offsets(self, data: bytes | memoryview) -> None:
        self._file.write(data)
        self._hasher.update(data)

    def close(self) -> Path:
        """Finish the file (the open document, if any, ends here): offsets, header with
        checksum, ``fsync``, rename to `path`. Returns `path`."""
        if self._closed:
            return self.path
        try:
            if self.n_tokens != self._last_end:
                self._record(np.asarray([self.n_tokens], dtype=np.uint64))
            self._put_offsets(bytes(8))  # the first offset: 0
            if self._side is not None:
                self._side.seek(0)
                while block := self._side.read(8 * _OFFSET_BUFFER):
                    self._put_offsets(block)
            self._put_offsets(memoryview(self._buffer[:self._buffered]).cast("B"))
            vocab = self.vocab_size if self.vocab_size is not None else self._max + 1
            head = _HEADER.pack(MAGIC, VERSION, self.dtype.itemsize, self.n_tokens, self.n_docs, vocab, _XXH3_64,
                                0, 0, 0)
            self._hasher.update(head[:_HASHED_HEADER])
            self._file.seek(0)
            self._file.write(head[:_HASHED_HEADER] + struct.pack("<QQ", self._hasher.intdigest(), 0))
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise
        self._closed = True
        self._drop_side()
        fsync_dir(self.path.parent)
        return self.path

    def abort(self) -> None:
        """Give the file up: the temporary files are removed, `path` is left as it was."""
        self._closed = True
        if not self._file.closed:
            self._file.close()
        self._tmp.unlink(missing_ok=True)
        self._drop_side()

    def _drop_side(self) -> None:
        if self._side is not None:
            self._side.close()
            self._side = None
        self._side_path.unlink(missing_ok=True)


def write_tokens(path: str | Path, documents: Iterable[Sequence[int] | np.ndarray], dtype: str = "uint16",
                 vocab_size: int | None = None) -> Path:
    """Write `documents` (token id sequences) as one token file with `TokenWriter`; returns
    its path. `dtype`: ``"uint16"`` (vocabularies up to 65,536) or ``"uint32"``.
    `vocab_size`: every id must be below it (an id that is not is refused, naming its
    document and value); None records the largest id + 1."""
    with TokenWriter(path, dtype, vocab_size) as out:
        for doc in documents:
            out.add(doc)
    return out.path


class TokenFile:
    """A token file, memory-mapped (see the module docstring).

    Args:
        path: the file.
        dtype: when given, must be the file's (``"uint16"`` or ``"uint32"``).
        vocab_size: when given, must be the one the file records (a version-1 file records
            none: nothing to compare).
        verify: read the whole file once: every token below the vocabulary size, and the
            checksum (see `verify`).
    """

    def __init__(self, path: str | Path, dtype: str | None = None, vocab_size: int | None = None,
                 verify: bool = False):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with self.path.open("rb") as f:
                head = f.read(_HEADER.size)
        except OSError as exc:
            raise TokenFileError(f"token file {self.path}: cannot be read ({exc.strerror or exc})") from exc
        if len(head) < _HEADER_V1.size or head[:8] != MAGIC:
            raise TokenFileError(f"token file {self.path}: not a token file (no {MAGIC!r} header); "
                                 "write one with dream_trainer.data.write_tokens")
        self.version = struct.unpack_from("<I", head, 8)[0]
        if self.version == 1:
            _, _, itemsize, n_tokens, n_docs = _HEADER_V1.unpack(head[:_HEADER_V1.size])
            self.header_size, vocab, algorithm, checksum = _HEADER_V1.size, None, 0, None
        elif self.version == 2:
            if len(head) < _HEADER.size:
                raise TokenFileError(f"token file {self.path}: {size} bytes, shorter than its {_HEADER.size}-byte "
                                     "header: truncated")
            _, _, itemsize, n_tokens, n_docs, vocab, algorithm, _, checksum, _ = _HEADER.unpack(head)
            self.header_size = _HEADER.size
        else:
            raise TokenFileError(f"token file {self.path}: version {self.version} ({len(head)}-byte header): only "
                                 f"versions 1 and 2 are known (a newer dream_trainer may have written it)")
        if itemsize not in _DTYPES or (self.version == 2 and (algorithm != _XXH3_64 or vocab > 1 << (8 * itemsize))):
            raise TokenFileError(f"token file {self.path}: damaged header (itemsize {itemsize}, vocabulary {vocab}, "
                                 f"checksum algorithm {algorithm}; known: 2 or 4 bytes, xxh3_64 = {_XXH3_64})")
        self.dtype = _DTYPES[itemsize]
        self.vocab_size: int | None = vocab
        self.checksum: int | None = checksum
        self._head = head[:self.header_size]
        name = {2: "uint16", 4: "uint32"}[itemsize]
        if dtype is not None and dtype != name:
            raise TokenFileError(f"token file {self.path} holds {name} tokens, but dtype={dtype!r} was asked for")
        expected = self.header_size + n_tokens * itemsize + (n_docs + 1) * 8
        if size != expected:
            raise TokenFileError(f"token file {self.path}: {size} bytes, but its header describes {expected} "
                                 f"({n_tokens} tokens, {n_docs} documents): {'truncated' if size < expected else 'trailing bytes'}")
        if vocab_size is not None and vocab is not None and int(vocab_size) != vocab:
            raise TokenFileError(f"token file {self.path} was written for a vocabulary of {vocab}, but "
                                 f"vocab_size={vocab_size} was asked for")
        self.tokens = (np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.header_size, shape=(n_tokens,))
                       if n_tokens else np.empty(0, dtype=self.dtype))
        at = self.header_size + n_tokens * itemsize
        if not _offsets_rise(self.path, at, n_docs + 1, n_tokens):
            raise TokenFileError(f"token file {self.path}: damaged document offsets (they must rise from 0 to {n_tokens})")
        self.offsets = np.memmap(self.path, dtype="<u8", mode="r", offset=at, shape=(n_docs + 1,))
        if verify:
            self.verify()

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def n_docs(self) -> int:
        return int(self.offsets.shape[0] - 1)

    def fingerprint(self) -> dict[str, Any]:
        """What identifies the data, read from the header (nothing is hashed now): a plain
        dict ``{"version", "n_tokens", "n_docs", "vocab_size", "checksum"}`` to record with a
        data position (`GlobalOrder(fingerprint=...)`). A version-1 file has no vocabulary
        size or checksum (None): only its sizes identify it."""
        checksum = None if self.checksum is None else f"xxh3_64:{self.checksum:016x}"
        return {"version": self.version, "n_tokens": self.n_tokens, "n_docs": self.n_docs,
                "vocab_size": self.vocab_size, "checksum": checksum}

    def verify(self) -> None:
        """Read the file once (a few MB at a time): every token must be below the vocabulary
        size (the first that is not is named, with its offset) and the checksum must match
        the header's. Raises `TokenFileError`; a version-1 file cannot be verified (it
        records neither) and is refused."""
        for _ in self.read_chunks(verify=True):
            pass

    def read_chunks(self, verify: bool = True) -> Iterator[tuple[int, np.ndarray]]:
        """The tokens read from disk (not through the memory map, so memory stays a few MB)
        as ``(offset, tokens)`` chunks in order; a chunk's array is reused for the next one
        (copy what you keep). With `verify` (see `verify`), each chunk is checked as it is
        read and the checksum once the last one was read."""
        if verify and self.version == 1:
            raise TokenFileError(f"token file {self.path}: version 1 records no checksum and no vocabulary size, so "
                                 "it cannot be verified beyond its sizes and offsets (checked when it is opened); "
                                 "write it again (write_tokens, or python -m dream_trainer.data.prepare) to get both")
        hasher, buffer, vocab = _xxh3() if verify else None, np.empty(_CHUNK, dtype=self.dtype), self.vocab_size
        with self.path.open("rb") as f:
            f.seek(self.header_size)
            for start in range(0, self.n_tokens, _CHUNK):
                chunk = buffer[:min(_CHUNK, self.n_tokens - start)]
                if f.readinto(memoryview(chunk).cast("B")) != chunk.nbytes:
                    raise TokenFileError(f"token file {self.path}: ends before its token {start + chunk.size}: "
                                         "truncated")
                if hasher is not None and vocab is not None:
                    hasher.update(memoryview(chunk).cast("B"))
                    if int(chunk.max()) >= vocab:
                        at = int(np.argmax(chunk >= vocab))
                        raise TokenFileError(f"token file {self.path}: token {start + at} is {int(chunk[at])}, not "
                                             f"below the vocabulary size {vocab} its header records: the file is "
                                             "damaged")
                yield start, chunk
            while hasher is not None and (block := f.read(8 * _OFFSET_BUFFER)):
                hasher.update(block)
        if hasher is not None:
            hasher.update(self._head[:_HASHED_HEADER])
            if hasher.intdigest() != self.checksum:
                raise TokenFileError(f"token file {self.path}: checksum mismatch: its contents hash to "
                                     f"{hasher.intdigest():016x} (xxh3_64), its header records {self.checksum:016x}: "
                                     "the file is damaged or was changed after it was written")

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


def _offsets_rise(path: Path, at: int, count: int, n_tokens: int) -> bool:
    """Whether the `count` offsets at byte `at` rise from 0 to `n_tokens` (read a few MB at a
    time: memory does not grow with the number of documents)."""
    last = 0
    with path.open("rb") as f:
        f.seek(at)
        for start in range(0, count, _OFFSET_BUFFER):
            block = np.fromfile(f, dtype="<u8", count=min(_OFFSET_BUFFER, count - start))
            if (start == 0 and block[0] != 0) or block[0] < last or np.any(block[1:] < block[:-1]):
                return False
            last = block[-1]
    return bool(last == n_tokens)


def _check_mode(mode: str) -> None:
    if mode not in ("windows", "documents"):
        raise ValueError(f"mode={mode!r}: use 'windows' or 'documents'")

"""Turn a text corpus into a token file (`dream_trainer.data.tokens`), streaming, in parallel.

    python -m dream_trainer.data.prepare corpus.txt corpus.tokens                  # bytes
    python -m dream_trainer.data.prepare corpus.txt corpus.tokens --tokenizer tokenizer.json
    python -m dream_trainer.data.prepare corpus.txt corpus.tokens --workers 8      # 8 shards, merged
    python -m dream_trainer.data.prepare --verify corpus.tokens                    # or corpus.index.json

Documents are separated by blank lines (``--split lines``: one per line). The default
tokenizer is byte-level: a document's UTF-8 bytes are its tokens (ids 0-255, vocabulary 256).
``--tokenizer PATH`` loads a Hugging Face ``tokenizer.json`` from a local file with the
``tokenizers`` package (nothing is downloaded); the token dtype is ``uint16`` when the
vocabulary fits, else ``uint32``. An end-of-document id (``--eos``) can be appended to each.
The file records the vocabulary (the tokenizer's, or ``eos + 1`` if larger) and a checksum.

**Streaming.** The text is read a megabyte at a time and cut into documents on the way; the
tokens go straight to disk. Memory stays bounded whatever the corpus size (it follows the
largest document, which is tokenized whole).

**Shards and workers.** ``--shards N`` (default: ``--workers``) cuts the text at document
boundaries into N byte ranges of about equal size; ``--workers W`` processes tokenize them in
parallel, each range into its own token file ``corpus-00000-of-0000N.tokens`` beside the
output, and an index ``corpus.index.json`` records the plan (source size and time, tokenizer,
options, ranges) and each finished shard's fingerprint. The shards are then merged, in order,
into ``corpus.tokens`` (the same tokens and documents as one worker writes; each shard's
checksum is checked as it is read); ``--no-merge`` keeps only the shards and the index. With
one shard, the output is written directly, without shards or index.

**Resuming.** Every file is written under a temporary name and renamed when complete. A rerun
with the same plan skips every shard that is complete and passes verification, and redoes the
rest; a changed source or option redoes all.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import multiprocessing
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from dream_trainer.data.tokens import TokenFile, TokenFileError, TokenWriter

__all__ = ["documents", "iter_documents", "load_tokenizer", "main", "merge_shards", "prepare", "prepare_shards",
           "verify"]

INDEX_FORMAT = "dream_trainer.token_shards"
_READ = 1 << 20  # characters of text (bytes when looking for a boundary) read at a time
_FLUSH = 1 << 20  # tokens a worker gathers before it writes them
_LINE_BREAK = re.compile("[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")  # what str.splitlines splits on
Log = Callable[[str], None]


def _check_split(split: str) -> None:
    if split not in ("paragraphs", "lines"):
        raise ValueError(f"split={split!r}: use 'paragraphs' or 'lines'")


def _kept(parts: Iterable[str]) -> Iterator[str]:
    return (part.strip("\n") for part in parts if part.strip())


def documents(text: str, split: str = "paragraphs") -> Iterator[str]:
    """The non-empty documents of `text`: separated by blank lines, or one per line."""
    _check_split(split)
    return _kept(text.split("\n\n") if split == "paragraphs" else text.splitlines())


class _ByteRange(io.RawIOBase):
    """Bytes ``start..end - 1`` of an open binary file, as a readable stream."""

    def __init__(self, raw: Any, start: int, end: int):
        raw.seek(start)
        self._raw, self._left = raw, max(end - start, 0)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = self._raw.readinto(memoryview(buffer)[:min(len(buffer), self._left)]) if self._left else 0
        self._left -= n
        return n


def iter_documents(source: str | Path, split: str = "paragraphs", start: int = 0, end: int | None = None,
                   read_chars: int = _READ) -> Iterator[str]:
    """The documents of bytes ``start..end - 1`` of the UTF-8 text file `source`, read
    `read_chars` characters at a time: what `documents` gives for that text (universal
    newlines, as ``Path.read_text``), holding at most one document and one read in memory."""
    _check_split(split)
    with open(source, "rb") as raw:
        end = os.fstat(raw.fileno()).st_size if end is None else end
        text = io.TextIOWrapper(io.BufferedReader(_ByteRange(raw, start, end), _READ), encoding="utf-8", newline=None)
        rest = ""
        try:
            while chunk := text.read(read_chars):
                searched, rest = max(len(rest) - 1, 0), rest + chunk
                if split == "paragraphs":
                    cut = rest.rfind("\n\n", searched)
                    if cut >= 0:
                        parts, rest = rest[:cut].split("\n\n"), rest[cut + 2:]
                        yield from _kept(parts)
                elif _LINE_BREAK.search(chunk):
                    lines = rest.splitlines(keepends=True)
                    rest = lines.pop() if lines[-1].splitlines() == [lines[-1]] else ""
                    yield from _kept(line.splitlines()[0] for line in lines)
            yield from documents(rest, split)
        except UnicodeDecodeError as exc:
            raise ValueError(f"{source}: not UTF-8 text (in bytes {start}..{end}: {exc.reason})") from None


def load_tokenizer(spec: str) -> tuple[Callable[[str], Any], int]:
    """``(encode, vocabulary size)`` for ``"bytes"`` or a local ``tokenizer.json``; `encode`
    returns a document's ids (a sequence of ints: a ``uint8`` array for bytes)."""
    if spec == "bytes":
        return (lambda doc: np.frombuffer(doc.encode("utf-8"), dtype=np.uint8)), 256
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--tokenizer {spec!r}: use 'bytes' or the path of a local tokenizer.json (no such file)")
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise ImportError(f"--tokenizer {spec}: reading a tokenizer.json needs the tokenizers package "
                          "(pip install tokenizers), or use --tokenizer bytes") from exc
    tokenizer = Tokenizer.from_file(str(path))
    return (lambda doc: tokenizer.encode(doc).ids), tokenizer.get_vocab_size()


# ---------------------------------------------------------------------------------- the plan
def _shard_paths(output: Path, n: int) -> tuple[list[Path], Path]:
    suffix, stem = output.suffix, output.name[:len(output.name) - len(output.suffix)]
    shards = [output.with_name(f"{stem}-{i:05d}-of-{n:05d}{suffix}") for i in range(n)]
    return shards, output.with_name(f"{stem}.index.json")


def _next_boundary(f: Any, at: int, size: int, pattern: re.Pattern[bytes]) -> int:
    """The first byte position at or after `at` that follows a document separator (a blank
    line, or a line end), else `size`."""
    f.seek(at)
    pos, tail = at, b""
    while block := f.read(_READ):
        found = pattern.search(tail + block)
        if found:
            return pos - len(tail) + found.end()
        tail, pos = (tail + block)[-2:], pos + len(block)
    return size


def _ranges(source: Path, shards: int, split: str) -> list[tuple[int, int]]:
    """Byte ranges of about ``size / shards`` bytes, cut after document separators (a range
    may hold no separator: fewer ranges then)."""
    size, pattern = source.stat().st_size, re.compile(rb"\n\r?\n" if split == "paragraphs" else rb"\n")
    cuts = [0]
    with source.open("rb") as f:
        for i in range(1, shards):
            cuts.append(_next_boundary(f, max(i * size // shards, cuts[-1]), size, pattern))
    cuts = sorted(set(cuts + [size]))
    return list(zip(cuts[:-1], cuts[1:])) or [(0, 0)]


def _plan(source: Path, tokenizer: str, split: str, eos: int | None, shards: int) -> dict[str, Any]:
    _check_split(split)
    _, vocab = load_tokenizer(tokenizer)
    if eos is not None and not 0 <= eos < 2**32:
        raise ValueError(f"--eos {eos}: a token id is between 0 and 2**32 - 1")
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards={shards!r}: expected an int >= 1")
    vocab = max(vocab, (eos if eos is not None else -1) + 1)
    stat = source.stat()
    digest = None if tokenizer == "bytes" else hashlib.sha256(Path(tokenizer).read_bytes()).hexdigest()
    return {"format": INDEX_FORMAT, "version": 1,
            "source": {"path": str(source.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns},
            "tokenizer": tokenizer, "tokenizer_sha256": digest, "split": split, "eos": eos,
            "dtype": "uint16" if vocab <= 2**16 else "uint32", "vocab_size": vocab,
            "ranges": [list(r) for r in _ranges(source, shards, split)]}


# ------------------------------------------------------------------------------- the workers
_RUNNING: list[str] = []  # the file the task a pool worker runs writes


def _on_terminate(*_: Any) -> None:
    for path in _RUNNING:  # a terminated worker removes its temporary files, then exits at once
        for tmp in TokenWriter.temporary_files(path):
            tmp.unlink(missing_ok=True)
    os._exit(1)


def _worker_init() -> None:
    signal.signal(signal.SIGTERM, _on_terminate)


def _tokenize(job: dict[str, Any]) -> dict[str, Any]:
    """Write one byte range of the source as one token file; its counts and time."""
    encode, _ = load_tokenizer(job["tokenizer"])
    eos = None if job["eos"] is None else np.asarray([job["eos"]], dtype=np.int64)
    began, pieces, lengths, pending = time.perf_counter(), [], [], 0
    _RUNNING.append(job["path"])
    try:
        with TokenWriter(job["path"], job["dtype"], job["vocab_size"]) as out:
            for doc in iter_documents(job["source"], job["split"], job["start"], job["end"]):
                ids = np.asarray(encode(doc))
                pieces += [ids] if eos is None else [ids, eos]
                lengths.append(ids.size + (eos is not None))
                pending += lengths[-1]
                if pending >= _FLUSH:
                    out.write(np.concatenate(pieces), np.cumsum(lengths))
                    pieces, lengths, pending = [], [], 0
            if pieces:
                out.write(np.concatenate(pieces), np.cumsum(lengths))
    finally:
        _RUNNING.remove(job["path"])
    return {"shard": job["shard"], "n_tokens": out.n_tokens, "n_docs": out.n_docs,
            "seconds": time.perf_counter() - began}


def _rate(result: dict[str, Any]) -> str:
    seconds = max(result["seconds"], 1e-9)
    return (f"{result['n_tokens']:,} tokens, {result['n_docs']:,} documents in {seconds:.2f} s "
            f"({result['n_tokens'] / seconds:,.0f} tokens/s)")


def _read_index(path: Path) -> dict[str, Any] | None:
    """An index as JSON (data only), or None when there is none or it is not an index."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == INDEX_FORMAT else None


def _write_index(path: Path, index: dict[str, Any]) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            json.dump(index, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _complete(path: Path, plan: dict[str, Any], recorded: dict[str, Any] | None) -> dict[str, Any] | None:
    """A shard's fingerprint when the file is there, of the plan's dtype and vocabulary,
    passes verification and matches what the index recorded; else None."""
    try:
        tf = TokenFile(path, dtype=plan["dtype"], vocab_size=plan["vocab_size"], verify=True)
    except (TokenFileError, ImportError):
        return None
    found = tf.fingerprint()
    return found if recorded is None or recorded == found else None


def prepare_shards(source: str | Path, output: str | Path, tokenizer: str = "bytes", split: str = "paragraphs",
                   eos: int | None = None, *, workers: int = 1, shards: int | None = None,
                   start_method: str | None = None, log: Log | None = None) -> Path:
    """Tokenize `source` into shards beside `output` and their index (see the module
    docstring); shards already complete (and verified) for the same plan are kept. Returns
    the index's path. `start_method`: the workers' (default: fork where there is one)."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers={workers!r}: expected an int >= 1")
    source, output, say = Path(source), Path(output), log or (lambda _: None)
    plan = _plan(source, tokenizer, split, eos, workers if shards is None else shards)
    paths, index_path = _shard_paths(output, len(plan["ranges"]))
    old = _read_index(index_path)
    same = (old is not None and {k: v for k, v in old.items() if k in plan} == plan
            and isinstance(old.get("shards"), list) and len(old["shards"]) == len(paths))
    if old is not None and not same:
        say(f"{index_path.name}: of another source or options: every shard is written again")
    shards_state = old["shards"] if same else [{"path": p.name, "fingerprint": None} for p in paths]
    index = {**plan, "shards": shards_state, "complete": False, "n_tokens": None, "n_docs": None, "merged": None}
    jobs = []
    for i, (path, (start, end)) in enumerate(zip(paths, plan["ranges"])):
        done = _complete(path, plan, shards_state[i]["fingerprint"]) if same and path.exists() else None
        shards_state[i]["fingerprint"] = done
        if done is not None:
            say(f"shard {i + 1}/{len(paths)} {path.name}: already complete (verified), kept")
        else:
            jobs.append({"shard": i, "path": str(path), "source": str(source), "start": start, "end": end,
                         "tokenizer": tokenizer, "split": split, "eos": eos, "dtype": plan["dtype"],
                         "vocab_size": plan["vocab_size"]})
    _write_index(index_path, index)
    began, procs = time.perf_counter(), min(workers, len(jobs))
    if procs <= 1:
        results: Iterable[dict[str, Any]] = map(_tokenize, jobs)
    else:
        method = start_method or ("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
        pool = multiprocessing.get_context(method).Pool(procs, initializer=_worker_init)
        results = pool.imap_unordered(_tokenize, jobs)
    finished = False
    try:
        for result in results:
            i = result["shard"]
            shards_state[i]["fingerprint"] = TokenFile(paths[i]).fingerprint()
            _write_index(index_path, index)
            say(f"shard {i + 1}/{len(paths)} {paths[i].name}: {_rate(result)}")
        finished = True
    finally:
        if procs > 1:  # on an error, the workers still running stop (and remove their temporary files)
            pool.close() if finished else pool.terminate()
            pool.join()
    fingerprints = [s["fingerprint"] for s in shards_state]
    index.update(complete=True, n_tokens=sum(f["n_tokens"] for f in fingerprints),
                 n_docs=sum(f["n_docs"] for f in fingerprints))
    _write_index(index_path, index)
    if jobs:
        wall = max(time.perf_counter() - began, 1e-9)
        written = sum(fingerprints[job["shard"]]["n_tokens"] for job in jobs)
        say(f"{len(jobs)} shard(s) by {max(procs, 1)} worker(s) in {wall:.2f} s: {written / wall:,.0f} tokens/s "
            f"({written / wall / max(procs, 1):,.0f} per worker)")
    return index_path


def _copy_shard(tf: TokenFile, out: TokenWriter) -> None:
    """Append a shard's documents to `out`: its tokens (verified on the way) and its document
    ends, each read a block at a time, so memory does not grow with the shard."""
    with tf.path.open("rb") as f:
        f.seek(tf.header_size + tf.n_tokens * tf.dtype.itemsize + 8)  # the ends: the offsets after the first
        left, ends = tf.n_docs, np.empty(0, dtype=np.int64)

        def ends_upto(stop: int) -> np.ndarray:  # the next ends at or before `stop` (a block at most)
            nonlocal left, ends
            if not ends.size and left:
                ends = np.fromfile(f, dtype="<u8", count=min(left, _READ)).astype(np.int64)
                left -= ends.size
            k = int(np.searchsorted(ends, stop, side="right"))
            found, ends = ends[:k], ends[k:]
            return found

        for start, chunk in tf.read_chunks(verify=True):
            written = 0
            while (found := ends_upto(start + chunk.size)).size:
                out.write(chunk[written:int(found[-1]) - start], found - start - written)
                written = int(found[-1]) - start
            out.write(chunk[written:])  # the open document goes on in the next chunk
        while (found := ends_upto(tf.n_tokens)).size:  # a shard without tokens: only empty documents
            out.write(np.empty(0, dtype=tf.dtype), found - tf.n_tokens)


def merge_shards(index: str | Path, output: str | Path) -> TokenFile:
    """Concatenate the shards of a complete index, in order, into one token file (each shard's
    checksum checked as it is read; memory: a few MB); returns it, opened. The index records it."""
    index_path = Path(index)
    data = _read_index(index_path)
    if data is None or not data.get("complete"):
        raise ValueError(f"{index_path}: not a complete shard index (prepare the shards first)")
    with TokenWriter(output, data["dtype"], data["vocab_size"]) as out:
        for shard in data["shards"]:
            _copy_shard(TokenFile(index_path.with_name(shard["path"]), dtype=data["dtype"],
                                  vocab_size=data["vocab_size"]), out)
    merged = TokenFile(output)
    data["merged"] = {"path": os.path.relpath(merged.path, index_path.parent), "fingerprint": merged.fingerprint()}
    _write_index(index_path, data)
    return merged


def prepare(source: str | Path, output: str | Path, tokenizer: str = "bytes", split: str = "paragraphs",
            eos: int | None = None, *, workers: int = 1, shards: int | None = None,
            log: Log | None = None) -> TokenFile:
    """Tokenize the text file `source` into the token file `output`; returns it, opened.
    With more than one shard (`shards`, default `workers`), through shards and an index
    (`prepare_shards`, which resumes), then merged (`merge_shards`)."""
    n_shards = workers if shards is None else shards
    if n_shards != 1:
        return merge_shards(prepare_shards(source, output, tokenizer, split, eos, workers=workers, shards=n_shards,
                                           log=log), output)
    plan = _plan(Path(source), tokenizer, split, eos, 1)
    result = _tokenize({"shard": 0, "path": str(output), "source": str(source), "start": 0, "end": None,
                        "tokenizer": tokenizer, "split": split, "eos": eos, "dtype": plan["dtype"],
                        "vocab_size": plan["vocab_size"]})
    if log:
        log(f"1 worker: {_rate(result)}")
    return TokenFile(output, dtype=plan["dtype"])


def verify(path: str | Path) -> str:
    """Verify a token file, or a shard index with all its shards (and the merged file it
    records): see `TokenFile.verify`. Returns a one-line summary; raises `TokenFileError`
    (or `ValueError` for an index that is not complete)."""
    path = Path(path)
    index = _read_index(path) if path.suffix == ".json" else None
    if index is None:
        tf = TokenFile(path, verify=True)
        return f"{tf.path}: verified: {tf.n_tokens:,} tokens in {tf.n_docs:,} documents, vocabulary {tf.vocab_size}"
    files = [(s["path"], s["fingerprint"]) for s in index["shards"]]
    if index.get("merged"):
        files.append((index["merged"]["path"], index["merged"]["fingerprint"]))
    for name, recorded in files:
        if recorded is None:
            raise ValueError(f"{path}: shard {name} is not complete yet: run prepare again to finish it")
        tf = TokenFile(path.parent / name, verify=True)
        if tf.fingerprint() != recorded:
            raise TokenFileError(f"{tf.path}: its fingerprint {tf.fingerprint()} is not the one {path.name} "
                                 f"records ({recorded}): replaced after the index was written")
    return f"{path}: verified: {len(files)} files, {index['n_tokens']:,} tokens in {index['n_docs']:,} documents"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dream_trainer.data.prepare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", nargs="?", help="a UTF-8 text file")
    p.add_argument("output", nargs="?", help="the token file to write")
    p.add_argument("--tokenizer", default="bytes", help="'bytes' (default) or a local tokenizer.json")
    p.add_argument("--split", choices=["paragraphs", "lines"], default="paragraphs")
    p.add_argument("--eos", type=int, default=None, help="an id appended to every document")
    p.add_argument("--workers", type=int, default=1, help="processes tokenizing shards in parallel (default 1)")
    p.add_argument("--shards", type=int, default=None, help="byte ranges written as shards (default: --workers)")
    p.add_argument("--no-merge", action="store_true", help="keep the shards and the index; no single output file")
    p.add_argument("--verify", metavar="FILE", help="verify a token file or a shard index (and its shards), then exit")
    args = p.parse_args(argv)
    if args.verify is not None:
        if args.source or args.output:
            p.error("--verify FILE takes no source or output")
        try:
            print(verify(args.verify))
        except (OSError, ValueError, ImportError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return 0
    if not (args.source and args.output):
        p.error("give a source and an output (or --verify FILE)")
    try:
        if args.no_merge:
            index = prepare_shards(args.source, args.output, args.tokenizer, args.split, args.eos,
                                   workers=args.workers, shards=args.shards, log=print)
            print(f"{index}: the shard index (not merged)")
            return 0
        tokens = prepare(args.source, args.output, args.tokenizer, args.split, args.eos, workers=args.workers,
                         shards=args.shards, log=print)
    except (OSError, ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{tokens.path}: {tokens.n_tokens} tokens ({tokens.dtype.name}, vocabulary {tokens.vocab_size}) in "
          f"{tokens.n_docs} documents")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

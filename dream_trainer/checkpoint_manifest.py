"""Checksums of a checkpoint's files: the manifest written before the commit, its
verification, and ``python -m dream_trainer.checkpoint verify DIR``.

A save records, in ``manifest.json`` inside the staging directory and before the rename that
commits it (`dream_trainer.checkpoint.commit`), every file of the checkpoint with its size and
its CRC-32 (``zlib.crc32``, streamed in 4 MiB chunks). Each rank hashes the files it wrote
itself, in DCP's write step (`manifest_writer`: in the background thread of an async save),
and leaves them in a small part file; the committing rank merges the parts, adds
``.metadata`` and ``dream_trainer.json``, and fsyncs the manifest. CRC-32 is there to catch
accidental damage (a flipped bit, a torn or truncated write, a file of another save), not
tampering: it runs at about 3 GB/s per core where BLAKE2b runs at 0.8 (it is not the cost of
the save), and releases the GIL, so ranks and the training thread hash in parallel.

`verify_checkpoint` checks one checkpoint; ranks share the work (each hashes a part of the
files, `checksum_share`) and agree on the verdict (`dream_trainer.checkpoint_resume`).
Checkpoints written before manifests existed are checked for structure only (``.metadata``
readable, every file it names present and long enough).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import sys
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from dream_trainer.durable import fsync_dir

logger = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
PART_PREFIX = ".manifest-part-"
ALGORITHM = "crc32"
VERIFY_MODES = ("all", "sampled", "off")
SAMPLE_ONE_IN = 8
"""``verify="sampled"``: the checksums of one data file in 8 (at least one), besides every
file's size and the checksums of ``.metadata`` and ``dream_trainer.json``."""
REFUSED = ".metadata: refused: "
"""How a finding about a ``.metadata`` asking to run code begins (`unsafe`)."""
_CHUNK = 4 << 20
_META_FILES = (".metadata", "dream_trainer.json")
_STEP = re.compile(r"^step_(\d+)$")

VerifyMode = Literal["all", "sampled", "off"]


def crc32_file(path: Path) -> str:
    """The CRC-32 of the file at `path` (8 hex digits), read in chunks."""
    crc = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def file_entry(path: Path) -> dict[str, Any]:
    """A manifest entry: the file's size and CRC-32."""
    return {"size": path.stat().st_size, ALGORITHM: crc32_file(path)}


def _write_json(path: Path, value: Any, sync: bool) -> None:
    with open(path, "w") as handle:
        json.dump(value, handle, sort_keys=True)
        if sync:
            handle.flush()
            os.fsync(handle.fileno())


def write_part(directory: Path, names: Sequence[str]) -> Path:
    """Hash the files `names` (this rank wrote them into `directory`) into a part file that
    `write_manifest` merges; named after the first file, so a retried save replaces it."""
    part = directory / f"{PART_PREFIX}{names[0]}.json"
    _write_json(part, {name: file_entry(directory / name) for name in names}, sync=False)
    return part


_WRITER: list[type] = []


def manifest_writer(path: str | os.PathLike[str]) -> Any:
    """DCP's ``FileSystemWriter`` for `path` whose ``write_data`` (each rank, after writing
    its files: in the writer thread of an async save) hashes the files it wrote with
    `write_part`, before DCP's last collective, so the committing rank finds every part."""
    if not _WRITER:
        from torch.distributed.checkpoint import FileSystemWriter

        class ManifestWriter(FileSystemWriter):  # type: ignore[misc]
            """`FileSystemWriter` leaving the checksums of each rank's files beside them."""

            def write_data(self, plan: Any, planner: Any) -> Any:
                future = super().write_data(plan, planner)
                names = sorted({result.storage_data.relative_path for result in future.wait()})
                if names:
                    write_part(Path(self.path), names)
                return future

        _WRITER.append(ManifestWriter)
    return _WRITER[0](str(path))


def write_manifest(directory: Path) -> dict[str, Any]:
    """Write ``manifest.json`` into a finished staging `directory` (fsynced): the entries of
    the ranks' part files, and a fresh entry for every other file (``.metadata``,
    ``dream_trainer.json``, files a plain DCP writer left); the parts are removed."""
    files: dict[str, Any] = {}
    parts = sorted(directory.glob(f"{PART_PREFIX}*.json"))
    for part in parts:
        files.update(json.loads(part.read_text()))
    for path in sorted(directory.iterdir()):
        if path.is_file() and path.name not in files and path.name != MANIFEST_FILE and path not in parts:
            files[path.name] = file_entry(path)
    manifest = {"format": 1, "algorithm": ALGORITHM, "files": files}
    _write_json(directory / MANIFEST_FILE, manifest, sync=True)
    for part in parts:
        part.unlink()
    fsync_dir(directory)  # the new entries are durable before the rename that commits them
    return manifest


def read_manifest(path: Path) -> dict[str, dict[str, Any]] | None:
    """The files the manifest of the checkpoint at `path` lists (name: entry), or None when
    it has none. Raises ValueError naming what is wrong with a damaged one."""
    file = path / MANIFEST_FILE
    if not file.is_file():
        return None
    try:
        manifest = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(manifest, dict) or manifest.get("algorithm") != ALGORITHM:
        raise ValueError(f"not a manifest of this dream_trainer (algorithm must be {ALGORITHM!r})")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(name, str) and "/" not in name and isinstance(entry, dict) and type(entry.get("size")) is int
        and isinstance(entry.get(ALGORITHM), str) for name, entry in files.items()
    ):
        raise ValueError("damaged: its file entries are not {name: {size, crc32}}")
    return files


def checksum_share(names: Iterable[str], mode: str, rank: int, world_size: int, seed: int) -> set[str]:
    """The files whose checksums `rank` of `world_size` checks: with ``"all"`` every file,
    with ``"sampled"`` the metadata files and one data file in `SAMPLE_ONE_IN` (at least one,
    chosen by a generator seeded with `seed`: the same on every rank), dealt out in turn."""
    ordered = sorted(names)
    if mode == "sampled":
        data = [name for name in ordered if name not in _META_FILES]
        picked = random.Random(seed).sample(data, min(len(data), max(1, math.ceil(len(data) / SAMPLE_ONE_IN))))
        ordered = sorted(set(picked) | {name for name in ordered if name in _META_FILES})
    return {name for index, name in enumerate(ordered) if index % world_size == rank}


def _step_of(path: Path) -> int:
    found = _STEP.match(path.name)
    return int(found.group(1)) if found else 0


def _check_files(path: Path, files: dict[str, dict[str, Any]], share: set[str]) -> list[str]:
    problems = []
    for name, entry in sorted(files.items()):
        file = path / name
        if not file.is_file():
            problems.append(f"{name}: missing (the manifest lists it, {entry['size']} bytes)")
            continue
        size = file.stat().st_size
        if size != entry["size"]:
            what = "truncated" if size < entry["size"] else "longer than written"
            problems.append(f"{name}: {what}: {size} bytes, the manifest says {entry['size']}")
        elif name in share and (found := crc32_file(file)) != entry[ALGORITHM]:
            problems.append(f"{name}: bytes changed: {ALGORITHM} {found}, the manifest says {entry[ALGORITHM]}")
    return problems


def _check_metadata(path: Path, files: dict[str, Any] | None) -> list[str]:
    """``.metadata`` readable (restricted: one asking to run code is `REFUSED`), and every
    file it names present, long enough and, with a manifest, listed in it."""
    from dream_trainer.serialization import UnsafeStateError, safe_reader

    try:
        metadata = safe_reader(str(path)).read_metadata()
    except UnsafeStateError as exc:
        return [f"{REFUSED}{exc}"]
    except Exception as exc:  # noqa: BLE001 - any other failure means a damaged file
        return [f".metadata: unreadable ({type(exc).__name__}: {exc})"]
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, end in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            problems.append(f"{name}: missing (.metadata reads {end} bytes from it)")
        elif file.stat().st_size < end:
            problems.append(f"{name}: truncated: {file.stat().st_size} bytes, .metadata reads up to byte {end}")
        elif files is not None and name not in files:
            problems.append(f"{name}: not in {MANIFEST_FILE} (a file of another save?)")
    return problems


def verify_checkpoint(path: str | os.PathLike[str], mode: str = "all", rank: int = 0, world_size: int = 1) -> list[str]:
    """What is wrong with the checkpoint at `path`, one line per finding (``"<file>: <what
    was expected and what was found>"``; empty: intact, as far as `mode` looks). Every rank
    checks the metadata and every file's size; `rank` of `world_size` checks the checksums of
    its `checksum_share` only, so ranks verify a checkpoint in parallel. A ``.metadata``
    asking to run code is a `REFUSED` line (nothing is run; see `unsafe`)."""
    if mode not in VERIFY_MODES:
        raise ValueError(f"verify={mode!r} is invalid: expected one of {', '.join(map(repr, VERIFY_MODES))}")
    path = Path(path)
    if not path.is_dir():
        return [f"{path}: not a directory"]
    if mode == "off":
        return []
    if not (path / ".metadata").is_file():
        return [".metadata: missing (the save never wrote it, or it was removed)"]
    try:
        files = read_manifest(path)
    except ValueError as exc:
        return [f"{MANIFEST_FILE}: {exc}"]
    problems = _check_metadata(path, files)
    if files is not None:
        found = _check_files(path, files, checksum_share(files, mode, rank, world_size, _step_of(path)))
        named = {line.split(":")[0] for line in found} - {".metadata"}  # the manifest's line says more
        problems = [line for line in problems if line.split(":")[0] not in named] + found
    return problems


def unsafe(problems: Iterable[str]) -> str | None:
    """The refusal among `problems` of a ``.metadata`` that asks to run code and that the
    manifest does not call damaged (so it was written so: crafted, or of a type not
    allowed): an `UnsafeStateError` to raise, not damage to skip. None: there is none."""
    problems = list(problems)
    refused = [line for line in problems if line.startswith(REFUSED)]
    damaged = any(line.startswith(f".metadata: {what}") for what in ("bytes changed", "truncated", "longer")
                  for line in problems)
    return refused[0][len(REFUSED):] if refused and not damaged else None


def has_manifest(path: str | os.PathLike[str]) -> bool:
    """Whether the checkpoint at `path` records checksums (written by this dream_trainer)."""
    return (Path(path) / MANIFEST_FILE).is_file()


_WARNED: set[Path] = set()


def warn_unverifiable(path: Path) -> None:
    """Warn once per checkpoint that it has no manifest (saved before checksums were kept)."""
    if path.resolve() not in _WARNED:
        _WARNED.add(path.resolve())
        logger.warning("checkpoint %s has no %s (saved before dream_trainer recorded checksums): its files cannot "
                       "be verified, only its structure (.metadata readable, its files present and long enough)",
                       path, MANIFEST_FILE)


_USAGE = "usage: python -m dream_trainer.checkpoint verify [--sampled] DIR   (DIR: a checkpoint or a root of several)"


def _targets(directory: Path) -> list[Path]:
    """`directory` if it is a checkpoint, else the ``step_*`` directories under it."""
    if _STEP.match(directory.name) or any((directory / name).exists() for name in (*_META_FILES, MANIFEST_FILE)):
        return [directory]
    return sorted((p for p in directory.iterdir() if p.is_dir() and _STEP.match(p.name)), key=_step_of)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m dream_trainer.checkpoint verify [--sampled] DIR``: one line per checkpoint,
    ``OK`` or ``DAMAGED`` with each damaged file. Returns 0 when all are intact, 1 when one is
    damaged, 2 on bad usage (no such directory, no checkpoint in it)."""
    args = list(sys.argv[1:] if argv is None else argv)
    mode = "sampled" if "--sampled" in args else "all"
    args = [a for a in args if a != "--sampled"]
    if len(args) != 2 or args[0] != "verify" or args[1].startswith("-"):
        print(_USAGE, file=sys.stderr)
        return 2
    directory = Path(args[1])
    if not directory.is_dir():
        print(f"{directory}: no such directory\n{_USAGE}", file=sys.stderr)
        return 2
    targets = _targets(directory)
    if not targets:
        print(f"{directory}: no checkpoint (step_*) in it\n{_USAGE}", file=sys.stderr)
        return 2
    damaged = 0
    for target in targets:
        problems = verify_checkpoint(target, mode)
        if problems:
            damaged += 1
            print(f"DAMAGED {target}")
            print("".join(f"  {problem}\n" for problem in problems), end="")
        else:
            how = f"{ALGORITHM} {mode}" if has_manifest(target) else f"no {MANIFEST_FILE}: structure only"
            print(f"OK      {target} ({how})")
    return 1 if damaged else 0

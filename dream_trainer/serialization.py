"""Restricted (de)serialization: what dream_trainer reads from disk or from a peer is data.

A pickle is a program: unpickling one calls whatever functions it names. A checkpoint
shared by a colleague, downloaded to fine-tune from, or left in an object store others
can write to must not be able to run code when a run resumes from it, and neither may a
fault-tolerance heal received from a peer. So everything dream_trainer reads back is
loaded with a restricted deserializer:

- state stored as bytes (per-rank RNG states, data position and callback states, the
  list of saved callbacks) is written with ``torch.save`` and read with
  ``torch.load(weights_only=True)``: tensors, numbers, strings, bytes, ``None``, lists,
  tuples, dicts and sets of them, ``torch.Size``/dtype/device, and the types registered
  with `allow_types` (or a callback's ``safe_types``) — never an arbitrary global;
- DCP checkpoints are read with `SafeFileSystemReader` (its ``.metadata`` file, a pickle,
  through an unpickler that resolves only DCP's own metadata classes) and
  `SafeLoadPlanner` (DCP's non-tensor values with ``weights_only=True``; DCP itself loads
  them with ``weights_only=False``), and only from files inside the checkpoint's directory
  (`confine_storage`: the metadata names the files, and DCP would follow an absolute path,
  ``..`` or a symlink out of it);
- a heal is received with ``weights_only=True`` as well (`dream_trainer.world`).

Anything else fails to load with `UnsafeStateError`, which names the global the data asked
for and how to allow it; nothing it names is called. Saving checks the same rules first
(`check_storable`), so a state that could not be resumed fails at the save, not at the
resume.
"""

from __future__ import annotations

import collections
import enum
import io
import os
import pickle
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from dream_trainer.errors import CheckpointError

__all__ = ["UnsafeStateError", "allow_types", "allowed_types", "check_storable", "dumps", "loads"]

_ALLOWED: dict[str, type] = {}  # "module.qualname" -> a type registered by allow_types
# Modules whose classes run code or touch the system when constructed: never allowed.
_REFUSED_MODULES = ("builtins", "os", "posix", "nt", "sys", "subprocess", "shutil", "socket", "importlib", "runpy",
                    "code", "codeop", "pty", "ctypes", "pickle", "marshal", "types", "functools", "operator",
                    "multiprocessing", "threading", "asyncio", "signal", "webbrowser", "tempfile", "io", "pathlib")
_LEAVES = (int, float, bool, complex, str, bytes, bytearray, type(None), torch.dtype, torch.device, torch.Size)
_CONTAINERS = (dict, list, tuple, set, collections.OrderedDict, collections.Counter)
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format; a bare pickle starts with b"\x80"


class UnsafeStateError(CheckpointError):
    """Stored state (a checkpoint, a heal) asks for a type that is not allowed, or a state
    to be saved holds one. Nothing the data names was executed."""


def _name(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


def allow_types(*types: type) -> None:
    """Allow instances of `types` in checkpoints and heals (as
    ``torch.serialization.add_safe_globals`` does, for dream_trainer's loads). Register
    only plain data classes (dataclasses, enums, named tuples): loading one constructs it
    and sets its attributes. A callback can list them in its ``safe_types`` instead."""
    for t in types:
        if not isinstance(t, type):
            raise TypeError(f"allow_types({t!r}): expected a class, got {type(t).__name__}")
        if t.__module__.split(".")[0] in _REFUSED_MODULES:
            raise ValueError(f"allow_types({_name(t)}): classes from {t.__module__!r} are never allowed in stored "
                             "state (constructing them can run code or touch the system)")
        _ALLOWED[_name(t)] = t


def allowed_types() -> tuple[type, ...]:
    """The types registered with `allow_types`."""
    return tuple(_ALLOWED.values())


@contextmanager
def allowed() -> Iterator[None]:
    """``torch.load(weights_only=True)`` inside this block accepts the registered types too."""
    with torch.serialization.safe_globals(list(_ALLOWED.values())):
        yield


def check_storable(obj: Any, what: str) -> None:
    """Raise `UnsafeStateError` when `obj` holds something a restricted load would refuse,
    naming where (``what`` and the path inside it) and how to fix it."""
    seen: set[int] = set()

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor) or type(value) in _LEAVES:
            return
        if type(value) in _CONTAINERS:
            if id(value) in seen:
                return
            seen.add(id(value))
            if isinstance(value, dict):
                for k, v in value.items():
                    walk(k, f"{path} (a key)")
                    walk(v, f"{path}[{k!r}]")
            else:
                for i, v in enumerate(value):
                    walk(v, f"{path}[{i}]")
            return
        if _name(type(value)) in _ALLOWED and _ALLOWED[_name(type(value))] is type(value):
            if id(value) in seen:
                return
            seen.add(id(value))
            if isinstance(value, enum.Enum):
                return  # a member of a registered enum: loaded by value
            fields = value._asdict() if isinstance(value, tuple) and hasattr(value, "_asdict") else \
                getattr(value, "__dict__", None)
            for k, v in (fields or {}).items():
                walk(v, f"{path}.{k}")
            return
        name = _name(type(value))
        raise UnsafeStateError(
            f"{what}{path} is a {name}, which stored state cannot hold: checkpoints and heals hold only tensors, "
            "numbers, strings, bytes, None, lists/tuples/dicts/sets of them and registered types. If it is plain data, "
            f"register it: dream_trainer.allow_types({type(value).__qualname__}) (or safe_types = "
            f"({type(value).__qualname__},) on the callback); else store its state as plain data"
        )

    walk(obj, "")


def dumps(obj: Any, what: str) -> bytes:
    """`obj` as bytes that `loads` reads back (``torch.save``'s format), after
    `check_storable`."""
    check_storable(obj, what)
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def refusal(exc: BaseException, what: str) -> CheckpointError:
    """The error for a restricted load of `what` that failed with `exc`: `UnsafeStateError`
    when the data asked for something not allowed, else a `CheckpointError` (damaged data)."""
    text = str(exc)
    found = re.search(r"GLOBAL ([\w.]+)", text)
    if found is None and not re.search(r"allowed global|[Uu]nsupported operand|[Uu]nsupported class", text):
        detail = next((line for line in text.splitlines()[1:] if line.strip()), text.splitlines()[0] if text else "")
        return CheckpointError(f"{what} is damaged or not in the expected format ({detail.strip()})")
    asked = found.group(1) if found else "a global that is not allowed"
    return UnsafeStateError(
        f"{what} asks for {asked}, which stored state may not hold (loading it could run code); it was refused "
        "and nothing it names was executed. If this is a plain data type of yours and you trust the source, "
        "register it with dream_trainer.allow_types(...) (or a callback's safe_types) and load again"
    )


def loads(data: bytes, what: str, map_location: Any = None) -> Any:
    """Read what `dumps` wrote, refusing anything but the allowed types (`UnsafeStateError`).
    Bytes in the bare-pickle form of dream_trainer before 0.2 are refused with the way to
    migrate them."""
    if not bytes(data[:4]) == _ZIP_MAGIC:
        raise UnsafeStateError(
            f"{what} is a bare pickle (written by dream_trainer before 0.2, or crafted): it is never unpickled, since "
            "that could run code. If you trust the checkpoint, convert it once: python -m dream_trainer.migrate "
            "<checkpoint> --trust"
        )
    try:
        with allowed():
            return torch.load(io.BytesIO(data), weights_only=True, map_location=map_location)
    except pickle.UnpicklingError as exc:
        raise refusal(exc, what) from None
    except (RuntimeError, EOFError, ValueError) as exc:  # not a readable archive
        raise CheckpointError(f"{what} is damaged or not in the expected format ({str(exc).splitlines()[0]})") from None


# ---------------------------------------------------------------------------- DCP
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_METADATA_GLOBALS = {
    **{(_DCP_METADATA, n): n for n in ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
                                       "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): "_StorageInfo",
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"): "_StoragePrefix",
    ("torch.distributed.checkpoint.filesystem", "SerializationFormat"): "SerializationFormat",
    ("torch", "Size"): "Size",
    ("torch.serialization", "_get_layout"): "_get_layout",  # a layout by name (a lookup)
    ("pathlib", "PosixPath"): "PosixPath", ("pathlib", "WindowsPath"): "WindowsPath",
    ("pathlib", "PurePosixPath"): "PurePosixPath", ("pathlib", "PureWindowsPath"): "PureWindowsPath",
    ("collections", "OrderedDict"): "OrderedDict",
}


class _Refused(pickle.UnpicklingError):
    """A global the restricted metadata unpickler does not resolve."""


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only DCP's metadata classes (and torch dtypes): a crafted ``.metadata``
    naming anything else is refused before anything is called."""

    def find_class(self, module: str, name: str) -> Any:
        import importlib

        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        if (module, name) in _METADATA_GLOBALS:
            return getattr(importlib.import_module(module), name)
        raise _Refused(f"GLOBAL {module}.{name} is not a DCP metadata class")


def read_dcp_metadata(stream: Any, what: str) -> Any:
    """DCP's ``.metadata`` from an open binary `stream`, restricted (`UnsafeStateError`)."""
    try:
        return _MetadataUnpickler(stream).load()
    except _Refused as exc:
        raise refusal(exc, what) from None


def confine_storage(metadata: Any, root: str | os.PathLike[str], what: str) -> None:
    """Raise `UnsafeStateError` unless every file DCP's `metadata` has its entries read from
    lies inside the checkpoint directory `root`: DCP joins each entry's ``relative_path`` to
    the directory, so an absolute path, a ``..`` out of it or a symlink out of it would make
    a crafted checkpoint read any file this process can."""
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise CheckpointError(f"{what} is damaged: it holds no storage information (storage_data)")
    base = Path(root).resolve()
    for relative in {getattr(info, "relative_path", None) for info in storage.values()}:
        if not isinstance(relative, str):
            raise CheckpointError(f"{what} is damaged: a storage path is {relative!r}, not a file name")
        try:
            target = (base / relative).resolve()  # symlinks followed; an absolute `relative` replaces `base`
        except (OSError, ValueError, RuntimeError) as exc:
            raise UnsafeStateError(f"{what} points a read at {relative!r}, which cannot be resolved inside the "
                                   f"checkpoint directory {root} ({exc}): refused") from None
        if Path(relative).is_absolute() or not target.is_relative_to(base):
            raise UnsafeStateError(
                f"{what} points a read at {relative!r}, which resolves to {target}, outside the checkpoint directory "
                f"{root}: refused "
                "(a checkpoint is read only from its own files; nothing was read)"
            )


def _reader_cls() -> type:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):  # type: ignore[misc]
        """`FileSystemReader` whose ``.metadata`` is read by a restricted unpickler, and
        which reads only files inside the checkpoint's directory (`confine_storage`)."""

        refused: CheckpointError | None = None  # why `read_metadata` refused the checkpoint, if it did

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = self._get_metadata_path(kwargs.get("rank"))
            try:
                with self.fs.create_stream(path, "rb") as stream:
                    metadata = read_dcp_metadata(stream, f"checkpoint metadata {path}")
                confine_storage(metadata, self.path, f"checkpoint metadata {path}")
            except CheckpointError as exc:
                self.refused = exc  # dcp.load logs this error and goes on to a rank-local file: kept for its caller
                raise
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            # Every rank checks the metadata DCP plans the load with, whoever read it.
            confine_storage(metadata, self.path, f"the metadata of checkpoint {self.path}")
            super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    return SafeFileSystemReader


def _planner_cls() -> type:
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafeLoadPlanner(DefaultLoadPlanner):  # type: ignore[misc]
        """`DefaultLoadPlanner` that reads non-tensor values with ``weights_only=True``."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                with allowed():
                    obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as exc:
                raise refusal(exc, f"checkpoint entry {fqn!r}") from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return SafeLoadPlanner


_CLASSES: dict[str, type] = {}


def safe_reader(path: str) -> Any:
    """A DCP storage reader for `path` that runs no code from it (see the module doc)."""
    if "reader" not in _CLASSES:
        _CLASSES["reader"] = _reader_cls()
    return _CLASSES["reader"](path)


def safe_planner() -> Any:
    """A DCP load planner that reads non-tensor values with ``weights_only=True``."""
    if "planner" not in _CLASSES:
        _CLASSES["planner"] = _planner_cls()
    return _CLASSES["planner"]()


def unsafe_cause(exc: BaseException) -> CheckpointError | None:
    """The error of a restricted load behind a DCP failure (its per-rank failures
    unwrapped): an `UnsafeStateError`, or the `CheckpointError` of a damaged value; None
    when there is none."""
    if isinstance(exc, CheckpointError):
        return exc
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for err in failures.values():
            err = err[0] if isinstance(err, tuple) else err
            if isinstance(err, CheckpointError):
                return err
    cause = exc.__cause__ or exc.__context__
    return unsafe_cause(cause) if cause is not None and cause is not exc else None

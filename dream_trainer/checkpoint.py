"""Checkpoint directories on disk: atomic commit, listing, pruning, checked loading, export.

Layout under a root directory::

    step_000000120/            a complete checkpoint (DCP files, .metadata, dream_trainer.json)
    .staging-step_000000140/   a save in progress (or one that crashed): never loaded

A save writes into the staging directory; when every rank has written (DCP's ``.metadata``
is written last, by the coordinator), rank 0 writes ``dream_trainer.json`` and the manifest
of checksums (``manifest.json``, `dream_trainer.checkpoint_manifest`) and renames the
directory to its final name. The rename is the commit: a checkpoint is either complete
or invisible; a resume verifies it before loading it (`dream_trainer.checkpoint_resume`).
``python -m dream_trainer.checkpoint verify DIR`` checks checkpoints offline.

`dream_trainer.weights_io` reads a checkpoint's model weights alone (``--init-from``,
`export_model`: a plain safetensors file loadable without dream_trainer).

Everything read back is loaded with a restricted deserializer (`dream_trainer.serialization`):
a checkpoint is data and never runs code.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from dream_trainer.checkpoint_manifest import write_manifest
from dream_trainer.durable import fsync_dir
from dream_trainer.errors import CheckpointError

logger = logging.getLogger(__name__)

META_FILE = "dream_trainer.json"
FORMAT = 2
"""The checkpoint format ``dream_trainer.json`` records: 2 stores per-rank state in the
restricted format of `dream_trainer.serialization`; checkpoints of dream_trainer 0.1 (no
``format``: pickled per-rank state) are refused on resume and converted once with
`dream_trainer.migrate`."""
STAGING_PREFIX = ".staging-"
_NAME = re.compile(r"^step_(\d+)$")
_RANK_KEYS = "ranks."  # per-rank entries: present only for the ranks that wrote them
# A callback new in this run has nothing to load; older checkpoints have no list of saved
# callbacks and no skip counters.
_OPTIONAL_KEYS = ("callbacks.", "trainer.callbacks", "trainer.skipped_", "trainer.data", "trainer.accumulation", "goodput.")


@runtime_checkable
class Checkpointer(Protocol):
    """What another plug-in may rely on from the run's checkpointing callback
    (`CheckpointCallback` is one): it saves the trainer's state and loads a checkpoint back.
    A plug-in finds it among the callbacks with ``isinstance(cb, Checkpointer)``, never by
    its class, so a user's own checkpointing serves too."""

    def save(self, blocking: bool = False) -> None: ...

    def load(self, path: str | Path) -> None: ...


def dcp_errors() -> tuple[type[BaseException], ...]:
    """What a failed DCP save or load raises (its ``CheckpointException`` is a BaseException)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def describe(exc: BaseException) -> str:
    """A one-line cause: DCP's per-rank failures unwrapped."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        errors = {rank: err[0] if isinstance(err, tuple) else err for rank, err in failures.items()}  # (exc, traceback)
        return "; ".join(f"rank {rank}: {type(err).__name__}: {err}" for rank, err in sorted(errors.items()))
    return f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint: its directory, the step and epoch it was saved at and its
    score (the monitored metric, if any)."""

    path: Path
    step: int
    epoch: int
    score: float | None = None
    monitor: str | None = None


def checkpoint_name(step: int) -> str:
    return f"step_{step:09d}"


def staging_dir(root: Path, step: int) -> Path:
    return root / f"{STAGING_PREFIX}{checkpoint_name(step)}"


def read_info(path: Path, root: Path | None = None) -> CheckpointInfo | None:
    """The checkpoint at `path`, or None when it is not a complete checkpoint. What is read
    back is checked: the directory must lie inside `root` (when given; a symlink out of it
    is refused), and ``dream_trainer.json`` must name the step of the directory's name, with
    plain values (a damaged or crafted file is skipped with a warning)."""
    match = _NAME.match(path.name)
    meta_file = path / META_FILE
    if not (match and path.is_dir() and meta_file.is_file() and (path / ".metadata").is_file()):
        return None
    if root is not None and not _inside(path, root):
        logger.warning("skipping %s: it resolves to %s, outside the checkpoint root %s", path, path.resolve(), root)
        return None
    try:
        meta = json.loads(meta_file.read_text())
        step, epoch, score, monitor = meta["step"], meta["epoch"], meta.get("score"), meta.get("monitor")
        valid = (type(step) is int and step == int(match.group(1)) and type(epoch) is int
                 and (score is None or type(score) in (int, float)) and (monitor is None or type(monitor) is str))
    except (OSError, ValueError, KeyError, TypeError):
        valid = False
    if not valid:
        logger.warning("skipping %s: its %s is damaged or does not match the directory name", path, META_FILE)
        return None
    return CheckpointInfo(path, step, epoch, None if score is None else float(score), monitor)


def _inside(path: Path, root: Path) -> bool:
    """Whether `path` (symlinks resolved) lies inside `root`."""
    return path.resolve().is_relative_to(root.resolve())


def list_checkpoints(root: str | os.PathLike[str]) -> list[CheckpointInfo]:
    """Complete checkpoints under `root`, oldest first (staging directories are skipped,
    and so is anything that resolves outside `root`)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [info for child in root.iterdir() if (info := read_info(child, root)) is not None]
    return sorted(found, key=lambda info: info.step)


def best_of(infos: list[CheckpointInfo], mode: str) -> list[CheckpointInfo]:
    """Checkpoints with a score, best first (ties: the oldest, where the value was measured)."""
    scored = [info for info in infos if info.score is not None]
    sign = 1.0 if mode == "min" else -1.0
    return sorted(scored, key=lambda info: (sign * info.score, info.step))  # type: ignore[operator]


def to_remove(infos: list[CheckpointInfo], keep_last: int | None, keep_best: int, mode: str, monitor: str | None) -> list[CheckpointInfo]:
    """Which checkpoints pruning removes: all but the newest `keep_last` and, with a
    `monitor`, the `keep_best` best. The newest is always kept."""
    if keep_last is None or not infos:
        return []
    keep = {info.path for info in infos[-max(keep_last, 1):]}
    if monitor is not None:
        keep |= {info.path for info in best_of(infos, mode)[:keep_best]}
    return [info for info in infos if info.path not in keep]


def committed_name(staging: Path) -> Path:
    """The directory a staging directory becomes when committed."""
    return staging.with_name(staging.name.removeprefix(STAGING_PREFIX))


def commit(staging: Path, meta: dict[str, Any]) -> Path:
    """Write the metadata file and the manifest of checksums (`write_manifest`, fsynced)
    into a finished staging directory and rename it to its final name (replacing an older
    checkpoint of the same step)."""
    final = committed_name(staging)
    meta_file = staging / META_FILE
    with open(meta_file, "w") as handle:
        json.dump({**meta, "format": FORMAT}, handle)
        handle.flush()
        os.fsync(handle.fileno())
    write_manifest(staging)
    if final.exists():
        shutil.rmtree(final)
    os.rename(staging, final)
    fsync_dir(final.parent)
    return final


def check_writable(root: Path, what: str) -> None:
    """Create `root` if needed and write a probe file in it; raise `CheckpointError` naming
    `what` (the setting it comes from) when that fails."""
    probe = root / f".write-probe-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise CheckpointError(
            f"{what}={str(root)!r}: checkpoints cannot be written there ({type(exc).__name__}: {exc}); "
            "choose a writable directory"
        ) from exc


class _Nodes(Protocol):
    """What `check_shared_root` needs of the world."""

    rank: int
    local_rank: int

    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...
    def all_gather_object(self, obj: Any) -> list[Any]: ...
    def barrier(self) -> None: ...


def check_shared_root(world: _Nodes, root: Path, node_rank: int) -> None:
    """Every node must see the same checkpoint root (a node-local path would leave each
    node a part of every checkpoint): rank 0 writes a marker there, the first rank of each
    node reads it back. Raises `CheckpointError` on every rank, naming the nodes that do not
    see it, before any step. A collective: every rank calls it."""
    import socket
    import uuid

    token = world.broadcast_object(uuid.uuid4().hex if world.rank == 0 else None)
    marker = root / f".shared-root-{token}"
    if world.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        marker.write_text(token)
    world.barrier()  # written before any node looks
    seen = True
    if world.local_rank == 0:
        try:
            seen = marker.read_text() == token
        except OSError:
            seen = False
    views = world.all_gather_object((node_rank, socket.gethostname(), seen))
    world.barrier()  # read everywhere before it goes
    if world.rank == 0:
        marker.unlink(missing_ok=True)
    missing = sorted({(node, host) for node, host, ok in views if not ok})
    if missing:
        names = ", ".join(f"node {node} ({host})" for node, host in missing)
        raise CheckpointError(
            f"the checkpoint root {root} is not the same directory on every node: {names} cannot see the marker rank 0 "
            "wrote there (a node-local or relative path?). Checkpoints need one directory every node shares: set "
            "CheckpointParameters(root_dir=...) or TrainerConfig(root_dir=...) to an absolute path on shared storage"
        )


def clean_staging(root: Path) -> list[Path]:
    """Remove leftover staging directories (saves that never completed)."""
    removed = []
    if root.is_dir():
        for child in root.iterdir():
            if child.name.startswith(STAGING_PREFIX) and child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child)
    return removed


def _read_metadata(path: Path) -> Any:
    from dream_trainer.serialization import UnsafeStateError, safe_reader

    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not (path / ".metadata").is_file():
        raise CheckpointError(
            f"{path} is not a complete checkpoint (no .metadata: the save did not finish or this is not a DCP directory)"
        )
    try:
        return safe_reader(str(path)).read_metadata()
    except UnsafeStateError:
        raise
    except Exception as exc:  # noqa: BLE001 - any read/unpickling error means a damaged file
        raise CheckpointError(f"cannot read checkpoint {path}: {describe(exc)}") from exc


def _drop(nested: dict[str, Any], path: tuple[Any, ...]) -> None:
    for part in path[:-1]:
        nested = nested[part]
    del nested[path[-1]]


def _mismatch(key: str, value: Any, entry: Any) -> str | None:
    """Why the run's `value` cannot load the checkpoint's `entry` for `key` (None: it can)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if entry is None:
        return f"{key!r} is not in the checkpoint"
    if not isinstance(value, torch.Tensor):
        return None
    if not isinstance(entry, TensorStorageMetadata):
        return f"{key!r} is a tensor in this run but not in the checkpoint"
    if tuple(entry.size) != tuple(value.shape):
        return f"{key!r} has shape {tuple(entry.size)} in the checkpoint, {tuple(value.shape)} in this run"
    return None


def _what_strict_false_loses(key: str, flat: dict[str, Any], saved: dict[str, Any]) -> str:
    """The end of a strict mismatch error: what resuming with ``strict=False`` would lose."""
    if not key.startswith("optimizers."):
        return ("CheckpointParameters(strict=False) would skip the mismatched keys: they keep this run's freshly "
                "initialized values")
    name = key.split(".")[1]
    prefix = f"optimizers.{name}.state."
    missing = sum(1 for k, v in flat.items() if k.startswith(prefix) and isinstance(v, torch.Tensor) and k not in saved)
    by_index = any(re.match(re.escape(prefix) + r"\d+\.", k) for k in saved)
    cause = (f"The checkpoint keeps the state of optimizer {name!r} by parameter index, not by parameter name (written "
             "while an FSDP2 model was unsharded after a validation, by an earlier dream_trainer), so it cannot be "
             "matched to this run's parameters. " if by_index else "")
    return (f"{cause}Resuming with CheckpointParameters(strict=False) would drop the state of optimizer {name!r} for "
            f"{missing} tensor(s) (e.g. Adam's moments and step counts): training would go on from a fresh optimizer "
            "state. Resume from another checkpoint instead, or start a new run from the weights "
            "(dream_trainer.checkpoint.export_model)")


def match_template(path: Path, template: dict[str, Any], strict: bool, elsewhere: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Check `template` (the run's ``state_dict()``) against the checkpoint's metadata and
    drop what cannot be loaded: other ranks' entries, new callbacks, and, with
    ``strict=False``, every missing or mismatched key (warned). With ``strict=True`` a
    mismatch raises `CheckpointError` naming the path and the first mismatched key.
    `elsewhere`: keys other ranks load (pipeline stages each hold some layers), which are
    not unexpected here."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    saved = _read_metadata(path).state_dict_metadata
    flat, mapping = flatten_state_dict(template)
    problems: list[str] = []
    for key, value in flat.items():
        if key not in saved and key.startswith(_RANK_KEYS):  # this rank did not write: drop its entry
            template["ranks"].pop(mapping[key][1], None)
            continue
        if key not in saved and key.startswith(_OPTIONAL_KEYS):
            _drop(template, mapping[key])
            continue
        problem = _mismatch(key, value, saved.get(key))
        if problem is None:
            continue
        problems.append(problem)
        if strict:
            raise CheckpointError(
                f"checkpoint {path} does not match this run: first mismatched key: {problems[0]}. "
                + _what_strict_false_loses(key, flat, saved)
            )
        _drop(template, mapping[key])
    model_keys = tuple(f"{part}." for part in ("models", "optimizers") if part in template)
    unexpected = [k for k in saved if k.startswith(model_keys) and k not in flat and k not in elsewhere]
    if unexpected and strict:
        raise CheckpointError(
            f"checkpoint {path} does not match this run: first mismatched key: {unexpected[0]!r} is in the "
            f"checkpoint but not in this run ({len(unexpected)} such keys)"
        )
    skipped = problems + [f"{k!r} is not in this run" for k in unexpected]
    if skipped:
        logger.warning("strict=False resume from %s skipped %d key(s): %s", path, len(skipped), "; ".join(skipped))
    return template


def load_checkpoint(path: str | os.PathLike[str], template: dict[str, Any], strict: bool = True, process_group: Any = None) -> dict[str, Any]:
    """Load the checkpoint at `path` into `template` (in place, DCP: any sharding) after
    `match_template`; returns the template."""
    path = Path(path)
    _check_format(path)
    _check_optimizer_form(path, template)
    template = match_template(path, template, strict, _keys_of_all_ranks(template, process_group))
    _dcp_load(template, path, process_group=process_group)
    return template


_GROUP_PARAMS = re.compile(r"optimizers\.([^.]+)\.param_groups\.\d+\.params$")


def grouped_optimizer_state(path: str | os.PathLike[str], names: Collection[str] | None = None) -> list[str]:
    """The optimizers (of `names`, when given) whose state the checkpoint at `path` holds
    in DCP's grouped form: ``optimizers.<name>.param_groups.<i>.params`` listing parameter
    names, what dream_trainer saved before optimizer state was keyed per parameter name
    (`dream_trainer.migrate.flatten_optimizer_state` converts it). An optimizer's own
    ``state_dict()`` (parameters by index) is not. Reads those lists alone, restricted."""
    import warnings

    path = Path(path)
    keys: dict[str, list[str]] = {}
    for key in _read_metadata(path).state_dict_metadata:
        found = _GROUP_PARAMS.match(key)
        if found and (names is None or found.group(1) in names):
            keys.setdefault(found.group(1), []).append(key)
    if not keys:
        return []
    params: dict[str, Any] = {key: None for group in keys.values() for key in group}
    with warnings.catch_warnings():  # "loading in a single process": each rank reads them alone
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        _dcp_load(params, path, no_dist=True)
    return sorted(name for name, group in keys.items()
                  if any(isinstance(p, str) for key in group for p in params[key] or ()))


def _check_optimizer_form(path: Path, template: dict[str, Any]) -> None:
    """Refuse, before any loading, a checkpoint holding in DCP's grouped form the state of
    an optimizer that `template` (the run's state) keys per parameter name."""
    flat = [name for name, state in template.get("optimizers", {}).items()
            if isinstance(state, dict) and "param_groups" not in state]
    grouped = grouped_optimizer_state(path, flat) if flat else []
    if grouped:
        raise CheckpointError(
            f"checkpoint {path} holds the state of optimizer(s) {', '.join(map(repr, grouped))} grouped by param "
            "group (param_groups.<i>.params: written by a dream_trainer from before optimizer state was keyed per "
            "parameter name), which this dream_trainer no longer loads. Convert it once, offline (nothing in it is "
            f"unpickled; the original is kept beside it as {path.name}.grouped): python -m dream_trainer.migrate {path}"
        )


def _keys_of_all_ranks(template: dict[str, Any], process_group: Any) -> frozenset[str]:
    """The model and optimizer keys every rank loads (a collective when distributed)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    if not dist.is_initialized() or dist.get_world_size(process_group) == 1:
        return frozenset()
    mine = [k for k in flatten_state_dict(template)[0] if k.startswith(("models.", "optimizers."))]
    gathered: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(gathered, mine, group=process_group)
    return frozenset(k for keys in gathered for k in keys)


def _check_format(path: Path) -> None:
    """Refuse, before any loading, a checkpoint of dream_trainer 0.1 (pickled per-rank state)."""
    try:
        meta = json.loads((path / META_FILE).read_text())
    except (OSError, ValueError):
        return  # not written by dream_trainer's callback: loaded (restricted) as any DCP directory
    if isinstance(meta, dict) and "format" not in meta:
        from dream_trainer.serialization import UnsafeStateError

        raise UnsafeStateError(
            f"checkpoint {path} was written by dream_trainer 0.1, which pickled per-rank state (RNG, data position, "
            "callback states); it is never unpickled, since a pickle can run code. If you trust it, convert it once "
            f"(the original is kept beside it): python -m dream_trainer.migrate {path} --trust"
        )


def _dcp_load(template: dict[str, Any], path: Path, **kwargs: Any) -> None:
    """``dcp.load`` with the restricted reader and planner (`dream_trainer.serialization`):
    a refused value raises its `UnsafeStateError`; damaged files a `CheckpointError`."""
    import torch.distributed.checkpoint as dcp

    from dream_trainer.serialization import UnsafeStateError, safe_planner, safe_reader, unsafe_cause

    reader = safe_reader(str(path))
    try:
        dcp.load(template, checkpoint_id=str(path), storage_reader=reader, planner=safe_planner(), **kwargs)
    except dcp_errors() as exc:  # truncated or damaged files, a refused value, or refused metadata
        cause = reader.refused or unsafe_cause(exc)
        if isinstance(cause, UnsafeStateError):
            raise UnsafeStateError(f"checkpoint {path}: {cause}") from None
        if cause is not None:
            raise CheckpointError(f"cannot load checkpoint {path}: {cause}") from None
        raise CheckpointError(f"cannot load checkpoint {path}: {describe(exc)}") from exc


if __name__ == "__main__":  # python -m dream_trainer.checkpoint verify DIR
    from dream_trainer.checkpoint_manifest import main

    raise SystemExit(main())

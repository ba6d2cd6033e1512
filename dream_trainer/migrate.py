"""Convert checkpoints of earlier dream_trainer versions to the current format, once::

    python -m dream_trainer.migrate runs/gpt/my-run/checkpoints          # grouped optimizer state
    python -m dream_trainer.migrate runs/gpt/my-run/checkpoints --trust  # dream_trainer 0.1

- Optimizer state in DCP's grouped form (``param_groups.<i>.params``, what dream_trainer
  saved before optimizer state was keyed per parameter name) becomes the flattened form
  the trainer saves and loads (`flatten_optimizer_state`): offline, in one process, with
  the restricted loads of a resume (nothing is unpickled).
- dream_trainer 0.1 pickled the per-rank state (`migrate_checkpoint`). Resuming never
  unpickles (see `dream_trainer.serialization`); this step does, because that is the only
  way to read the old format, so it asks for ``--trust``. Its optimizer state is flattened
  too.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from dream_trainer.checkpoint import (
    FORMAT,
    META_FILE,
    STAGING_PREFIX,
    CheckpointError,
    _dcp_load,
    _read_metadata,
    commit,
    grouped_optimizer_state,
    list_checkpoints,
    staging_dir,
)
from dream_trainer.utils import numpy_state_as_data

logger = logging.getLogger(__name__)


def _plain_rng(obj: Any) -> Any:
    """`obj` with every numpy RNG state (a tuple holding the key array) in the plain form
    of `dream_trainer.utils.rng_state` (the key as a tuple of ints)."""
    import numpy as np

    if isinstance(obj, tuple) and len(obj) == 5 and isinstance(obj[0], str) and isinstance(obj[1], np.ndarray):
        return numpy_state_as_data(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _plain_rng(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_plain_rng(v) for v in obj)
    return obj


def _flattened(optimizer: Any) -> Any:
    """An optimizer state in DCP's grouped form (``{"state": {name: {...}}, "param_groups":
    [{..., "params": [names]}]}``) in its flattened form (``state.<name>.<key>``,
    ``param_groups.<name>.<setting>``: what ``flatten_optimizer_state_dict=True`` gives);
    any other state (an optimizer's own, parameters by index; already flattened) as is."""
    groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
    params = [p for group in groups or () if isinstance(group, dict) for p in group.get("params", ())]
    if not isinstance(groups, list) or not params or not all(isinstance(p, str) for p in params):
        return optimizer
    flat: dict[str, Any] = {}

    def nested(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                nested(f"{prefix}.{key}", inner)
        else:
            flat[prefix] = value

    for name, state in optimizer.get("state", {}).items():
        nested(f"state.{name}", state)
    for group in groups:
        for name in group["params"]:
            flat.update({f"param_groups.{name}.{key}": value for key, value in group.items() if key != "params"})
    return flat


def _flatten_optimizers(state: dict[str, Any]) -> dict[str, Any]:
    """`state` (a whole checkpoint's, nested) with every grouped optimizer state flattened."""
    if isinstance(state.get("optimizers"), dict):
        state["optimizers"] = {name: _flattened(opt) for name, opt in state["optimizers"].items()}
    return state


def _replace(path: Path, state: dict[str, Any], meta: dict[str, Any], suffix: str) -> None:
    """Write `state` as the checkpoint at `path` (committed with `meta`); the original is
    kept beside it as ``<name>.<suffix>`` (which `list_checkpoints` ignores)."""
    import torch.distributed.checkpoint as dcp

    staging = staging_dir(path.parent, meta["step"]).with_name(f"{STAGING_PREFIX}migrate-{path.name}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(staging), no_dist=True)
    commit(staging, meta)  # writes the metadata, renames to .../migrate-<name>
    os.rename(path, path.with_name(f"{path.name}.{suffix}"))
    os.rename(staging.with_name(f"migrate-{path.name}"), path)


def flatten_optimizer_state(path: str | os.PathLike[str]) -> Path:
    """Convert, in place, a checkpoint whose optimizer state is in DCP's grouped form
    (`dream_trainer.checkpoint.grouped_optimizer_state`) to the flattened form the trainer
    saves and loads (keyed per parameter name); everything else is kept as it is. The
    original is kept beside it as ``<name>.grouped``. Returns the path.

    Offline, in one process, without a process group: every value is read with the
    restricted loads of a resume (nothing is unpickled), sharded tensors are stored whole
    (they load into any layout)."""
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    meta = json.loads((path / META_FILE).read_text())
    if "format" not in meta:
        raise CheckpointError(f"checkpoint {path} was written by dream_trainer 0.1: migrate_checkpoint(trust=True) "
                              "(--trust) converts it, optimizer state included")
    if not grouped_optimizer_state(path):
        raise CheckpointError(f"checkpoint {path} holds no grouped optimizer state: nothing to migrate")
    metadata = _read_metadata(path)
    saved = metadata.state_dict_metadata
    flat: dict[str, Any] = {
        key: torch.empty(tuple(md.size), dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
        for key, md in saved.items()
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        _dcp_load(flat, path, no_dist=True)
    mappings = {key: (metadata.planner_data or {}).get(key, (key,)) for key in flat}
    _replace(path, _flatten_optimizers(unflatten_state_dict(flat, mappings)), meta, "grouped")
    logger.warning("migrated %s: optimizer state keyed per parameter name; the original is kept as %s.grouped",
                   path, path.name)
    return path


def migrate_checkpoint(path: str | os.PathLike[str], *, trust: bool = False) -> Path:
    """Convert a checkpoint written by dream_trainer 0.1 (pickled per-rank state) to the
    current format, in place, its optimizer state flattened (see `flatten_optimizer_state`);
    the original is kept beside it as ``<name>.v0_1`` (which `list_checkpoints` ignores).
    Returns the path.

    This unpickles the old checkpoint — it runs whatever code the pickle names — so it
    needs ``trust=True`` and must only be used on a checkpoint you trust. It runs in one
    process: sharded tensors are stored whole (they load into any layout)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from dream_trainer.serialization import dumps

    path = Path(path)
    if not trust:
        raise CheckpointError(f"migrate_checkpoint({str(path)!r}) unpickles the checkpoint, which can run code: pass "
                              "trust=True (--trust) only for a checkpoint you trust")
    meta = json.loads((path / META_FILE).read_text())
    if "format" in meta:
        raise CheckpointError(f"checkpoint {path} is already in format {meta['format']}: nothing to migrate")
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_to_torch_save(str(path), Path(tmp) / "all.pt")
        state = torch.load(Path(tmp) / "all.pt", weights_only=False)  # trusted: the caller said so
        if isinstance(state.get("trainer", {}).get("callbacks"), bytes):
            state["trainer"]["callbacks"] = dumps(pickle.loads(state["trainer"]["callbacks"]), "saved callback names")
        for key, entry in state.get("ranks", {}).items():
            for part in ("data", "callbacks"):
                if isinstance(entry.get(part), bytes):
                    entry[part] = dumps(_plain_rng(pickle.loads(entry[part])), f"{key}'s {part}")
            entry["rng"] = _plain_rng(entry.get("rng", {}))
    _replace(path, _flatten_optimizers(state), meta, "v0_1")
    logger.warning("migrated %s to checkpoint format %d; the original is kept as %s.v0_1", path, FORMAT, path.name)
    return path


def _main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m dream_trainer.migrate", description=(
        "convert checkpoints of earlier dream_trainer versions to the current format, in place: optimizer state "
        "grouped by param group (offline, nothing unpickled; originals kept as <name>.grouped) and dream_trainer "
        "0.1 checkpoints (pickled per-rank state: needs --trust; originals kept as <name>.v0_1)"))
    parser.add_argument("paths", nargs="+", help="checkpoint directories, or roots whose checkpoints are all migrated")
    parser.add_argument("--trust", action="store_true",
                        help="needed for dream_trainer 0.1 checkpoints: converting them unpickles them (runs their code)")
    args = parser.parse_args(argv)
    targets = []
    for given in map(Path, args.paths):
        found = [given] if (given / META_FILE).is_file() else [info.path for info in list_checkpoints(given)]
        if not found:
            parser.error(f"{given}: no checkpoint there")
        targets += found
    old = [t for t in targets if "format" not in json.loads((t / META_FILE).read_text())]
    if old and not args.trust:  # refused before anything is converted
        parser.error(f"{old[0]} was written by dream_trainer 0.1: converting it unpickles it, which can run code: "
                     "add --trust if you trust it")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for target in targets:
        if target in old:
            migrate_checkpoint(target, trust=args.trust)
            print(f"{target}: migrated (original kept as {target.name}.v0_1)")
        elif grouped_optimizer_state(target):
            flatten_optimizer_state(target)
            print(f"{target}: migrated: optimizer state keyed per parameter name (original kept as "
                  f"{target.name}.grouped)")
        else:
            print(f"{target}: already in format {FORMAT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())

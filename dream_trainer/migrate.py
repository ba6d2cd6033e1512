"""Convert checkpoints written by dream_trainer 0.1 (per-rank state pickled) to the current
format, once, for checkpoints you trust::

    python -m dream_trainer.migrate runs/gpt/my-run/checkpoints --trust

Resuming never unpickles (see `dream_trainer.serialization`); this command does, because
that is the only way to read the old format, so it asks for ``--trust``.
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

from dream_trainer.checkpoint import FORMAT, META_FILE, STAGING_PREFIX, CheckpointError, commit, list_checkpoints, staging_dir
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


def migrate_checkpoint(path: str | os.PathLike[str], *, trust: bool = False) -> Path:
    """Convert a checkpoint written by dream_trainer 0.1 (pickled per-rank state) to the
    current format, in place; the original is kept beside it as ``<name>.v0_1`` (which
    `list_checkpoints` ignores). Returns the path.

    This unpickles the old checkpoint — it runs whatever code the pickle names — so it
    needs ``trust=True`` and must only be used on a checkpoint you trust. It runs in one
    process: sharded tensors are stored whole (they load into any layout)."""
    import torch.distributed.checkpoint as dcp
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
        staging = staging_dir(path.parent, meta["step"]).with_name(f"{STAGING_PREFIX}migrate-{path.name}")
        dcp.save(state, checkpoint_id=str(staging), no_dist=True)
    backup = path.with_name(f"{path.name}.v0_1")
    commit(staging, meta)  # writes the metadata, renames to .../migrate-<name>
    os.rename(path, backup)
    os.rename(staging.with_name(f"migrate-{path.name}"), path)
    logger.warning("migrated %s to checkpoint format %d; the original is kept as %s", path, FORMAT, backup)
    return path


def _main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m dream_trainer.migrate", description=(
        "convert dream_trainer 0.1 checkpoints (pickled per-rank state) to the current format, in place (the "
        "originals are kept as <name>.v0_1)"))
    parser.add_argument("paths", nargs="+", help="checkpoint directories, or roots whose checkpoints are all migrated")
    parser.add_argument("--trust", action="store_true", help="required: this unpickles the checkpoints (runs their code)")
    args = parser.parse_args(argv)
    if not args.trust:
        parser.error("this unpickles the checkpoints, which can run code: add --trust if you trust them")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for given in map(Path, args.paths):
        targets = [given] if (given / META_FILE).is_file() else [info.path for info in list_checkpoints(given)]
        if not targets:
            parser.error(f"{given}: no checkpoint there")
        for target in targets:
            if "format" in json.loads((target / META_FILE).read_text()):
                print(f"{target}: already in format {FORMAT}")
                continue
            migrate_checkpoint(target, trust=args.trust)
            print(f"{target}: migrated (original kept as {target.name}.v0_1)")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())

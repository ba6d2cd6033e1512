"""The run record: ``<run_dir>/run.json`` holds the resolved config, the git commit of the
code (when it is in a repository) and the versions of torch, torchao, torchft and
dream_trainer, for each time the run was started or resumed (`RunRecordCallback` writes
it). A resume compares the record with the resuming run: a different version, commit or
config value is warned; a field marked `FIXED_ON_RESUME` (a model's shape) that differs
is refused, naming the field."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from dream_trainer.config_files import FIXED_ON_RESUME, ConfigError, config_to_data

RECORD = "run.json"
_IDENTITY = ("run_name", "root_dir", "experiment")  # where the run is, not how it runs
_PACKAGES = ("torch", "torchao", "torchft", "dream-trainer")


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_commit(where: str | Path | None = None) -> dict[str, Any] | None:
    """``{"commit": sha, "dirty": bool}`` of the repository holding `where` (default: the
    main script's directory), or None outside a repository or without git."""
    where = Path(where if where is not None else (Path(sys.argv[0]).resolve().parent if sys.argv[0] else Path.cwd()))
    try:
        sha = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": sha, "dirty": bool(status.strip())}


def make_record(config: Any, argv: list[str] | None = None) -> dict[str, Any]:
    return {"config": config_to_data(config), "config_class": f"{type(config).__module__}.{type(config).__qualname__}",
            "git": git_commit(), "versions": versions(), "argv": list(sys.argv if argv is None else argv),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def read_record(run_dir: str | Path) -> dict[str, Any] | None:
    path = Path(run_dir) / RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"run record {path} cannot be read: {exc}") from exc
    if not isinstance(record, dict) or not isinstance(record.get("config"), dict):
        raise ConfigError(f"run record {path} is not a dream_trainer run record (no 'config' mapping)")
    return record


def write_record(run_dir: str | Path, record: dict[str, Any]) -> Path:
    """Write `record` as the run's current one; the previous records are kept under
    ``history`` (oldest first). Atomic: a reader sees the old file or the new one."""
    path = Path(run_dir) / RECORD
    previous = read_record(run_dir) if path.exists() else None
    if previous is not None:
        record = {**record, "history": [*previous.pop("history", []), previous]}
    tmp = path.with_name(f".{RECORD}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=2, default=str), encoding="utf-8")
    os.replace(tmp, path)
    return path


def recorded_config(target: str, config: Any) -> dict[str, Any]:
    """The config mapping recorded for run `target`: a run directory, or a run name under
    ``config.root_dir/config.experiment``. Its run name is the run's."""
    candidates = [Path(target), Path(config.root_dir) / config.experiment / target]
    for run_dir in candidates:
        record = read_record(run_dir) if run_dir.is_dir() else None
        if record is not None:
            data = dict(record["config"])
            data["run_name"] = run_dir.name
            if "root_dir" in data and Path(target) == run_dir:  # a directory: its own root and experiment
                data["root_dir"], data["experiment"] = str(run_dir.parent.parent), run_dir.parent.name
            return data
    raise ConfigError(f"resume {target}: no run record ({RECORD}) in {' or '.join(str(c) for c in candidates)}; "
                      "give a run directory, or the name of a run of this experiment")


def fixed_fields(cls: type, prefix: str = "") -> list[str]:
    """The dotted names of the fields of dataclass `cls` marked `FIXED_ON_RESUME` (a
    marked dataclass field: its name, covering every key under it)."""
    from dream_trainer.config_files import field_types

    out = []
    types = field_types(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get(next(iter(FIXED_ON_RESUME))):
            out.append(prefix + f.name)
        elif isinstance(types[f.name], type) and dataclasses.is_dataclass(types[f.name]):
            out += fixed_fields(types[f.name], f"{prefix}{f.name}.")
    return out


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def compare(record: dict[str, Any], new: dict[str, Any], config_cls: type) -> tuple[str | None, list[str]]:
    """(the refusal or None, the warnings) of resuming a run recorded as `record` with the
    record `new` (`make_record`) of a config of class `config_cls`."""
    old_config, new_config = _flat(record["config"]), _flat(new["config"])
    fixed = fixed_fields(config_cls)
    changed = sorted(k for k in old_config.keys() | new_config.keys()
                     if old_config.get(k, "(absent)") != new_config.get(k, "(absent)") and k not in _IDENTITY)

    def describe(key: str) -> str:
        return f"{key}: {old_config.get(key, '(absent)')!r} -> {new_config.get(key, '(absent)')!r}"

    refused = [k for k in changed if any(k == f or k.startswith(f + ".") for f in fixed)]
    refusal = None
    if refused:
        refusal = ("this run cannot resume with another " + ", ".join(refused) + " (fixed on resume): "
                   + "; ".join(describe(k) for k in refused) + ". Start a new run (another --run_name), or "
                   "use --init-from to start one from this run's weights")
    warnings = [f"config changed since the run was recorded: {describe(k)}" for k in changed if k not in refused]
    for name, version in new["versions"].items():
        before = record.get("versions", {}).get(name)
        if before != version:
            warnings.append(f"{name} version changed since the run was recorded: {before} -> {version}")
    old_git, new_git = record.get("git") or {}, new.get("git") or {}
    if old_git.get("commit") != new_git.get("commit"):
        warnings.append(f"code changed since the run was recorded: git commit {old_git.get('commit')} -> "
                        f"{new_git.get('commit')}")
    return refusal, warnings

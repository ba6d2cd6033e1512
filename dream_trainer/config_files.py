"""Config files as data: read a JSON, TOML or YAML file with a safe loader and apply it to
the config dataclasses (`TrainerConfig` and its parameter groups, or a trainer's own).

The first part of the command line (issue 24); the flags come next. A file is read as plain
data: JSON with the standard library, TOML with ``tomllib`` (``tomli`` before Python 3.11),
YAML with ``yaml.safe_load`` (no tags that build Python objects). Nothing in a file is imported
or called. Applying a mapping to a config:

- a key that is not a field is an error naming the key's path, the file and the nearest
  field names (``training_parameters.max_step`` → did you mean ``max_steps``?);
- a nested mapping goes into a dataclass-valued field (``training_parameters: {...}``);
- a field whose value is not data, or one marked ``field(metadata={"code": True})`` (its
  values are objects: `TrainerConfig.callbacks`), cannot be set from a file;
- every dataclass is rebuilt with ``dataclasses.replace``, so its own validation runs and a
  bad value fails naming the field and the file.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["ConfigError", "apply_config", "load_config_file", "nearest"]

T = TypeVar("T")

_DATA = (type(None), bool, int, float, str)


class ConfigError(ValueError):
    """A config file or key that cannot be applied: unknown, unreadable or invalid."""


def nearest(name: str, candidates: list[str], n: int = 3) -> list[str]:
    """The candidates closest to `name` (difflib's ratio, at least 0.6), best first."""
    return difflib.get_close_matches(name, candidates, n=n, cutoff=0.6)


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a ``.json``, ``.toml``, ``.yaml`` or ``.yml`` file, read as data."""
    path = Path(path)
    suffix = path.suffix.lower()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot be read ({exc.strerror or exc})") from exc
    try:
        if suffix == ".json":
            data = json.loads(text, object_pairs_hook=_no_duplicates)
        elif suffix == ".toml":
            data = _toml().loads(text)
        elif suffix in (".yaml", ".yml"):
            data = _yaml().safe_load(text)
        else:
            raise ConfigError(f"config file {path}: unknown format {suffix or '(no suffix)'!r}; use .json, .toml, "
                              ".yaml or .yml")
    except ConfigError:
        raise
    except Exception as exc:  # each parser has its own error class
        raise ConfigError(f"config file {path}: not valid {suffix[1:].upper()}: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: the top level must be a mapping of field names, got "
                          f"{type(data).__name__}")
    return data


def apply_config(config: T, mapping: Mapping[str, Any], *, source: str | Path | None = None,
                 prefix: str = "") -> T:
    """A copy of the dataclass `config` with `mapping` applied (see the module docstring).
    `source`: the file the mapping came from (named in errors); `prefix`: the key path of
    `config` itself."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(f"apply_config() needs a dataclass instance, got {type(config).__name__}")
    where = f" (in {source})" if source is not None else ""
    fields = {f.name: f for f in dataclasses.fields(config) if f.init}
    names = list(fields)
    changes: dict[str, Any] = {}
    for key, value in mapping.items():
        path = f"{prefix}{key}"
        if key not in names:
            close = nearest(str(key), names)
            hint = f"did you mean {', '.join(repr(prefix + c) for c in close)}?" if close else \
                f"the fields of {type(config).__name__} are {names}"
            raise ConfigError(f"unknown config key {path!r}{where}: {hint}")
        current = getattr(config, key)
        if dataclasses.is_dataclass(current) and not isinstance(current, type):
            if not isinstance(value, Mapping):
                raise ConfigError(f"config key {path!r}{where}: a mapping of {type(current).__name__} fields is "
                                  f"expected, got {type(value).__name__}")
            changes[key] = apply_config(current, value, source=source, prefix=f"{path}.")
            continue
        if isinstance(current, os.PathLike) and isinstance(value, str):  # a path field: its text
            changes[key] = value
            continue
        if not _is_data(current) or fields[key].metadata.get("code"):
            raise ConfigError(f"config key {path!r}{where}: {type(config).__name__}.{key} holds "
                              "objects, which a config file cannot make (it holds data "
                              "only): set it in code")
        if not _is_data(value):
            raise ConfigError(f"config key {path!r}{where}: {value!r} is not plain data")
        changes[key] = tuple(value) if isinstance(current, tuple) and isinstance(value, list) else value
    try:
        return dataclasses.replace(config, **changes)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{prefix.rstrip('.') or type(config).__name__}{where}: {exc}") from exc


def _is_data(value: Any) -> bool:
    if isinstance(value, _DATA):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_data(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_data(v) for k, v in value.items())
    return False


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"the key {key!r} appears twice")
        out[key] = value
    return out


def _toml() -> Any:
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib
    try:
        import tomli
    except ImportError as exc:
        raise ConfigError("reading a .toml config needs Python 3.11 or the tomli package (pip install tomli)") from exc
    return tomli


def _yaml() -> Any:
    try:
        import yaml
    except ImportError as exc:
        raise ConfigError("reading a .yaml config needs the PyYAML package (pip install pyyaml)") from exc
    return yaml

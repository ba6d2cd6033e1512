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
- a value is checked against the field's annotation (``int``, ``float``, ``bool``, ``str``,
  ``Literal``, enums, ``Optional``/unions, tuples and lists of those, ``torch.dtype`` by name):
  a mismatch is an error naming the key, the file, the expected type and the value
  (`check_value`). A float field takes an int, and a string that reads as a number
  (PyYAML reads ``1e-3`` as text);
- every dataclass is rebuilt with ``dataclasses.replace``, so its own validation runs and a
  bad value fails naming the field and the file.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import os
import sys
import types as _types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["FIXED_ON_RESUME", "ConfigError", "apply_config", "check_value", "config_to_data", "describe_type",
           "field_types", "load_config_file", "nearest"]

T = TypeVar("T")

_DATA = (type(None), bool, int, float, str)

FIXED_ON_RESUME = {"fixed_on_resume": True}
"""Field metadata for a value a run cannot resume with another of (a model's width, its
vocabulary): ``d_model: int = field(default=512, metadata=FIXED_ON_RESUME)``. On a dataclass
field it covers every field inside. A resume that changes one is refused, naming it
(`dream_trainer.callbacks.RunRecordCallback`)."""


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
    types = field_types(type(config))
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
        if not (_is_data(current) or isinstance(current, enum.Enum)) or fields[key].metadata.get("code"):
            raise ConfigError(f"config key {path!r}{where}: {type(config).__name__}.{key} holds "
                              "objects, which a config file cannot make (it holds data "
                              "only): set it in code")
        if not _is_data(value):
            raise ConfigError(f"config key {path!r}{where}: {value!r} is not plain data")
        if isinstance(value, str) and _admits_dtype(types.get(key)):
            value = _dtype(value, path, where)
        else:
            value = _checked(value, types.get(key, Any), path, where)
        changes[key] = tuple(value) if isinstance(current, tuple) and isinstance(value, list) else value
    try:
        return dataclasses.replace(config, **changes)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{prefix.rstrip('.') or type(config).__name__}{where}: {exc}") from exc


def _checked(value: Any, annotation: Any, path: str, where: str) -> Any:
    ok, converted = check_value(value, annotation)
    if not ok:
        raise ConfigError(f"config key {path!r}{where}: expected {describe_type(annotation)}, got {value!r} "
                          f"({type(value).__name__})")
    return converted


def check_value(value: Any, annotation: Any) -> tuple[bool, Any]:
    """Whether the plain-data `value` fits the field annotation `annotation`, and the value
    to set (an int for a float field becomes a float; a list for a tuple field, a tuple).
    An annotation it cannot check (``Any``, a class that is not data) admits anything."""
    import typing

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any or isinstance(annotation, (str, typing.TypeVar)):
        return True, value
    if annotation is type(None) or annotation is None:
        return value is None, value
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in args), value
    if origin is typing.Union or origin is _types.UnionType:
        for arg in sorted(args, key=lambda a: a is float):  # an int stays an int where int fits
            ok, converted = check_value(value, arg)
            if ok:
                return True, converted
        return False, value
    if origin in (tuple, list, Sequence):
        if not isinstance(value, (list, tuple)):
            return False, value
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            if len(args) != len(value):
                return False, value
            items = [check_value(v, a) for v, a in zip(value, args)]
        else:
            items = [check_value(v, args[0] if args else Any) for v in value]
        converted = [c for _, c in items]
        return all(ok for ok, _ in items), tuple(converted) if origin is tuple else converted
    if origin in (dict, Mapping):
        return isinstance(value, dict), value
    if annotation is bool:
        return isinstance(value, bool), value
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if annotation is float:
        return _as_float(value)
    if annotation is str:
        return isinstance(value, str), value
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        names = {m.name: m for m in annotation} | {str(m.value): m for m in annotation}
        return (True, names[value]) if isinstance(value, str) and value in names else (False, value)
    return True, value  # not plain data (a path, a dtype, an object): checked elsewhere


def _as_float(value: Any) -> tuple[bool, Any]:
    if isinstance(value, bool):
        return False, value
    if isinstance(value, (int, float)):
        return True, float(value)
    if isinstance(value, str):
        try:
            return True, float(value)
        except ValueError:
            return False, value
    return False, value


def describe_type(annotation: Any) -> str:
    """`annotation` as a reader would write it: ``int``, ``'auto' | 'node' | int``, ``None | float``."""
    import typing

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None) or annotation is None:
        return "None"
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin is typing.Union or origin is _types.UnionType:
        return " | ".join(describe_type(a) for a in args)
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else describe_type(a) for a in args)
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{inner}]" if args else name
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " | ".join(repr(m.name) for m in annotation)
    return getattr(annotation, "__name__", str(annotation))


def config_to_data(config: Any) -> dict[str, Any]:
    """The dataclass `config` as plain data (what `apply_config` takes back): nested
    dataclasses as mappings, ``torch.dtype`` as its name (``"bfloat16"``), paths as text,
    tuples as lists; fields marked ``{"code": True}`` are left out."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        if f.init and not f.metadata.get("code"):
            out[f.name] = _as_data(getattr(config, f.name))
    return out


def _as_data(value: Any) -> Any:
    import torch

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return config_to_data(value)
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (list, tuple)):
        return [_as_data(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _as_data(v) for k, v in value.items()}
    return value


def field_types(cls: type) -> dict[str, Any]:
    """The resolved annotation of each field of the dataclass `cls` (``Any`` where one cannot
    be resolved: a name imported only for type checking)."""
    import typing

    out: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        module = sys.modules.get(klass.__module__)
        namespace = dict(vars(module)) if module is not None else {}
        for name, annotation in klass.__dict__.get("__annotations__", {}).items():
            if isinstance(annotation, str):
                try:
                    annotation = eval(annotation, namespace, dict(vars(typing)))  # noqa: S307 - the class's own source
                except Exception:  # noqa: BLE001 - a TYPE_CHECKING-only name
                    annotation = Any
            out[name] = annotation
    return {f.name: out.get(f.name, Any) for f in dataclasses.fields(cls)}


def _admits_dtype(annotation: Any) -> bool:
    import typing

    import torch

    return annotation is torch.dtype or torch.dtype in typing.get_args(annotation)


def _dtype(name: str, path: str, where: str) -> Any:
    import torch

    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ConfigError(f"config key {path!r}{where}: {name!r} is not a torch dtype (e.g. 'bfloat16', 'float32')")
    return value


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

"""What tyro needs to know about dream_trainer's config dataclasses (a `ConstructorRegistry`):

- ``torch.dtype`` is parsed from its name (``--device_parameters.param_dtype bfloat16``);
- a path field (``str | os.PathLike[str]``) is parsed as text;
- a text field with listed allowed values (`dream_trainer.cli._help.CHOICES`:
  ``device_parameters.pipeline.schedule``) takes only those;
- a field marked ``field(metadata={"code": True})`` (its values are objects:
  `TrainerConfig.callbacks`) has no flag: the value of the default config is kept;
- an annotation naming what is imported only for type checking does not break the parser.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import types
import typing
from typing import Any, Union

import torch
from tyro import _docstrings
from tyro.constructors import (
    MISSING_NONPROP,
    ConstructorRegistry,
    PrimitiveConstructorSpec,
    PrimitiveTypeInfo,
    StructConstructorSpec,
    StructFieldSpec,
    StructTypeInfo,
)

from dream_trainer.config_files import field_types

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64,
           "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def registry() -> ConstructorRegistry:
    reg = ConstructorRegistry()
    reg.primitive_rule(_dtype_rule)
    reg.struct_rule(_config_rule)
    return reg


def _dtype_rule(info: PrimitiveTypeInfo) -> PrimitiveConstructorSpec[torch.dtype] | None:
    if info.type is not torch.dtype:
        return None
    return PrimitiveConstructorSpec(
        nargs=1,
        metavar="{" + ",".join(_DTYPES) + "}",
        instance_from_str=lambda args: _DTYPES[args[0]],
        is_instance=lambda value: isinstance(value, torch.dtype),
        str_from_instance=lambda value: [str(value).removeprefix("torch.")],
        choices=tuple(_DTYPES),
    )


def _text_paths(annotation: Any) -> Any:
    """``str | os.PathLike[str] | None`` → ``str | None``: a path is given as text."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (Union, types.UnionType) and any(
            typing.get_origin(a) is os.PathLike or a is os.PathLike for a in args):
        kept = tuple(a for a in args if not (typing.get_origin(a) is os.PathLike or a is os.PathLike))
        return Union[kept] if len(kept) > 1 else kept[0]
    return annotation


def _choices(cls: type, name: str) -> Any:
    """A text field whose allowed values are listed elsewhere (`_help.CHOICES`) as a ``Literal``."""
    from dream_trainer.cli._help import choices_of

    allowed = choices_of(cls, name)
    return typing.Literal[allowed] if allowed else None  # type: ignore[valid-type]


def _config_rule(info: StructTypeInfo) -> StructConstructorSpec | None:
    cls = info.type
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        return None
    fields = [f for f in dataclasses.fields(cls) if f.init]
    annotations = field_types(cls)
    adjusted = {f.name: _choices(cls, f.name) or _text_paths(annotations[f.name]) for f in fields}
    code = {f.name for f in fields if f.metadata.get("code")}
    if not code and all(adjusted[f.name] is annotations[f.name] and annotations[f.name] is not Any for f in fields):
        return None  # tyro's own dataclass rule
    default = info.default if dataclasses.is_dataclass(info.default) and not isinstance(info.default, type) else None
    specs = []
    for f in fields:
        if f.name in code:
            continue
        if default is not None:
            value = getattr(default, f.name)
        elif f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = MISSING_NONPROP
        helptext = f.metadata.get("help") or functools.partial(_docstrings.get_field_docstring, cls, f.name,
                                                                info.markers)
        specs.append(StructFieldSpec(name=f.name, type=adjusted[f.name], default=value, helptext=helptext))

    def instantiate(**kwargs: Any) -> Any:
        kept = {name: getattr(default, name) for name in code} if default is not None else {}
        return cls(**kept, **kwargs)

    return StructConstructorSpec(instantiate=instantiate, fields=tuple(specs))

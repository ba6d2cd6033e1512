"""The help of `dream_trainer.cli`: ``--help`` (one screen: the usage, the subcommand's
options, the short flags and the subcommands) and ``--help-all [GROUP]`` (every dotted
flag of the config, or of one group, with its type or choices, its default and its help).

A field's help is its ``field(metadata={"help": ...})``, else its docstring (an
``Attributes:`` entry or an attribute docstring: what tyro extracts), else `FALLBACK_HELP`
for the config classes whose fields have none. `CHOICES`: the allowed values of text
fields whose annotation does not list them.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import shutil
import textwrap
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from dream_trainer.config_files import field_types

__all__ = ["CHOICES", "FALLBACK_HELP", "Field", "config_fields", "field_help", "full_help", "short_help"]

FALLBACK_HELP: dict[str, dict[str, str]] = {"DeviceParameters": {
    "device": "'auto' (CUDA when available, else CPU), 'cpu', 'mps', 'cuda' or 'cuda:N'.",
    "backend": "the process group's backend: 'auto' (chosen for the device), 'gloo' or 'nccl'.",
    "dp_replicate": "data-parallel replicas (DDP; HSDP's replicas with dp_shard > 1): an int or 'auto' (what "
                    "the world size leaves; one size at most is 'auto').",
    "dp_shard": "ranks each model's parameters, gradients and optimizer state are sharded over (FSDP2): an "
                "int, 'auto', or 'node' (the ranks of a node that context and tensor parallelism leave).",
    "context_parallel": "ranks each holding a part of every sequence (ring attention over them; FSDP2 shards "
                        "over them too).",
    "tensor_parallel": "ranks each layer is split over (the trainer's apply_tensor_parallel); within a node.",
    "pipeline_parallel": "pipeline ranks, the mesh's outermost dimension (the trainer declares a "
                         "PipelineLayout); device_parameters.pipeline: how they run.",
    "pipeline": "how the pipeline-parallel model runs (schedule, micro-batches, stages, split).",
    "compile_model": "torch.compile the models (the trainer's apply_compile).",
    "param_dtype": "FSDP2's mixed precision: the dtype parameters are gathered and computed in (None: as stored).",
    "reduce_dtype": "FSDP2's mixed precision: the dtype gradients are reduced in (None: the parameters').",
    "autocast_dtype": "run the forward under torch.autocast to this dtype (None: no autocast).",
    "checkpoint_activations": "recompute activations in backward (the trainer's apply_activation_checkpointing).",
    "cpu_offload": "FSDP2 keeps parameters, gradients and optimizer state on the CPU (CPUOffloadPolicy).",
    "weight_init": "how sharded models are initialized: 'full' (every rank the full tensors, then its part: "
                   "a single process's weights) or 'sharded' (each rank its shards; CUDA only).",
    "fused_optimizers": "on CUDA, Adam, AdamW and SGD built without fused/foreach run fused (one launch per "
                        "update phase).",
    "init_timeout_s": "seconds the process group's set-up (rendezvous, first collectives) may take.",
    "timeout_s": "seconds a collective may take once training runs, before the run fails.",
    "hang_report_s": "seconds a rank waits in one collective before it names the rank that never entered it, "
                     "with its stack (None: min(60, timeout_s / 4); 0: off).",
    "hang_abort_s": "seconds that wait may last before the named hang stops the run on both sides (None: just "
                    "before the collective timeout).",
    "straggler_factor": "a rank slower than this factor times the other ranks' median (work before the first "
                        "collective, or data wait) is named at log steps (None: off).",
}}
"""Help for fields that have no docstring, by class name (until the classes document them)."""


def _pipeline_schedules() -> tuple[str, ...]:
    from dream_trainer.pipeline.plan import SCHEDULES

    return ("auto", *SCHEDULES)


CHOICES: dict[tuple[str, str], Any] = {("PipelineParameters", "schedule"): _pipeline_schedules}
"""(class name, field) → a function giving the allowed values of a text field."""


@dataclass
class Field:
    """One dotted flag: ``--group.name``, its type or choices as text, its default, its help."""

    flag: str
    kind: str
    default: Any
    help: str
    is_bool: bool = False


def choices_of(cls: type, name: str) -> tuple[str, ...] | None:
    made = CHOICES.get((cls.__name__, name))
    return tuple(made()) if made is not None else None


def field_help(cls: type, f: dataclasses.Field[Any]) -> str:
    """`f`'s help: its metadata's, its docstring, or `FALLBACK_HELP`."""
    from tyro import _docstrings

    text = f.metadata.get("help")
    for klass in cls.__mro__:
        if text or not dataclasses.is_dataclass(klass) or f.name not in getattr(klass, "__annotations__", {}):
            continue
        text = _docstrings.get_field_docstring(klass, f.name, ())
    for klass in cls.__mro__:
        text = text or FALLBACK_HELP.get(klass.__name__, {}).get(f.name)
    return " ".join((text or "").split())


def _kind(annotation: Any, choices: tuple[str, ...] | None) -> str:
    import torch

    from dream_trainer.cli._tyro import _DTYPES, _text_paths

    if choices:
        return "{" + ",".join(choices) + "}"
    annotation = _text_paths(annotation)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return "{" + ",".join(str(a) for a in args) + "}"
    if origin in (typing.Union, types.UnionType):
        return "|".join(_kind(a, None) for a in args)
    if origin in (tuple, list):
        return f"[{_kind(args[0], None) if args else 'VALUE'} ...]"
    if annotation is type(None):
        return "None"
    if annotation is torch.dtype:
        return "{" + ",".join(_DTYPES) + "}"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "{" + ",".join(m.name for m in annotation) + "}"
    return getattr(annotation, "__name__", str(annotation)).upper()


def config_fields(config: Any, prefix: str = "") -> Iterator[tuple[str, str, Field | None]]:
    """``(group, group help, field)`` for every dotted flag of the dataclass instance
    `config`; a group (a dataclass-valued field) first comes with ``field=None``."""
    cls = type(config)
    annotations = field_types(cls)
    nested = []
    for f in dataclasses.fields(config):
        if not f.init or f.metadata.get("code"):
            continue
        value, help_text = getattr(config, f.name), field_help(cls, f)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            summary = (type(value).__doc__ or "").strip().split("\n\n")[0]  # its class's first paragraph
            nested.append((f.name, help_text or " ".join(summary.split()), value))  # after this level's own fields
            continue
        annotation = annotations[f.name]
        kind = _kind(annotation, choices_of(cls, f.name))
        shown = str(value).removeprefix("torch.") if value is not None else "None"
        yield prefix.rstrip("."), "", Field(f"--{prefix}{f.name}", kind, shown, help_text, annotation is bool)
    for name, help_text, value in nested:
        yield f"{prefix}{name}", help_text, None
        yield from config_fields(value, f"{prefix}{name}.")


def _width() -> int:
    return max(60, min(100, shutil.get_terminal_size((100, 24)).columns))


def _one_line(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3].rstrip() + "..."


def _row(name: str, text: str, width: int) -> list[str]:
    """``  NAME  text`` on one line, or NAME alone and the text under it when NAME is long."""
    if len(name) <= 26:
        return [_one_line(f"  {name:<26} {text}", width)]
    return [f"  {name}", _one_line(f"  {'':<26} {text}", width)]


def full_help(config: Any, group: str | None, prog: str) -> str:
    """Every dotted flag of `config` (of the group `group` only, when given)."""
    width = _width()
    wrap = textwrap.TextWrapper(width=width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    lines = [f"usage: {prog} [--config FILE] [--GROUP.FIELD VALUE ...]", ""] + ([] if group else ["top level:"])
    for where, group_help, fld in config_fields(config):
        if group and not (where == group or where.startswith(group + ".")):
            continue
        if fld is None:
            lines += ["", f"{where}:" + (f" {group_help}" if group_help else "")]
            continue
        flag = f"{fld.flag}, {_no_flag(fld.flag)}" if fld.is_bool else f"{fld.flag} {fld.kind}"
        lines.append(f"  {flag}  (default: {fld.default})")
        if fld.help:
            lines += wrap.wrap(fld.help)
    return "\n".join(lines)


def groups(config: Any) -> list[str]:
    return ["(top level)"] + [where for where, _, fld in config_fields(config) if fld is None]


def short_help(parser: argparse.ArgumentParser, config: Any, aliases: Mapping[str, str],
               subcommands: Mapping[str, str], description: str | None) -> str:
    """One screen: usage, the subcommand's options, the short flags, the subcommands."""
    width = _width()
    by_flag = {fld.flag: fld for _, _, fld in config_fields(config) if fld is not None}
    lines = [f"usage: {parser.prog.split()[0]} [SUBCOMMAND] [OPTIONS] [--GROUP.FIELD VALUE ...]"]
    lines += ["", description] if description else []
    lines += ["", "subcommands:", *(_one_line(f"  {n:<18} {t}", width) for n, t in subcommands.items())]
    lines += ["", f"options ({parser.prog.split()[-1]}):"]
    for action in parser._actions:  # noqa: SLF001 - argparse has no public list
        if not action.option_strings:
            continue
        name = ", ".join(action.option_strings)
        if action.choices:
            name += " {" + ",".join(map(str, action.choices)) + "}"
        elif action.nargs == "?" and action.metavar:
            name += f" [{action.metavar}]"
        elif action.nargs != 0 and action.metavar:
            name += f" {action.metavar}"
        lines += _row(name, action.help or "", width)
    if aliases:
        lines += ["", "short flags (another name of a dotted flag):"]
        for alias, target in aliases.items():
            fld = by_flag.get(target)
            kind = "" if fld is None or fld.is_bool else f" {fld.kind}"
            about = f"{target[2:]}: {fld.help}" if fld is not None and fld.help else target[2:]
            lines += _row(alias + kind, about, width)
    names = ", ".join(groups(config)[1:])
    lines += ["", "every config field has a dotted flag (--training_parameters.max_steps 100); list them with",
              "--help-all, or one group's with --help-all GROUP; the groups:",
              *textwrap.wrap(names, width, initial_indent="  ", subsequent_indent="  ")]
    return "\n".join(lines)


def known_flags(config: Any) -> dict[str, str]:
    """Every spelling tyro takes for `config`'s dotted flags (dashes as underscores, bools'
    ``no_`` forms) → the flag as shown."""
    out: dict[str, str] = {}
    for _, _, fld in config_fields(config):
        if fld is None:
            continue
        out[fld.flag] = fld.flag
        if fld.is_bool:
            out[_no_flag(fld.flag)] = fld.flag
    return out


def _no_flag(flag: str) -> str:
    """``--group.name`` → ``--group.no_name``: a bool flag's negation, as tyro spells it."""
    head, dot, name = flag[2:].rpartition(".")
    return f"--{head}{dot}no_{name}"

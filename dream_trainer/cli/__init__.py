"""One command line for every trainer, built from its config dataclasses with tyro.

    python train.py [SUBCOMMAND] [--config run.yaml ...] [--training_parameters.max_steps 100 ...]

`main(make_trainer, config)` parses the command line into a `Command` (`parse`) and runs
it (`dream_trainer.cli.commands`). The config is `TrainerConfig` or a subclass holding the
trainer's own fields; every field gets a dotted flag, typed, with its docstring as help.
Layers, each over the one before: the script's `config`, the run's recorded config
(``resume RUN``), the ``--config`` files in order, the presets (``--parallel fsdp``), the
flags. Unknown flags (of every form) and keys are errors naming the nearest ones; a file's
values are checked against the field types. ``--help`` fits a screen, ``--help-all [GROUP]``
lists every dotted flag (`dream_trainer.cli._help`). A usage error prints the usage and
exits with status 2, as command lines do.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from dream_trainer.config_files import ConfigError, apply_config, config_to_data, load_config_file, nearest

__all__ = ["SUBCOMMANDS", "Command", "config_json", "main", "parse"]

C = TypeVar("C")

SUBCOMMANDS: dict[str, str] = {
    "train": "train (the default): start the run, or resume it from its newest checkpoint",
    "resume": "resume RUN: continue the run RUN (a run directory or a run name) with its recorded config",
    "profile": "profile a few optimizer steps (ProfileCallback), then print the ops table and the trace's path",
    "find-graph-breaks": "compile, run one step, report every graph break of each compiled region",
    "benchmark": "eager against compiled tokens/s, over interleaved rounds, with their spread",
    "summarize": "parameters and memory per rank for the planned mesh, FLOPs per token, the plan; no training",
    "export": "export CHECKPOINT: write a checkpoint's model as safetensors (one process, no collectives)",
}
_POSITIONAL = {"resume": "RUN", "export": "CHECKPOINT"}


@dataclass
class Command:
    """A parsed command line. `config`: the resolved config; `target`: ``resume``'s run or
    ``export``'s checkpoint; `options`: the subcommand's own options; `aliases`: the short flags."""

    name: str
    config: Any
    target: str | None = None
    init_from: str | None = None
    print_config: bool = False
    config_files: list[str] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)


def _options(parser: argparse.ArgumentParser, name: str, presets: Mapping[str, Mapping[str, Any]]) -> None:
    add = parser.add_argument
    add("--config", action="append", default=[], metavar="FILE",
        help="a JSON, TOML or YAML file of config values (repeat: later files override earlier ones)")
    add("--print-config", action="store_true", help="print the resolved config (JSON, a valid --config file) and exit")
    add("--help-all", nargs="?", const="", default=None, metavar="GROUP",
        help="list every config field's dotted flag with its help (GROUP: only that group's)")
    for preset, choices in presets.items():
        add(f"--{preset}", choices=sorted(choices), default=None, help=f"preset ({', '.join(sorted(choices))})")
    if name in ("train", "resume"):
        add("--init-from", metavar="CHECKPOINT", default=None,
            help="start from the weights of CHECKPOINT (models only: not its optimizer, step or data position)")
    if name == "profile":
        add("--active", type=int, default=3, help="optimizer steps recorded (after 1 wait and 1 warm-up step)")
    if name == "find-graph-breaks":
        add("--fullgraph", action="store_true", help="compile each region with fullgraph=True and report failures")
    if name == "benchmark":
        add("--bench-steps", type=int, default=20, help="timed optimizer steps per run (one window)")
        add("--bench-warmup", type=int, default=5, help="steps before the timed window in each run (compile, warm-up)")
        add("--bench-rounds", type=int, default=3, help="rounds of (eager, compiled) runs, the order alternating")
    if name == "summarize":
        add("--world-size", type=int, default=None, help="plan for this many ranks (default: this launch's)")
        add("--local-world-size", type=int, default=None, help="ranks per node (default: the world size)")
    if name == "export":
        add("--output", default=None, help="the .safetensors file (default: <CHECKPOINT>/<model>.safetensors)")
        add("--model", default="model", help="which model of the checkpoint")
        add("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="cast floating tensors")
        add("--trainable-only", action="store_true",
            help="only the parameters that were trained (an optimizer holds state for them): a LoRA adapter")


def parse(config: C, argv: Sequence[str] | None = None, *, aliases: Mapping[str, str] | None = None,
          presets: Mapping[str, Mapping[str, Mapping[str, Any]]] | None = None, prog: str | None = None,
          description: str | None = None) -> Command:
    """Parse `argv` (default ``sys.argv[1:]``) against the dataclass instance `config`.

    `aliases`: short flags for dotted ones (``{"--steps": "--training_parameters.max_steps"}``).
    `presets`: named config fragments chosen by a flag (``{"parallel": {"fsdp": {...}}}``:
    ``--parallel fsdp`` applies that mapping, after the files and before the flags)."""
    import tyro

    from dream_trainer.cli._tyro import registry

    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(f"cli.parse() needs a config dataclass instance, got {type(config).__name__}")
    args = list(sys.argv[1:] if argv is None else argv)
    original = list(args)
    aliases, presets = dict(aliases or {}), dict(presets or {})
    name = args.pop(0) if args and args[0] in SUBCOMMANDS else "train"
    parser = argparse.ArgumentParser(prog=f"{prog or Path(sys.argv[0]).name} {name}", add_help=False,
                                     allow_abbrev=False, description=SUBCOMMANDS[name])
    parser.add_argument("-h", "--help", action="store_true", help="this help (--help-all: every config field)")
    _options(parser, name, presets)
    target = None
    if name in _POSITIONAL:
        if not args or args[0].startswith("-"):
            if not {"-h", "--help"} & set(args):
                parser.error(f"{name} needs {_POSITIONAL[name]} first: {parser.prog} {_POSITIONAL[name]} [FLAGS]")
        else:
            target = args.pop(0)
    args = [_alias(token, aliases) for token in args]
    known, rest = parser.parse_known_args(args)
    _help_and_exit(parser, known, config, aliases, description)
    _check_flags(parser, rest, config, aliases)
    base = _layers(parser, config, known, rest, target if name == "resume" else None, presets)
    resolved = tyro.cli(type(config), args=rest, default=base, registry=registry(), use_underscores=True,
                        prog=parser.prog, description=description)
    own = ("help", "help_all", "config", "print_config", "init_from")
    options = {k: v for k, v in vars(known).items() if k not in own and k.replace("_", "-") not in presets}
    return Command(name=name, config=resolved, target=target, init_from=getattr(known, "init_from", None),
                   print_config=known.print_config, config_files=list(known.config), options=options, argv=original,
                   aliases=aliases)


def _layers(parser: argparse.ArgumentParser, config: C, known: argparse.Namespace, rest: list[str],
            resumed: str | None, presets: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> C:
    """`config` with, in order, the record of the run `resumed`, the ``--config`` files and
    the chosen presets applied (each checked against the field types)."""
    base = config
    if resumed is not None:
        from dream_trainer.run_records import recorded_config

        where = {k: _peek(rest, k) or getattr(config, k) for k in ("root_dir", "experiment")}
        try:
            recorded = recorded_config(resumed, dataclasses.replace(config, **where))
        except ConfigError as exc:
            parser.error(str(exc))
        base = _layer(parser, base, recorded, f"the record of run {resumed}")
    for path in known.config:
        try:
            base = apply_config(base, load_config_file(path), source=path)
        except ConfigError as exc:
            parser.error(str(exc))
    for preset in presets:
        choice = getattr(known, preset.replace("-", "_"))
        if choice is not None:
            base = _layer(parser, base, presets[preset][choice], f"--{preset} {choice}")
    return base


def _alias(token: str, aliases: Mapping[str, str]) -> str:
    flag, eq, value = token.partition("=")
    return aliases[flag] + eq + value if flag in aliases else token


def _peek(args: list[str], name: str) -> str | None:
    """The value of the flag ``--name`` (either spelling) among `args`, before tyro parses them."""
    flags = {f"--{name}", f"--{name.replace('_', '-')}"}
    for i, token in enumerate(args):
        flag, eq, value = token.partition("=")
        if flag in flags:
            return value if eq else (args[i + 1] if i + 1 < len(args) else None)
    return None


def _layer(parser: argparse.ArgumentParser, config: C, mapping: Mapping[str, Any], source: str) -> C:
    try:
        return apply_config(config, mapping, source=source)
    except ConfigError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def _help_and_exit(parser: argparse.ArgumentParser, known: argparse.Namespace, config: Any,
                   aliases: Mapping[str, str], description: str | None) -> None:
    """``--help``: one screen; ``--help-all [GROUP]``: every dotted flag (of GROUP). Exits 0."""
    from dream_trainer.cli._help import full_help, groups, short_help

    if known.help_all is not None:
        group = known.help_all.strip().removeprefix("--").rstrip(".")
        names = groups(config)[1:]
        if group and group not in names:
            close = nearest(group, names)
            parser.error(f"--help-all {group}: no such group; " + (f"did you mean {', '.join(close)}?" if close
                                                                  else f"the groups are {', '.join(names)}"))
        print(full_help(config, group or None, parser.prog))
        parser.exit(0)
    if known.help:
        print(short_help(parser, config, aliases, SUBCOMMANDS, description))
        parser.exit(0)


def _check_flags(parser: argparse.ArgumentParser, rest: list[str], config: Any, aliases: Mapping[str, str]) -> None:
    """An unknown flag (a dotted one, a short one, a subcommand's option) is an error naming
    the nearest of them all, before tyro parses."""
    from dream_trainer.cli._help import known_flags

    known = {"--" + flag[2:].replace("-", "_"): shown for flag, shown in known_flags(config).items()}
    for token in rest:
        flag = token.partition("=")[0]
        if not flag.startswith("--") or flag == "--" or "--" + flag[2:].replace("-", "_") in known:
            continue
        options = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]  # noqa: SLF001
        close = nearest(flag, [*aliases, *options, *dict.fromkeys(known.values())])
        hint = f": did you mean {' or '.join(close)}?" if close else " (--help lists the flags, --help-all every field)"
        parser.error(f"unrecognized flag {flag}{hint}")


def config_json(config: Any) -> str:
    """The resolved config as JSON: what ``--print-config`` prints and ``--config`` reads."""
    return json.dumps(config_to_data(config), indent=2)


def main(make_trainer: Callable[[Any], Any], config: Any, argv: Sequence[str] | None = None, **kwargs: Any) -> Any:
    """Parse the command line (`parse`, with its keyword arguments) and run the subcommand
    with the trainers `make_trainer(config)` builds. Returns what the subcommand returns:
    the trainer for ``train``/``resume``/``profile``/``find-graph-breaks``, a table for
    ``benchmark``/``summarize``, the file for ``export``; None for ``--print-config``."""
    from dream_trainer.cli.commands import run

    return run(parse(config, argv, **kwargs), make_trainer)

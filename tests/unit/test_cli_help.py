"""dream_trainer.cli (issue 40): ``--help`` on one screen, ``--help-all [GROUP]`` with every
dotted field's help and choices, nearest names for every flag form, config-file values
checked against the field types, the printed path of the graph-break report."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
import torch

from dream_trainer import TrainerConfig
from dream_trainer.cli import Command, parse
from dream_trainer.config_files import ConfigError, apply_config, load_config_file
from dream_trainer.pipeline.plan import SCHEDULES
from tests.demos import load


def _gpt():
    demo = load("gpt")
    return demo, demo.GPTRunConfig(), {"aliases": demo.ALIASES, "presets": demo.PRESETS}


def _exit(capsys, config, argv, **kwargs):
    with pytest.raises(SystemExit) as info:
        parse(config, argv, **kwargs)
    out = capsys.readouterr()
    return info.value.code, out.out, out.err


def test_help_fits_a_screen_with_one_usage(capsys):
    _, config, kwargs = _gpt()
    code, out, _ = _exit(capsys, config, ["--help"], **kwargs)
    assert code == 0
    lines = out.splitlines()
    assert len(lines) <= 60 and out.count("usage:") == 1
    assert not any(len(line) > 100 for line in lines)
    for text in ("find-graph-breaks", "summarize", "--steps", "training_parameters.max_steps", "--parallel",
                 "--help-all", "device_parameters"):
        assert text in out, text
    assert "--device_parameters.param_dtype" not in out  # the dotted fields are --help-all's
    code, out, _ = _exit(capsys, config, ["summarize", "-h"], **kwargs)
    assert code == 0 and "--world-size" in out and "--local-world-size" in out


def test_help_all_lists_every_field_with_its_help_and_choices(capsys):
    demo, config, kwargs = _gpt()
    code, out, _ = _exit(capsys, config, ["--help-all"], **kwargs)
    assert code == 0 and out.count("usage:") == 1
    blocks = out.split("\n  --")[1:]
    flags = {"--" + block.split()[0].rstrip(",") for block in blocks}
    device = [f.name for f in dataclasses.fields(config.device_parameters) if f.name != "pipeline"]
    for name in device:
        assert f"--device_parameters.{name}" in flags, name
    for block in blocks:  # every field has help: a line under its flag
        assert len(block.strip().splitlines()) >= 2, block
    schedule = next(b for b in blocks if b.startswith("device_parameters.pipeline.schedule"))
    assert "{" + ",".join(("auto", *SCHEDULES)) + "}" in schedule
    assert "{auto,gloo,nccl}" in out and "bfloat16" in out and "[{wandb,mlflow} ...]" in out
    code, out, _ = _exit(capsys, config, ["--help-all", "device_parameters.pipeline"], **kwargs)
    assert "--device_parameters.pipeline.split" in out and "--model.d_model" not in out
    code, _, err = _exit(capsys, config, ["--help-all", "devce_parameters"], **kwargs)
    assert code == 2 and "did you mean device_parameters" in err
    # the listed choices are the parser's: another value is refused by the flag itself
    chosen = parse(config, ["--device_parameters.pipeline.schedule", "GPipe"]).config
    assert chosen.device_parameters.pipeline.schedule == "GPipe"
    code, _, err = _exit(capsys, config, ["--device_parameters.pipeline.schedule", "Gpipe"])
    assert code == 2 and "GPipe" in err


@pytest.mark.parametrize(("argv", "typo", "suggested"), [
    (["--stpes", "20"], "--stpes", "--steps"),  # a short flag
    (["--batch-sise=8"], "--batch-sise", "--batch-size"),
    (["--training_parameters.max_step", "5"], "--training_parameters.max_step", "--training_parameters.max_steps"),
    (["--confg", "x.yaml"], "--confg", "--config"),  # an option of the command line's own
    (["summarize", "--world-sise", "4"], "--world-sise", "--world-size"),  # a subcommand's
])
def test_every_flag_form_gets_the_nearest_names(capsys, argv, typo, suggested):
    _, config, kwargs = _gpt()
    code, _, err = _exit(capsys, config, argv, **kwargs)
    assert code == 2 and f"unrecognized flag {typo}: did you mean {suggested}" in err, err


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(kw_only=True)
class Inner:
    depth: int = 2
    rate: float = 0.5
    mode: Literal["a", "b"] = "a"
    color: Color = Color.RED
    limit: int | None = None


@dataclass(kw_only=True)
class Typed(TrainerConfig):
    inner: Inner = field(default_factory=Inner)
    flag: bool = False
    name: str = "x"
    tags: tuple[Literal["p", "q"], ...] = ()


@pytest.mark.parametrize(("text", "key", "expected"), [
    ("inner:\n  depth: abc\n", "inner.depth", "expected int"),
    ("inner:\n  depth: 2.5\n", "inner.depth", "expected int"),
    ("inner:\n  depth: true\n", "inner.depth", "expected int"),
    ("inner:\n  rate: fast\n", "inner.rate", "expected float"),
    ("inner:\n  mode: c\n", "inner.mode", "expected 'a' | 'b'"),
    ("inner:\n  color: green\n", "inner.color", "expected 'RED' | 'BLUE'"),
    ("inner:\n  limit: many\n", "inner.limit", "expected int | None"),
    ("flag: 1\n", "flag", "expected bool"),
    ("name: 3\n", "name", "expected str"),
    ("tags: [p, r]\n", "tags", "expected tuple['p' | 'q', ...]"),
    ("training_parameters:\n  max_steps: ten\n", "training_parameters.max_steps", "expected int | None"),
    ("device_parameters:\n  dp_shard: half\n", "device_parameters.dp_shard", "'auto' | 'node'"),
])
def test_config_file_values_are_checked_against_the_field_types(tmp_path, text, key, expected):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        apply_config(Typed(), load_config_file(path), source=path)
    message = str(info.value)
    assert repr(key) in message and str(path) in message and expected in message, message


def test_config_file_values_that_fit_are_taken(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("inner:\n  rate: 1\n  limit: null\n  mode: b\n  color: BLUE\nflag: true\ntags: [q]\n"
                    "seed: 7\ndevice_parameters:\n  dp_replicate: 1\n  dp_shard: auto\n  param_dtype: bfloat16\n")
    config = apply_config(Typed(), load_config_file(path), source=path)
    assert config.inner.rate == 1.0 and isinstance(config.inner.rate, float)
    assert (config.inner.mode, config.inner.color, config.flag, config.tags) == ("b", Color.BLUE, True, ("q",))
    assert config.device_parameters.dp_shard == "auto" and config.device_parameters.param_dtype is torch.bfloat16
    path.write_text("inner:\n  rate: 1e-3\n")  # PyYAML reads 1e-3 as text
    assert apply_config(Typed(), load_config_file(path), source=path).inner.rate == 1e-3


def test_a_bad_config_file_value_fails_the_command_line_before_any_work(tmp_path, capsys):
    _, config, kwargs = _gpt()
    (tmp_path / "bad.yaml").write_text('model: {d_model: "abc"}\n')
    code, _, err = _exit(capsys, config, ["summarize", "--config", str(tmp_path / "bad.yaml")], **kwargs)
    assert code == 2 and "'model.d_model'" in err and "bad.yaml" in err and "expected int" in err


class _Callbacks(list):
    add = list.append


def test_find_graph_breaks_prints_where_the_report_is(tmp_path, monkeypatch, capsys):
    """A relative run directory: the callback resolves its log file under it when it
    writes, and the printed path is that file's, not the run directory twice over."""
    from dream_trainer.callbacks.graph_breaks import FindGraphBreaksCallback
    from dream_trainer.cli.commands import run

    monkeypatch.chdir(tmp_path)
    run_dir = Path("runs/gpt/a")

    class Trainer:
        callbacks = _Callbacks()
        world = type("World", (), {"is_rank_zero": True})()

        def __init__(self, config):
            self.run_dir = run_dir

        def fit(self):
            finder = next(c for c in self.callbacks if isinstance(c, FindGraphBreaksCallback))
            finder.report = {"mode": "breaks", "step": 1, "regions": {"model": {"ran": True, "breaks": 0,
                                                                               "graphs": 1}}}
            finder.log_file = Path(self.run_dir) / finder.log_file  # what the callback does when it writes
            finder.log_file.parent.mkdir(parents=True)
            finder.log_file.write_text("graph breaks\n")

    run(Command(name="find-graph-breaks", config=TrainerConfig(), options={"fullgraph": False}), Trainer)
    report = capsys.readouterr().out.strip().splitlines()[-1]
    assert report == f"report: {run_dir / 'graph_breaks.txt'}"
    assert Path(report.removeprefix("report: ")).is_file()

"""dream_trainer.cli: parsing the command line into a config (tyro), files and flags
composed, nearest-name errors, presets and short flags, the subcommands' own options, the
run record's comparison."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import pytest
import torch

from dream_trainer import Callback, TrainerConfig, TrainingParameters
from dream_trainer.cli import config_json, parse
from dream_trainer.run_records import compare, fixed_fields, make_record
from dream_trainer.config_files import FIXED_ON_RESUME


@dataclass(kw_only=True)
class Shape:
    """A model's shape.

    Attributes:
        width: hidden features.
        depth: layers.
    """

    width: int = 32
    depth: int = 2


@dataclass(kw_only=True)
class MyConfig(TrainerConfig):
    """A user trainer's config: dream_trainer's fields and its own.

    Attributes:
        shape: the model's shape.
        lr: the learning rate.
        note: free text.
    """

    shape: Shape = field(default_factory=Shape, metadata=FIXED_ON_RESUME)
    lr: float = 1e-3
    note: str | None = None


class Marker(Callback):
    pass


def test_dotted_flags_set_every_level_with_types():
    marker = Marker()
    base = MyConfig(callbacks=[marker])
    cmd = parse(base, ["--training_parameters.max_steps", "7", "--training-parameters.n-epochs", "None",
                       "--device_parameters.param_dtype", "bfloat16", "--device_parameters.dp_shard", "2",
                       "--shape.width", "64", "--lr", "0.5", "--root_dir", "/tmp/x", "--device_parameters.compile_model"])
    c = cmd.config
    assert cmd.name == "train" and type(c) is MyConfig
    assert c.training_parameters.max_steps == 7 and c.training_parameters.n_epochs is None
    assert c.device_parameters.param_dtype is torch.bfloat16 and c.device_parameters.dp_shard == 2
    assert c.device_parameters.compile_model is True
    assert c.shape.width == 64 and c.shape.depth == 2 and c.lr == 0.5 and c.root_dir == "/tmp/x"
    assert c.callbacks == [marker]  # objects: kept from the script's config, no flag


def test_unknown_flags_and_bad_values_name_the_nearest_and_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        parse(MyConfig(), ["--training_parameters.max_step", "5"])
    assert info.value.code == 2
    assert "--training_parameters.max_steps" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(MyConfig(), ["--callbacks", "x"])  # no flag for a field holding objects
    with pytest.raises(SystemExit):
        parse(MyConfig(), ["--training_parameters.max_steps", "0"])  # the dataclass's own validation
    assert "max_steps=0" in capsys.readouterr().err


def test_files_then_presets_then_flags_compose(tmp_path, capsys):
    (tmp_path / "a.yaml").write_text("seed: 3\ntraining_parameters:\n  max_steps: 10\n  n_epochs: null\nshape:\n"
                                     "  width: 16\n")
    (tmp_path / "b.toml").write_text("lr = 0.25\n[training_parameters]\nmax_steps = 20\n")
    presets = {"size": {"big": {"shape": {"width": 512, "depth": 8}}}}
    cmd = parse(MyConfig(), ["--config", str(tmp_path / "a.yaml"), "--config", str(tmp_path / "b.toml"),
                             "--size", "big", "--shape.depth", "3"], presets=presets)
    c = cmd.config
    assert (c.seed, c.training_parameters.max_steps, c.lr) == (3, 20, 0.25)  # b over a
    assert (c.shape.width, c.shape.depth) == (512, 3)  # the preset over the files, the flag over the preset
    assert cmd.config_files == [str(tmp_path / "a.yaml"), str(tmp_path / "b.toml")]
    (tmp_path / "bad.yaml").write_text("shape:\n  widht: 3\n")
    with pytest.raises(SystemExit):
        parse(MyConfig(), ["--config", str(tmp_path / "bad.yaml")])
    err = capsys.readouterr().err
    assert "shape.widht" in err and "shape.width" in err and "bad.yaml" in err


def test_print_config_round_trips_through_a_config_file(tmp_path):
    cmd = parse(MyConfig(), ["--print-config", "--shape.depth", "5", "--device_parameters.autocast_dtype", "bfloat16",
                             "--note", "hello"])
    assert cmd.print_config
    text = config_json(cmd.config)
    data = json.loads(text)
    assert data["shape"] == {"width": 32, "depth": 5} and "callbacks" not in data
    path = tmp_path / "resolved.json"
    path.write_text(text)
    again = parse(MyConfig(), ["--config", str(path)]).config
    assert dataclasses.replace(again, callbacks=None) == dataclasses.replace(cmd.config, callbacks=None)


def test_aliases_and_subcommand_options(capsys):
    aliases = {"--steps": "--training_parameters.max_steps", "--width": "--shape.width"}
    cmd = parse(MyConfig(), ["--steps", "4", "--width=8"], aliases=aliases)
    assert cmd.config.training_parameters.max_steps == 4 and cmd.config.shape.width == 8
    cmd = parse(MyConfig(), ["export", "ckpt/step_1", "--trainable-only", "--dtype", "bfloat16"])
    assert (cmd.name, cmd.target) == ("export", "ckpt/step_1")
    assert cmd.options == {"output": None, "model": "model", "dtype": "bfloat16", "trainable_only": True}
    cmd = parse(MyConfig(), ["benchmark", "--bench-steps", "6"])
    assert cmd.options == {"bench_steps": 6, "bench_warmup": 5, "bench_rounds": 3}
    cmd = parse(MyConfig(), ["train", "--init-from", "ckpt/step_1"])
    assert cmd.init_from == "ckpt/step_1"
    with pytest.raises(SystemExit):
        parse(MyConfig(), ["resume", "--steps", "3"])  # RUN first
    assert "resume needs RUN" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(MyConfig(), ["profile", "--bench-steps", "3"])  # another subcommand's option


def test_help_lists_subcommands_fields_and_docstrings(capsys):
    with pytest.raises(SystemExit) as info:
        parse(MyConfig(), ["--help"], aliases={"--steps": "--training_parameters.max_steps"})
    assert info.value.code == 0
    out = capsys.readouterr().out
    for text in ("find-graph-breaks", "summarize", "--steps", "training_parameters.max_steps",
                 "stop after this many optimizer steps", "--help-all", "shape"):
        assert text in out, text
    with pytest.raises(SystemExit) as info:
        parse(MyConfig(), ["--help-all"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for text in ("--training_parameters.max_steps", "stop after this many optimizer steps", "--shape.width",
                 "hidden features", "shape: the model's shape."):
        assert text in out, text


def test_resume_comparison_refuses_fixed_fields_and_warns_the_rest():
    old = make_record(MyConfig(run_name="a"))
    new = make_record(MyConfig(run_name="a", lr=0.5, training_parameters=TrainingParameters(n_epochs=2)))
    refusal, warnings = compare(old, new, MyConfig)
    assert refusal is None
    assert any("lr: 0.001 -> 0.5" in w for w in warnings) and any("n_epochs: 1 -> 2" in w for w in warnings)
    assert fixed_fields(MyConfig) == ["shape"]
    changed = make_record(MyConfig(run_name="a", shape=Shape(width=64)))
    changed["versions"]["torch"] = "0.0"
    refusal, warnings = compare(old, changed, MyConfig)
    assert refusal is not None and "shape.width: 32 -> 64" in refusal
    assert any("torch version changed" in w for w in warnings)
    moved = make_record(MyConfig(run_name="a", root_dir="elsewhere"))
    assert compare(old, moved, MyConfig) == (None, [])  # where the run lives is not how it runs

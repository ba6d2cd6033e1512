"""Config files as data (`dream_trainer.config_files`): JSON, TOML and YAML read with safe
loaders and applied to the config dataclasses, unknown keys named with the nearest fields,
values validated by the dataclasses themselves, objects refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from dream_trainer import TrainerConfig, TrainingParameters
from dream_trainer.config_files import ConfigError, apply_config, load_config_file

FILES = {
    "run.json": '{"seed": 7, "root_dir": "elsewhere", "training_parameters": {"max_steps": 30, "n_epochs": null}}',
    "run.toml": 'seed = 7\nroot_dir = "elsewhere"\n[training_parameters]\nmax_steps = 30\n',
    "run.yaml": "seed: 7\nroot_dir: elsewhere\ntraining_parameters:\n  max_steps: 30\n",
}


@pytest.mark.parametrize("name", sorted(FILES))
def test_each_format_applies_to_the_nested_config(tmp_path, name):
    path = tmp_path / name
    path.write_text(FILES[name])
    config = apply_config(TrainerConfig(), load_config_file(path), source=path)
    assert config.seed == 7 and Path(config.root_dir) == Path("elsewhere")
    assert config.training_parameters.max_steps == 30
    assert TrainerConfig().training_parameters.max_steps is None  # a copy: the defaults are untouched


def test_files_compose_in_order(tmp_path):
    (tmp_path / "a.yaml").write_text("training_parameters: {max_steps: 30, val_every_n_steps: 5}\n")
    (tmp_path / "b.json").write_text('{"training_parameters": {"max_steps": 40}}')
    config = TrainerConfig()
    for name in ("a.yaml", "b.json"):
        config = apply_config(config, load_config_file(tmp_path / name), source=name)
    assert (config.training_parameters.max_steps, config.training_parameters.val_every_n_steps) == (40, 5)


def test_unknown_keys_name_the_nearest_field_and_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'training_parameters.max_step' \(in run.yaml\): "
                                          r"did you mean 'training_parameters.max_steps'"):
        apply_config(TrainerConfig(), {"training_parameters": {"max_step": 3}}, source="run.yaml")
    with pytest.raises(ConfigError, match=r"unknown config key 'zzz'.*the fields of TrainerConfig are \["):
        apply_config(TrainerConfig(), {"zzz": 1})


def test_bad_values_fail_in_the_dataclass_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"training_parameters \(in f.toml\): TrainingParameters.max_steps=0 is "
                                          "invalid"):
        apply_config(TrainerConfig(), {"training_parameters": {"max_steps": 0}}, source="f.toml")
    with pytest.raises(ConfigError, match="a mapping of TrainingParameters fields is expected, got int"):
        apply_config(TrainerConfig(), {"training_parameters": 3})


def test_a_file_holds_data_only(tmp_path):
    evil = tmp_path / "evil.yaml"
    marker = tmp_path / "ran"
    evil.write_text(f"seed: !!python/object/apply:os.mkdir ['{marker}']\n")
    with pytest.raises(ConfigError, match="evil.yaml: not valid YAML"):
        load_config_file(evil)
    assert not marker.exists()
    with pytest.raises(ConfigError, match=r"TrainerConfig.callbacks holds objects, which a "
                                          "config file cannot make"):
        apply_config(TrainerConfig(), {"callbacks": ["x"]})
    (tmp_path / "dup.json").write_text('{"seed": 1, "seed": 2}')
    with pytest.raises(ConfigError, match="the key 'seed' appears twice"):
        load_config_file(tmp_path / "dup.json")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="the top level must be a mapping"):
        load_config_file(tmp_path / "list.yaml")
    (tmp_path / "x.ini").write_text("[a]\n")
    with pytest.raises(ConfigError, match="unknown format '.ini'"):
        load_config_file(tmp_path / "x.ini")
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config_file(tmp_path / "missing.json")


def test_a_trainers_own_config_dataclass_works_the_same(tmp_path):
    import dataclasses

    @dataclasses.dataclass(kw_only=True)
    class Model:
        d_model: int = 128
        n_layer: int = 4

    @dataclasses.dataclass(kw_only=True)
    class Mine:
        model: Model = dataclasses.field(default_factory=Model)
        training_parameters: TrainingParameters = dataclasses.field(default_factory=TrainingParameters)

    mine = apply_config(Mine(), {"model": {"d_model": 64}, "training_parameters": {"n_epochs": 2}})
    assert (mine.model.d_model, mine.model.n_layer, mine.training_parameters.n_epochs) == (64, 4, 2)
    with pytest.raises(ConfigError, match="did you mean 'model.n_layer'"):
        apply_config(Mine(), {"model": {"n_layers": 2}})

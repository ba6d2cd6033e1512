"""Config validation, mesh planning and the launcher's argument handling (no processes)."""

import os
import sys

import pytest
import torch

from dream_trainer import (
    CheckpointParameters,
    DeviceParameters,
    LoggingParameters,
    MeshPlanError,
    TrainerConfig,
    TrainingParameters,
    plan_mesh,
)
from dream_trainer.launch import _pop_nproc, entrypoint
from dream_trainer.run_identity import ENV_RUN_NAME


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n_epochs=0), r"n_epochs=0 is invalid"),
        (dict(n_epochs=None, max_steps=None), "set at least one"),
        (dict(gradient_accumulation_steps=0), r"gradient_accumulation_steps=0"),
        (dict(gradient_clip_val=-1.0), r"gradient_clip_val=-1.0"),
        (dict(val_every_n_steps=1.5), r"val_every_n_steps=1.5"),
        (dict(num_sanity_val_steps=-1), r"num_sanity_val_steps=-1"),
        (dict(gradient_clip_val=float("inf")), r"gradient_clip_val=inf is invalid: expected a finite number"),
        (dict(gradient_clip_val=float("nan")), r"gradient_clip_val=nan"),
        (dict(gradient_clip_val=True), r"gradient_clip_val=True"),
        (dict(scheduler_monitor=""), r"scheduler_monitor='' is invalid"),
    ],
)
def test_training_parameters_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainingParameters(**kwargs)


@pytest.mark.parametrize(
    "cls, kwargs, match",
    [
        (DeviceParameters, dict(compile_model="no"), r"DeviceParameters.compile_model='no' is invalid: expected True or False"),
        (DeviceParameters, dict(checkpoint_activations=1), r"checkpoint_activations=1"),
        (DeviceParameters, dict(cpu_offload=None), r"cpu_offload=None"),
        (TrainingParameters, dict(validate_at_epoch_end="yes"), r"validate_at_epoch_end='yes'"),
        (LoggingParameters, dict(log_lr=0), r"LoggingParameters.log_lr=0"),
        (CheckpointParameters, dict(strict="false"), r"CheckpointParameters.strict='false'"),
        (CheckpointParameters, dict(root_dir=3), r"root_dir=3 is invalid: expected a non-empty str or pathlib.Path"),
        (TrainerConfig, dict(root_dir=None), r"TrainerConfig.root_dir=None is invalid"),
        (TrainerConfig, dict(callbacks="ProgressBarCallback"), r"TrainerConfig.callbacks='ProgressBarCallback' is invalid: expected a list"),
    ],
)
def test_wrong_types_are_rejected(cls, kwargs, match):
    with pytest.raises(TypeError, match=match):
        cls(**kwargs)


def test_paths_and_single_callbacks_are_accepted():
    from pathlib import Path

    from dream_trainer import ProgressBarCallback

    config = TrainerConfig(root_dir=Path("runs") / "x", callbacks=ProgressBarCallback())
    assert config.root_dir == os.path.join("runs", "x") and isinstance(config.callbacks[0], ProgressBarCallback)
    params = CheckpointParameters(root_dir=Path("/tmp/ckpt"), resume_mode=Path("/tmp/ckpt/step_000000001"))
    assert params.root_dir == "/tmp/ckpt" and params.resume_mode == "/tmp/ckpt/step_000000001"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(device="gpu"), r"device='gpu' is invalid"),
        (dict(backend="mpi"), r"backend='mpi'"),
        (dict(dp_shard=0), r"dp_shard=0"),
        (dict(dp_shard="auto"), r"only one mesh size may be 'auto'"),
        (dict(param_dtype=torch.int8), r"param_dtype=torch.int8"),
        (dict(timeout_s=0), r"timeout_s=0"),
        (dict(timeout_s=float("nan")), r"timeout_s=nan is invalid: expected a finite number > 0"),
        (dict(init_timeout_s=float("inf")), r"init_timeout_s=inf"),
    ],
)
def test_device_parameters_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DeviceParameters(**kwargs)


def test_trainer_config_errors():
    with pytest.raises(ValueError, match=r"experiment='a/b'"):
        TrainerConfig(experiment="a/b")
    with pytest.raises(ValueError, match=r"seed=-1"):
        TrainerConfig(seed=-1)
    with pytest.raises(ValueError, match=r"seed=4294967296 is invalid: expected an int in \[0, 2\*\*32\)"):
        TrainerConfig(seed=2**32)  # numpy cannot take it: caught here, not at seeding
    with pytest.raises(TypeError, match="training_parameters must be a TrainingParameters"):
        TrainerConfig(training_parameters={"n_epochs": 1})
    with pytest.raises(ValueError, match="log_every_n_steps=0"):
        LoggingParameters(log_every_n_steps=0)


@pytest.mark.parametrize(
    "params, world, local, dims, dp, kind",
    [
        (DeviceParameters.SINGLE_DEVICE(), 1, None, (1, 1, 1, 1, 1), 1, "none"),
        (DeviceParameters.DDP(), 1, None, (1, 1, 1, 1, 1), 1, "none"),
        (DeviceParameters.DDP(), 4, None, (1, 4, 1, 1, 1), 4, "ddp"),
        (DeviceParameters.FSDP(), 1, None, (1, 1, 1, 1, 1), 1, "none"),
        (DeviceParameters.FSDP(), 2, None, (1, 1, 2, 1, 1), 2, "fsdp"),
        (DeviceParameters.FSDP(dp_shard=2), 2, 2, (1, 1, 2, 1, 1), 2, "fsdp"),
        (DeviceParameters.HSDP(dp_shard=2), 4, None, (1, 2, 2, 1, 1), 4, "hsdp"),
        (DeviceParameters.HSDP(dp_shard=2), 8, 4, (1, 4, 2, 1, 1), 8, "hsdp"),
        (DeviceParameters(dp_replicate=1, dp_shard="auto", tensor_parallel=2), 8, 8, (1, 1, 4, 1, 2), 4, "fsdp"),
        (DeviceParameters(dp_replicate=1, dp_shard="auto", context_parallel=2), 4, None, (1, 1, 2, 2, 1), 2, "fsdp"),
        (DeviceParameters(dp_replicate="auto", context_parallel=2, tensor_parallel=2), 8, 4, (1, 2, 1, 2, 2), 2, "ddp"),
        (DeviceParameters(dp_replicate="auto", tensor_parallel=2), 2, 2, (1, 1, 1, 1, 2), 1, "none"),
        (DeviceParameters(dp_replicate=2, dp_shard=2, context_parallel=2, tensor_parallel=2), 16, 8, (1, 2, 2, 2, 2), 4, "hsdp"),
        (DeviceParameters(dp_replicate="auto", pipeline_parallel=2), 2, None, (2, 1, 1, 1, 1), 1, "none"),
        (DeviceParameters(dp_replicate="auto", pipeline_parallel=2), 4, None, (2, 2, 1, 1, 1), 2, "ddp"),
        (DeviceParameters(dp_replicate=1, dp_shard="auto", pipeline_parallel=2), 8, None, (2, 1, 4, 1, 1), 4, "fsdp"),
    ],
)
def test_plan_table(params, world, local, dims, dp, kind):
    plan = plan_mesh(params, world, local_world_size=local)
    assert plan.shape == dims and plan.world_size == world
    assert plan.dp == dp and plan.data_parallel == kind
    assert plan.dim_names == ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@pytest.mark.parametrize(
    "params, world, local, match",
    [
        (DeviceParameters.FSDP(dp_shard=3), 4, None,
         r"dp_shard=3.*world of 4 rank.*sizes multiply to 3.*A plan that fits: DeviceParameters\(dp_shard=4, dp_replicate=1"),
        (DeviceParameters.SINGLE_DEVICE(), 2, None, r"world of 2 rank.*sizes multiply to 1"),
        (DeviceParameters(dp_replicate="auto", context_parallel=3), 4, None,
         r"context_parallel=3.*fixed sizes multiply to 3, which does not divide it.*dp_replicate=4, dp_shard=1, context_parallel=1"),
        (DeviceParameters.HSDP(dp_shard=4), 6, None, r"dp_shard=4.*world of 6.*does not divide it.*dp_shard=6"),
        (DeviceParameters(dp_replicate=1, dp_shard=2, context_parallel=2), 2, None,
         r"sizes multiply to 4.*DeviceParameters\(dp_shard=1, dp_replicate=1, context_parallel=2, tensor_parallel=1\)"),
        (DeviceParameters(dp_replicate="auto", tensor_parallel=4), 8, 2, r"larger than a node \(2 ranks\).*tensor_parallel=2\)"),
        (DeviceParameters(dp_replicate="auto", tensor_parallel=3), 6, 4, r"tensor_parallel=3 does not divide a node \(4 ranks\).*tensor_parallel=2\)"),
        (DeviceParameters.FSDP(), 0, None, r"world_size=0 is invalid"),
        (DeviceParameters(dp_replicate="auto", pipeline_parallel=3), 4, None,
         r"pipeline_parallel=3.*does not divide it.*dp_replicate=4, dp_shard=1, context_parallel=1, tensor_parallel=1\)"),
    ],
)
def test_bad_plans_name_sizes_and_a_fix(params, world, local, match):
    with pytest.raises(MeshPlanError, match=match) as info:
        plan_mesh(params, world, local_world_size=local)
    suggestion = str(info.value).partition("A plan that fits: ")[2]
    if suggestion:  # the suggested plan must itself be valid on this world
        suggested = eval(suggestion, {"DeviceParameters": DeviceParameters})  # noqa: S307 - our own repr
        assert plan_mesh(suggested, world, local_world_size=local).world_size == world


def test_bad_plan_fails_at_trainer_construction(monkeypatch):
    from dream_trainer.testing import ToyTrainer

    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():  # rank 0 of a torchrun world of 2
        monkeypatch.setenv(key, value)
    with pytest.raises(MeshPlanError):
        ToyTrainer(TrainerConfig(device_parameters=DeviceParameters.SINGLE_DEVICE()))


def test_nproc_parsing():
    assert _pop_nproc(["--nproc", "2", "--steps", "3"]) == (2, ["--steps", "3"])
    assert _pop_nproc(["--nproc=4"]) == (4, [])
    assert _pop_nproc(["--steps", "3"]) == (None, ["--steps", "3"])
    with pytest.raises(ValueError, match=r"--nproc='x' is invalid"):
        _pop_nproc(["--nproc", "x"])
    with pytest.raises(ValueError, match=r"--nproc=0 is invalid"):
        _pop_nproc(["--nproc", "0"])


def test_entrypoint_plain_process_runs_main_and_sets_identity(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py", "--nproc", "1", "--lr", "3"])
    result = entrypoint(lambda: (list(sys.argv), os.environ[ENV_RUN_NAME]), seed=7)
    assert result[0] == ["train.py", "--lr", "3"]  # --nproc removed before main parses
    assert result[1] and os.environ["DREAM_TRAINER_SEED"] == "7"


def test_run_identity_from_env_wins(monkeypatch, tmp_path):
    from dream_trainer.testing import ToyTrainer

    monkeypatch.setenv("DREAM_TRAINER_RUN_NAME", "shared-name")
    monkeypatch.setenv("DREAM_TRAINER_SEED", "5")
    trainer = ToyTrainer(TrainerConfig(experiment="exp", root_dir=str(tmp_path), seed=1,
                                       device_parameters=DeviceParameters.SINGLE_DEVICE(),
                                       training_parameters=TrainingParameters(n_epochs=1, max_steps=1)))
    trainer.fit()
    assert trainer.run_dir == tmp_path / "exp" / "shared-name" and trainer.run_dir.is_dir()
    assert trainer.seed == 5


def test_launch_result_exit_code():
    from dream_trainer import LaunchResult

    assert LaunchResult((0, 0)).exit_code == 0
    assert LaunchResult((75, 75)).exit_code == 75
    assert LaunchResult((0, 75)).exit_code == 75  # one rank preempted, all saved: resumable
    assert LaunchResult((75, 1)).exit_code == 1  # a failure is never reported as resumable
    assert LaunchResult((0, 134, 1)).exit_code == 134  # the first failed rank's status

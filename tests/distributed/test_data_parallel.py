"""Two gloo ranks: DDP (composable `replicate`, DDP's reducer) keeps ranks identical and matches one process
on the concatenated batch; the world agrees on the run identity and tears down."""

import torch
import torch.distributed as dist

from dream_trainer import DeviceParameters, LoggingParameters, TrainerConfig, TrainingParameters
from dream_trainer.testing import RecordingCallback, ToyTrainer, spawn_world

ATOL = 1e-5


def _config(device_parameters, accumulation=1, callbacks=(), root_dir="runs"):
    return TrainerConfig(
        root_dir=root_dir,
        seed=3,
        device_parameters=device_parameters,
        training_parameters=TrainingParameters(
            n_epochs=2, gradient_accumulation_steps=accumulation, num_sanity_val_steps=1, gradient_clip_val=10.0
        ),
        logging_parameters=LoggingParameters(log_every_n_steps=2),
        callbacks=list(callbacks),
    )


def _full(tensor):
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def _train(batch_size, accumulation, device_parameters, callbacks=()):
    trainer = ToyTrainer(_config(device_parameters, accumulation, callbacks), batch_size=batch_size, shuffle=True)
    trainer.fit()
    return trainer, {
        "params": {k: _full(v) for k, v in trainer.model.state_dict().items()},
        "losses": torch.stack(trainer.step_losses),
        "global_step": trainer.global_step,
    }


def _ddp_runs():
    # The test creates the process group: the world reuses it and leaves it alone.
    dist.init_process_group("gloo")
    out = {}
    for accumulation in (1, 2):
        trainer, result = _train(16 // (2 * accumulation), accumulation, DeviceParameters.DDP())
        assert dist.is_initialized(), "the world destroyed a process group it does not own"
        grads_synced = type(trainer.model).__name__.startswith("DDP")  # composable replicate
        out[accumulation] = {**result, "replicated": grads_synced}
    return out


def _owned_world_run():
    rec = RecordingCallback()
    trainer, result = _train(8, 1, DeviceParameters.DDP(), [rec])
    return {
        **result,
        "pg_alive_after_fit": dist.is_initialized(),
        "run_name": trainer.run_name,
        "dp": (trainer.world.dp_rank, trainer.world.dp_size),
        "val_logs": [m["val/loss"] for _, m in rec.logs if "val/loss" in m],
        "train_logs": [m["train/loss"] for _, m in rec.logs if "train/loss" in m],
    }


def test_ddp_matches_single_process_on_concatenated_batch():
    ranks = spawn_world(2, _ddp_runs, timeout=180)
    # one process, the same global batch of 16, the same seed
    _, single = _train(16, 1, DeviceParameters.SINGLE_DEVICE())
    for accumulation in (1, 2):
        r0, r1 = ranks[0][accumulation], ranks[1][accumulation]
        assert r0["replicated"] and r1["replicated"]
        assert r0["global_step"] == r1["global_step"] == single["global_step"] == 24
        for name, value in single["params"].items():
            # ranks stay bit-identical to each other ...
            assert torch.equal(r0["params"][name], r1["params"][name]), name
            # ... and match the single-process run on the whole batch
            torch.testing.assert_close(r0["params"][name], value, atol=ATOL, rtol=1e-4)
        # the mean of the two ranks' per-step losses is the single-process loss
        per_step = (r0["losses"] + r1["losses"]) / 2
        if accumulation == 2:
            per_step = per_step.view(-1, 2).mean(dim=1)
        torch.testing.assert_close(per_step, single["losses"], atol=ATOL, rtol=1e-4)
        # the two ranks really saw different data
        assert not torch.equal(r0["losses"], r1["losses"])


def test_world_owns_and_destroys_its_process_group_and_ranks_agree():
    r0, r1 = spawn_world(2, _owned_world_run, timeout=180)
    assert not r0["pg_alive_after_fit"] and not r1["pg_alive_after_fit"]
    assert r0["run_name"] == r1["run_name"]
    assert (r0["dp"], r1["dp"]) == ((0, 2), (1, 2))
    # logged metrics are reduced over ranks: every rank computes the same values
    assert r0["val_logs"] == r1["val_logs"] and len(r0["val_logs"]) == 2
    assert r0["train_logs"] == r1["train_logs"]
    for name in r0["params"]:
        assert torch.equal(r0["params"][name], r1["params"][name])

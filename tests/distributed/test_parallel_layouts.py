"""More layouts on real gloo ranks: HSDP (2 x 2 on 4 ranks) against one process, compiled
FSDP2 against eager FSDP2, and gradient accumulation that skips communication on
micro-steps."""

import contextlib

import torch
import torch.distributed as dist

from dream_trainer import DeviceParameters, TrainerConfig, TrainingParameters
from dream_trainer.testing import ToyTrainer, spawn_world

ATOL, RTOL = 1e-5, 1e-4


def _run(device_parameters, batch_size, accumulation=1):
    config = TrainerConfig(
        root_dir="runs",
        seed=5,
        device_parameters=device_parameters,
        training_parameters=TrainingParameters(
            n_epochs=1, gradient_accumulation_steps=accumulation, num_sanity_val_steps=0
        ),
    )
    trainer = ToyTrainer(config, batch_size=batch_size, shuffle=True)
    trainer.fit()
    params = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
              for k, v in trainer.model.state_dict().items()}
    compiled = {name: (isinstance(c.module, torch.nn.Linear), c.options) for name, c in trainer.compiled_modules.items()}
    return {"params": params, "losses": torch.stack(trainer.step_losses), "steps": trainer.global_step,
            "compiled_modules": compiled, "sharded": list(trainer.fsdp_modules("model"))}


@contextlib.contextmanager
def _count_gradient_reductions(counts):
    """Count FSDP2's gradient reduce-scatters (the collective it issues per backward)."""
    original = dist.reduce_scatter_single

    def counting(*args, **kwargs):
        counts["reduce_scatter"] += 1
        return original(*args, **kwargs)

    dist.reduce_scatter_single = counting
    try:
        yield counts
    finally:
        dist.reduce_scatter_single = original


def _two_rank_runs():
    dist.init_process_group("gloo")
    out = {}
    for accumulation, batch in ((1, 8), (2, 4)):
        counts = {"reduce_scatter": 0}
        with _count_gradient_reductions(counts):
            result = _run(DeviceParameters.FSDP(), batch_size=batch, accumulation=accumulation)
        out[f"accumulation_{accumulation}"] = {**result, **counts}
    out["compiled"] = _run(DeviceParameters.FSDP(compile_model=True), batch_size=8)
    return out


def test_accumulation_skips_communication_and_compile_matches_eager():
    r0, _ = spawn_world(2, _two_rank_runs, timeout=400)
    one, two = r0["accumulation_1"], r0["accumulation_2"]
    assert one["steps"] == two["steps"] == 12
    # 2 FSDP parameter groups (the two Linear layers) x 12 optimizer steps, whatever the
    # number of micro-batches: micro-steps do not reduce gradients.
    assert one["reduce_scatter"] == two["reduce_scatter"] == 2 * 12
    for name, value in one["params"].items():  # and the result is the same
        torch.testing.assert_close(two["params"][name], value, atol=ATOL, rtol=RTOL)
    compiled, eager = r0["compiled"], one
    # what was compiled is recorded (what graph-break finding needs), the sharding too
    assert compiled["compiled_modules"] == {"model.0": (True, {}), "model.2": (True, {})}
    assert eager["compiled_modules"] == {} and compiled["sharded"] == eager["sharded"] == ["", "0", "2"]
    torch.testing.assert_close(compiled["losses"], eager["losses"], atol=ATOL, rtol=RTOL)
    for name, value in eager["params"].items():
        torch.testing.assert_close(compiled["params"][name], value, atol=ATOL, rtol=RTOL)


def _hsdp_run():
    dist.init_process_group("gloo")  # kept after fit() so the sharded params can be gathered
    return _run(DeviceParameters.HSDP(dp_shard=2), batch_size=4)  # 4 ranks x 4 = 16


def test_hsdp_on_four_ranks_matches_single_process():
    ranks = spawn_world(4, _hsdp_run, timeout=300)
    single = _run(DeviceParameters.SINGLE_DEVICE(), batch_size=16)
    for rank in ranks:
        assert rank["steps"] == single["steps"] == 12
        for name, value in single["params"].items():
            torch.testing.assert_close(rank["params"][name], value, atol=ATOL, rtol=RTOL)
    per_step = torch.stack([r["losses"] for r in ranks]).mean(dim=0)
    torch.testing.assert_close(per_step, single["losses"], atol=ATOL, rtol=RTOL)

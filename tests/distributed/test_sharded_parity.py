"""Two gloo ranks with FSDP2 (dp_shard=2, gradient accumulation 2) and tensor parallel
(tp=2) against one process on the same global batch and seed: per-step losses and final
parameters agree within float tolerance after 12 optimizer steps; FSDP2 with bf16 params
trains and reduces float32 gradients."""

import torch
import torch.distributed as dist

from dream_trainer import Callback, DeviceParameters, TrainerConfig, TrainingParameters
from dream_trainer.testing import ToyTrainer, spawn_world

ATOL, RTOL = 1e-5, 1e-4


def _run(device_parameters, batch_size, accumulation=1, callbacks=(), epochs=1):
    config = TrainerConfig(
        root_dir="runs",
        seed=11,
        device_parameters=device_parameters,
        training_parameters=TrainingParameters(
            n_epochs=epochs, gradient_accumulation_steps=accumulation, num_sanity_val_steps=0, gradient_clip_val=5.0
        ),
        callbacks=list(callbacks),
    )
    trainer = ToyTrainer(config, batch_size=batch_size, shuffle=True, hidden=16)
    trainer.fit()
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().clone()
            for k, v in trainer.model.state_dict().items()}
    return {"params": full, "losses": torch.stack(trainer.step_losses).float(), "steps": trainer.global_step}


class GradDtypes(Callback):
    """Records the dtype of the (reduced, sharded) gradients the optimizer sees."""

    def __init__(self):
        self.dtypes = set()
        self.sharded = set()

    def pre_optimizer_step(self, model, optimizer):
        for p in model.parameters():
            self.dtypes.add(p.grad.dtype)
            self.sharded.add(type(p.grad).__name__)


def _sharded_runs():
    dist.init_process_group("gloo")  # reused by every fit below
    grads = GradDtypes()
    return {
        # global batch 16 = 2 ranks x 2 micro-batches x 4
        "fsdp": _run(DeviceParameters.FSDP(), batch_size=4, accumulation=2),
        # both ranks see the same batch of 16; the hidden layer is split over them
        "tp": _run(DeviceParameters(dp_replicate=1, tensor_parallel=2), batch_size=16),
        "fsdp_bf16": {
            **_run(DeviceParameters.FSDP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), batch_size=8,
                   callbacks=[grads], epochs=4),
            "grad_dtypes": sorted(str(d) for d in grads.dtypes),
            "grad_types": sorted(grads.sharded),
        },
    }


def test_fsdp_and_tp_match_single_process_and_bf16_fsdp_trains():
    ranks = spawn_world(2, _sharded_runs, timeout=240)
    single = _run(DeviceParameters.SINGLE_DEVICE(), batch_size=16)
    assert single["steps"] == 12
    for kind in ("fsdp", "tp"):
        r0, r1 = ranks[0][kind], ranks[1][kind]
        assert r0["steps"] == r1["steps"] == 12, kind
        for name, value in single["params"].items():
            assert torch.equal(r0["params"][name], r1["params"][name]), (kind, name)
            torch.testing.assert_close(r0["params"][name], value, atol=ATOL, rtol=RTOL, msg=f"{kind} {name}")
        if kind == "fsdp":  # each rank's micro-batch losses average to the global loss
            per_step = ((r0["losses"] + r1["losses"]) / 2).view(-1, 2).mean(dim=1)
        else:  # tensor parallel: both ranks compute the full loss
            per_step = r0["losses"]
            torch.testing.assert_close(r1["losses"], r0["losses"])
        torch.testing.assert_close(per_step, single["losses"], atol=ATOL, rtol=RTOL, msg=kind)
    # FSDP2 with bf16 parameters: the loss falls and the gradients the optimizer sees are the
    # float32 sharded (DTensor) gradients of the float32 master parameters.
    bf16 = ranks[0]["fsdp_bf16"]
    losses = bf16["losses"]
    assert len(losses) == 48 and losses[-12:].mean() < 0.6 * losses[:12].mean()
    assert bf16["grad_dtypes"] == ["torch.float32"] and bf16["grad_types"] == ["DTensor"]

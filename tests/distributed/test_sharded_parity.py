"""Two gloo ranks with FSDP2 (dp_shard=2, gradient accumulation 2) and tensor parallel
(tp=2) against one process on the same global batch and seed: per-step losses and final
parameters agree within float tolerance after 12 optimizer steps; FSDP2 with bf16 params
trains and reduces float32 gradients."""

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate

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


def _mixed_clip():
    """A tensor-parallel layer next to a plain (replicated) one: the world's norm and
    clipping handle the mix and agree with the norm of the full gradients."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from dream_trainer import DistributedWorld

    world = DistributedWorld(DeviceParameters(dp_replicate=1, tensor_parallel=2))
    world.launch()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
    full_model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
    full_model.load_state_dict(model.state_dict())
    parallelize_module(model, world.get_mesh("tp"), {"0": ColwiseParallel(output_layouts=Replicate())})
    x = torch.randn(5, 4)
    model(x).pow(2).sum().backward()
    full_model(x).pow(2).sum().backward()
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in full_model.parameters()]))
    norm = world.clip_grad_norm_(model.parameters(), max_norm=0.5)
    clipped = torch.linalg.vector_norm(torch.stack([
        (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).norm() for p in model.parameters()
    ]))
    kinds = sorted({type(p.grad).__name__ for p in model.parameters()})
    world.teardown()
    return {"norm": norm, "expected": expected, "clipped": clipped, "kinds": kinds}


def _sharded_runs():
    dist.init_process_group("gloo")  # reused by every fit below
    grads = GradDtypes()
    return {
        "mixed_clip": _mixed_clip(),
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
    # clipping a mix of tensor-parallel DTensor and plain gradients
    for rank in ranks:
        mixed = rank["mixed_clip"]
        assert mixed["kinds"] == ["DTensor", "Tensor"]
        torch.testing.assert_close(mixed["norm"], mixed["expected"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mixed["clipped"], torch.tensor(0.5), rtol=1e-4, atol=1e-5)
    # FSDP2 with bf16 parameters: the loss falls and the gradients the optimizer sees are the
    # float32 sharded (DTensor) gradients of the float32 master parameters.
    bf16 = ranks[0]["fsdp_bf16"]
    losses = bf16["losses"]
    assert len(losses) == 48 and losses[-12:].mean() < 0.6 * losses[:12].mean()
    assert bf16["grad_dtypes"] == ["torch.float32"] and bf16["grad_types"] == ["DTensor"]

"""DistributedWorld in one process: launch/teardown, collectives, gradient norm and clipping."""

import torch
import torch.distributed as dist

from dream_trainer import DeviceParameters, DistributedWorld


def test_one_rank_world_launches_and_tears_down():
    world = DistributedWorld(DeviceParameters.SINGLE_DEVICE())
    world.launch()
    try:
        assert dist.is_initialized() and world.world_size == 1 and world.dp_rank == 0 and world.dp_size == 1
        assert world.mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "cp", "tp")
        t = torch.tensor([2.0])
        assert world.all_reduce(t, "mean") is t and t.item() == 2.0
        assert world.global_agreement((1, "a")) and world.broadcast_object({"x": 1}) == {"x": 1}
    finally:
        world.teardown()
    assert not dist.is_initialized()
    world.teardown()  # idempotent


def test_gradient_norm_and_clipping_match_torch_on_mixed_dtypes():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4, dtype=torch.float64))]
    for p in params:
        p.grad = torch.randn_like(p) * 10
    reference = [p.grad.clone() for p in params]
    expected = torch.linalg.vector_norm(torch.stack([g.double().norm() for g in reference]))
    world = DistributedWorld(DeviceParameters.SINGLE_DEVICE())
    assert torch.allclose(world.total_gradient_norm(params).double(), expected)
    before = world.clip_grad_norm_(params, max_norm=1.0)
    assert torch.allclose(before.double(), expected)
    after = torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in params]))
    assert torch.allclose(after, torch.tensor(1.0, dtype=torch.float64), atol=1e-5)
    for p, g in zip(params, reference):  # same direction
        assert torch.allclose(p.grad.double() * (expected / after), g.double(), rtol=1e-4)

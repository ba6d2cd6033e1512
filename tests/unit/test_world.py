"""DistributedWorld in one process: launch/teardown, collectives, gradient norm and clipping."""

import torch
import torch.distributed as dist

from dream_trainer import DeviceParameters, DistributedWorld


def test_one_rank_world_launches_and_tears_down():
    world = DistributedWorld(DeviceParameters.SINGLE_DEVICE())
    world.launch()
    try:
        assert dist.is_initialized() and world.world_size == 1 and world.dp_rank == 0 and world.dp_size == 1
        assert world.mesh.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
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


def _timeouts(world):
    """The timeout of every group of the world's mesh (and the default group), in seconds."""
    groups = [dist.group.WORLD, *world.mesh.get_all_groups()]
    return {g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups}


def test_every_mesh_group_gets_the_init_timeout_then_the_tight_one():
    world = DistributedWorld(DeviceParameters.SINGLE_DEVICE(init_timeout_s=77, timeout_s=11))
    world.launch()
    try:
        assert _timeouts(world) == {77.0}  # torch gives mesh subgroups 30 minutes by default
        group = world.new_group(backend="gloo")
        assert group._get_backend(torch.device("cpu")).options._timeout.total_seconds() == 77.0
        world.relax_timeout()
        assert _timeouts(world) == {11.0} and world.timeout.total_seconds() == 11.0
        assert group._get_backend(torch.device("cpu")).options._timeout.total_seconds() == 11.0
    finally:
        world.teardown()


def test_the_first_step_of_every_fit_relaxes_the_timeout_also_after_a_resume():
    from dream_trainer import Callback, CheckpointCallback, CheckpointParameters, TrainerConfig, TrainingParameters
    from dream_trainer.testing import ToyTrainer

    seen = []

    class Timeouts(Callback):
        def pre_train_step(self, batch, batch_idx):
            seen.append((self.trainer.global_step, _timeouts(self.trainer.world)))

    def fit(max_steps):
        params = DeviceParameters.SINGLE_DEVICE(init_timeout_s=77, timeout_s=11)
        saver = CheckpointCallback(CheckpointParameters(root_dir="ckpt", every_n_steps=2))
        config = TrainerConfig(run_name="r", device_parameters=params, callbacks=[Timeouts(), saver],
                               training_parameters=TrainingParameters(max_steps=max_steps, n_epochs=None, num_sanity_val_steps=0))
        ToyTrainer(config).fit()

    fit(2)
    fit(4)  # resumes at step 2: its first step is global step 3
    assert seen == [(0, {77.0}), (1, {11.0}), (2, {77.0}), (3, {11.0})]


def test_the_gradient_grouping_kept_for_a_list_follows_missing_and_changed_gradients():
    """The grouping of a parameter list is kept between calls (the per-step norm path): a
    gradient that goes missing is grouped again, and the norm
    stays exact; a parameter replaced in the list is grouped by its own kind; lists made per
    call do not pile up."""
    world = DistributedWorld(DeviceParameters.SINGLE_DEVICE())
    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))]

    def norm_of(grads):
        return torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads]))

    params[0].grad, params[1].grad = torch.full((3,), 2.0), torch.full((2,), 1.0)
    assert torch.allclose(world.total_gradient_norm(params).double(), norm_of([params[0].grad, params[1].grad]))
    assert world.total_gradient_norm(params).item() == world.total_gradient_norm(params).item()  # the kept plan
    params[1].grad = None  # a parameter without gradient this step
    assert torch.allclose(world.total_gradient_norm(params).double(), norm_of([params[0].grad]))
    params[1] = torch.nn.Parameter(torch.randn(2, dtype=torch.float64))  # the list changed: another kind
    params[1].grad = torch.full((2,), 3.0, dtype=torch.float64)
    assert torch.allclose(world.total_gradient_norm(params).double(), norm_of([params[0].grad, params[1].grad]))
    assert len(world._gradient_groups(params)) == 2
    for _ in range(50):  # a new list each call
        world.total_gradient_norm(list(params))
    assert len(world._grad_plans) <= 8

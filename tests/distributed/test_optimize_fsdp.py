"""OptimizeFSDPCallback on 2 gloo ranks: the traced orders are the blocks' real forward order and its
reverse, the prefetch lists are what `prefetch` asks for, and the losses do not change."""

import torch
from torch import nn

from dream_trainer import DeviceParameters, TrainerConfig, TrainingParameters
from dream_trainer.callbacks import OptimizeFSDPCallback
from dream_trainer.testing import ToyTrainer, spawn_world


class Block(nn.Module):
    def __init__(self, n_in, n_out):
        super().__init__()
        self.layer = nn.Linear(n_in, n_out)

    def forward(self, x):
        return torch.tanh(self.layer(x))


class Net(nn.Module):
    """Four blocks registered in an order that is NOT the order they run in, and a fifth that
    never runs: the traced order must come from running, not from registration."""

    def __init__(self):
        super().__init__()
        self.c, self.a, self.d, self.b, self.unused = Block(16, 16), Block(8, 16), Block(16, 1), Block(16, 16), Block(4, 4)

    def forward(self, x):
        return self.d(self.c(self.b(self.a(x))))


class Blocks(ToyTrainer):
    def configure_models(self):
        self.model = Net()

    def apply_fully_shard(self, fsdp_config):
        from torch.distributed.fsdp import fully_shard

        for block in self.model.children():
            fully_shard(block, **fsdp_config)
        fully_shard(self.model, **fsdp_config)

    def configure_optimizers(self):
        used = [p for name, block in self.model.named_children() if name != "unused" for p in block.parameters()]
        self.optimizer = torch.optim.SGD(used, lr=self.lr)


def _prefetch_lists(trainer):
    """What FSDP2 holds as each module's prefetch targets (its own state objects)."""
    modules = trainer.fsdp_modules("model")
    by_state = {id(m._get_fsdp_state()): path for path, m in modules.items()}
    out = {}
    for path, module in modules.items():
        state = module._get_fsdp_state()
        out[path] = ([by_state[id(s)] for s in state._states_to_forward_prefetch],
                     [by_state[id(s)] for s in state._states_to_backward_prefetch])
    return out


def _run(root, prefetch):
    callbacks = [OptimizeFSDPCallback(prefetch=prefetch)] if prefetch else []
    config = TrainerConfig(root_dir=str(root), run_name="r", seed=1, device_parameters=DeviceParameters.FSDP(dp_shard=2),
                           training_parameters=TrainingParameters(n_epochs=1, num_sanity_val_steps=0), callbacks=callbacks)
    trainer = Blocks(config, batch_size=8)
    trainer.fit()
    out = {"losses": [x.item() for x in trainer.step_losses], "prefetch": _prefetch_lists(trainer)}
    if prefetch:
        (cb,) = callbacks
        out.update(forward=cb.forward_order["model"], backward=cb.backward_order["model"], applied=cb.applied)
    return out


def test_traced_order_prefetch_lists_and_unchanged_losses(tmp_path):
    plain, _ = spawn_world(2, _run, str(tmp_path / "plain"), 0, timeout=120)
    one, one_r1 = spawn_world(2, _run, str(tmp_path / "one"), 1, timeout=120)
    two, _ = spawn_world(2, _run, str(tmp_path / "two"), 2, timeout=120)
    assert one["applied"] and one["forward"] == ["", "a", "b", "c", "d"] == one_r1["forward"]  # the run order
    assert one["backward"] == ["", "d", "c", "b", "a"]  # its reverse (the root's gradient arrives first)
    assert one["prefetch"]["a"] == (["b"], [])  # a: forward -> b; last in backward: nothing
    assert one["prefetch"]["b"] == (["c"], ["a"]) and one["prefetch"][""] == (["a"], ["d"])
    assert two["prefetch"]["b"] == (["c", "d"], ["a"]) and two["prefetch"]["d"] == ([], ["c", "b"])
    assert one["prefetch"]["unused"] == two["prefetch"]["unused"] == ([], [])  # never ran: never prefetched
    assert plain["prefetch"]["b"] == ([], [])  # without the callback nothing is set
    assert one["losses"] == plain["losses"] == two["losses"]  # prefetching moves communication, not math

"""The run's facts on 2 gloo ranks: ``trainer.total_steps`` is the same on both ranks when
their loaders differ in length (the agreed epoch length), ``model_flops_per_token`` of a
sharded model (FSDP2) is the full model's on every rank, and ``world.memory_status()``
reads each rank's own process."""

import os

from dream_trainer import Callback, DeviceParameters, TrainerConfig, TrainingParameters
from dream_trainer.testing import ToyTrainer, spawn_world

TOY_FLOPS = 6.0 * (8 * 16 + 16 + 16 * 1 + 1)


class Facts(Callback):
    def post_setup(self):
        trainer = self.trainer
        self.seen = (trainer.total_steps, trainer.model_flops_per_token, trainer.world.memory_status())


def _run(root, layout):
    facts = Facts()
    device = DeviceParameters.DDP() if layout == "ddp" else DeviceParameters.FSDP(dp_shard=2)
    config = TrainerConfig(root_dir=root, run_name="r", seed=3, device_parameters=device, callbacks=[facts],
                           training_parameters=TrainingParameters(n_epochs=1, num_sanity_val_steps=0,
                                                                  gradient_accumulation_steps=2))
    # 100 samples: 75 for training, sliced over the ranks: 38 batches of 1 on rank 0, 37 on rank 1.
    trainer = ToyTrainer(config, n_samples=100, batch_size=1, sampler="random", with_validation=False)
    trainer.fit()
    total, flops, memory = facts.seen
    return {"total": total, "steps": trainer.global_step, "flops": flops, "pid": os.getpid(),
            "rss": memory.rss, "device": memory.device.type, "len": len(trainer.train_dataloader)}


def test_total_steps_and_flops_agree_across_ranks(tmp_path):
    for layout in ("ddp", "fsdp"):
        zero, one = spawn_world(2, _run, str(tmp_path / layout), layout, timeout=120)
        assert (zero["len"], one["len"]) == (38, 37), layout
        assert zero["total"] == one["total"] == zero["steps"] == one["steps"] == 19, layout  # ceil(37 / 2)
        assert zero["flops"] == one["flops"] == TOY_FLOPS, layout  # sharded parameters count in full
        assert zero["pid"] != one["pid"] and zero["rss"] > 50 * 2**20 and one["rss"] > 50 * 2**20
        assert zero["device"] == one["device"] == "cpu"

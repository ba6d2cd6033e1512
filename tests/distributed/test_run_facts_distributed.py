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


class Counts(Callback):
    """Asks for batch counts on the ranks in `asking`; records the world's totals on log steps."""

    def __init__(self, asking):
        self.asking, self.seen = asking, []

    def pre_fit(self):
        if self.trainer.world.rank in self.asking:
            self.trainer.request_batch_counts()

    def on_step_end(self, step):
        stats = self.trainer.step_stats
        if self.trainer.is_log_step:
            self.seen.append((step, stats.total_samples, stats.world_samples))


def _counts(root, asking):
    import logging

    warned = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("dream_trainer.trainer.metric_log").addHandler(handler)
    counts = Counts(asking)
    config = TrainerConfig(root_dir=root, run_name="c", seed=3, device_parameters=DeviceParameters.DDP(),
                           callbacks=[counts], training_parameters=TrainingParameters(
                               n_epochs=1, max_steps=6, num_sanity_val_steps=0))
    config.logging_parameters.log_every_n_steps = 2
    ToyTrainer(config, n_samples=64, batch_size=3, with_validation=False).fit()
    return counts.seen, [w for w in warned if "batch counts were asked for" in w]


def test_world_batch_counts_are_summed_only_where_every_rank_counts(tmp_path):
    (zero, quiet0), (one, quiet1) = spawn_world(2, _counts, str(tmp_path / "both"), (0, 1), timeout=120)
    assert [step for step, _, _ in zero] == [2, 4, 6] and quiet0 == quiet1 == []
    for (step, mine, world), (_, theirs, world1) in zip(zero, one):
        assert mine == theirs == 3 * step and world == world1 == mine + theirs  # each rank's batches of 3
    (zero, warned0), (one, warned1) = spawn_world(2, _counts, str(tmp_path / "one"), (0,), timeout=120)
    assert [mine for _, mine, _ in zero] == [6, 12, 18] and [mine for _, mine, _ in one] == [None] * 3
    assert all(world is None for run in (zero, one) for _, _, world in run)  # not rank 0's count called the world's
    assert len(warned0) == len(warned1) == 1 and "on 1 of 2 ranks" in warned0[0]  # said once, on every rank

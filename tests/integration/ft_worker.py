"""One replica group for the fault-tolerance tests: ToyTrainer (a small MLP, SGD) on a
`FaultTolerantSampler`, recording the sample indices of every step.

    python ft_worker.py --group 1 --root DIR --steps 40 [--nproc 2 --parallel fsdp] [--die-at 10]

``--die-at K``: SIGKILL this process in step K after its backward, before the gradient
all-reduce (the other groups are then in that all-reduce with a dead peer).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import (
    Callback,
    CheckpointCallback,
    CheckpointParameters,
    DeviceParameters,
    FaultToleranceCallback,
    FaultToleranceParameters,
    LoggerCallback,
    LoggingParameters,
    TrainerConfig,
    TrainingParameters,
    entrypoint,
)
from dream_trainer.ft import FaultTolerantSampler
from dream_trainer.testing import ToyTrainer
from dream_trainer.testing.toy import toy_data


class Worker(ToyTrainer):
    def __init__(self, config: TrainerConfig, args: argparse.Namespace):
        super().__init__(config, n_samples=args.samples, batch_size=4, hidden=32, lr=0.05)
        self.args = args

    def configure_dataloaders(self) -> tuple[Any, Any]:
        x, y = toy_data(self.n_samples, self.in_features)
        data = TensorDataset(x, y, torch.arange(self.n_samples))
        sampler = FaultTolerantSampler(data, self.batch_size, self.world, seed=self.seed or 0)
        return DataLoader(data, batch_sampler=sampler), None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y, index = batch
        time.sleep(self.args.delay_ms / 1000)  # a slower step: the kill lands mid-run
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.backward(loss)
        if self.args.die_at == self.global_step + 1:
            os.kill(os.getpid(), signal.SIGKILL)  # after backward, before the gradient all-reduce
        self.step(self.optimizer)
        self.last_indices = index.tolist()
        return {"loss": loss}


class Samples(Callback[Worker]):
    """Appends {step, committed, participants, indices} per optimizer step to
    <group dir>/samples.rank<R>.jsonl."""

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        trainer = self.trainer
        record = {"step": trainer.global_step, "committed": not trainer.step_skipped,
                  "participants": trainer.world.participants, "indices": trainer.last_indices}
        with open(trainer.run_dir / f"samples.rank{trainer.world.rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


def main() -> Worker:
    p = argparse.ArgumentParser()
    p.add_argument("--group", type=int, required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--run-name", default="ft")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--delay-ms", type=float, default=30.0)
    p.add_argument("--die-at", type=int, default=None)
    p.add_argument("--checkpoint-interval", type=int, default=None)
    p.add_argument("--max-failures", type=int, default=None)
    p.add_argument("--parallel", choices=["ddp", "fsdp"], default="ddp")
    args = p.parse_args()
    device = DeviceParameters.FSDP() if args.parallel == "fsdp" else DeviceParameters.DDP()
    config = TrainerConfig(
        experiment="ft", run_name=args.run_name, root_dir=args.root, seed=0, device_parameters=device,
        training_parameters=TrainingParameters(n_epochs=None, max_steps=args.steps, num_sanity_val_steps=0),
        logging_parameters=LoggingParameters(log_every_n_steps=1),
        callbacks=[
            FaultToleranceCallback(FaultToleranceParameters(replica_group_id=args.group, timeout_s=20.0,
                                                            checkpoint_interval=args.checkpoint_interval,
                                                            max_failures=args.max_failures)),
            Samples(),
            LoggerCallback(tensorboard=False),
            CheckpointCallback(CheckpointParameters(every_n_epochs=None)),
        ],
    )
    trainer = Worker(config, args)
    trainer.fit()
    return trainer


if __name__ == "__main__":
    raise SystemExit(entrypoint(main).exit_code)

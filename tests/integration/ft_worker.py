"""One replica group for the fault-tolerance tests: ToyTrainer (a small MLP, SGD) on a
`FaultTolerantSampler`, recording the sample indices of every step.

    python ft_worker.py --group 1 --root DIR --steps 40 [--nproc 2 --parallel fsdp] [--die-at 10]

``--die-at K``: SIGKILL this process in step K before its backward (the other groups are
then in that step's gradient all-reduce with a dead peer).
``--gate PATH``: after setup, write ``<group dir>/<PATH's name>.ready`` and wait for PATH to
exist before the first quorum (the test opens the gate once every group is ready: all of
them are then in the first quorum, whatever their start-up times).
``--hold PATH``: after the first step this group commits with a group lost (``--hold-after
N``: the N-th; with ``--hold-quorum P``: the N-th committed with P groups), write ``<group
dir>/<PATH's name>.held`` and wait for PATH (the test restarts the lost group meanwhile: it
is then up, heartbeating, when this group's next quorum forms).
``--tokens PATH --global-batch N``: train from a token file with a `TokenLoader` instead (a
global batch of N samples split over the quorum's groups, unevenly, with a loss weight, when
they do not divide it; the features are token windows).
``--reference``: the same trainer without fault tolerance (one process, no torchft, no
lighthouse), the uninterrupted run a fault-tolerant one is compared with; ``--group`` then
only names the directory.
``--start-groups N``: FaultToleranceParameters.start_groups (``--quorum-timeout`` its bound).
``--evil-heal PATH``: a malicious peer: the heal this group sends holds an object whose
unpickling would create the directory PATH (a receiver must refuse it, PATH never appears).
Every optimizer step's record in ``<group dir>/samples.rank<R>.jsonl`` holds its sample
indices, the quorum (participants, this group's replica rank), the micro-batch's
``loss_weight`` (null: an even share) and its loss as ``loss_sum`` (the mean loss times its
``count`` of targets), so that a step's global-batch mean loss is ``sum(loss_sum) /
sum(count)`` over the groups that committed it.
Each rank writes its model's final parameters to ``<group dir>/final.rank<R>.pt`` and the
addresses its servers listen on (`FaultTolerantWorld.addresses`) to
``<group dir>/addresses.rank<R>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
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
from dream_trainer.data import TokenLoader
from dream_trainer.fault_tolerance import FaultTolerantSampler
from dream_trainer.testing import ToyTrainer
from dream_trainer.testing.fault_tolerance import StartGate, wait_for_file
from dream_trainer.testing.toy import toy_data
from dream_trainer.fault_tolerance.world import FaultTolerantWorld


class Worker(ToyTrainer):
    def __init__(self, config: TrainerConfig, args: argparse.Namespace):
        super().__init__(config, n_samples=args.samples, batch_size=4, hidden=32, lr=0.05)
        self.args = args

    def configure_dataloaders(self) -> tuple[Any, Any]:
        if self.args.tokens is not None:  # windows of in_features + 1 tokens: features and a target
            return TokenLoader.for_trainer(self, self.args.tokens, self.in_features, return_ids=True), None
        x, y = toy_data(self.n_samples, self.in_features)
        data = TensorDataset(x, y, torch.arange(self.n_samples))
        sampler = FaultTolerantSampler(data, self.batch_size, self.world, seed=self.seed or 0)
        return DataLoader(data, batch_sampler=sampler), None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y, index = batch
        if self.args.tokens is not None:
            x, y = x.float() / 1000, y[:, -1:].float() / 1000
        time.sleep(self.args.delay_ms / 1000)  # a slower step: the kill lands mid-run
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.last_weight, self.last_count = getattr(batch, "loss_weight", None), y.numel()
        self.last_loss_sum = loss.item() * y.numel()  # the mean loss over this share's targets, as a sum
        if self.args.die_at == self.global_step + 1:
            os.kill(os.getpid(), signal.SIGKILL)  # before backward: the peers' all-reduce has a dead peer
        self.backward(loss)
        self.step(self.optimizer)
        self.last_indices = index.tolist()
        return {"loss": loss}


class Payload:
    """What a malicious peer sends in a heal: unpickled, it would run ``os.mkdir(path)``."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return os.mkdir, (self.path,)


class Samples(Callback[Worker]):
    """Appends {step, committed, participants, indices, ...} per optimizer step to
    <group dir>/samples.rank<R>.jsonl; the hold and the evil heal (see the module
    docstring); the servers' addresses. Without fault tolerance (``--reference``): the
    records alone, as one group of one."""

    def __init__(self, hold: str | None, overlap: bool, evil_heal: str | None = None, hold_after: int = 1,
                 hold_quorum: int | None = None):
        self.hold, self.overlap, self.evil_heal = Path(hold) if hold else None, overlap, evil_heal
        self.hold_after, self.hold_quorum, self.counted = hold_after, hold_quorum, 0

    def post_configure(self) -> None:
        world = self.trainer.world
        if not hasattr(world, "manager"):  # --reference: no fault tolerance
            return
        world.gradients.overlap = self.overlap
        if self.evil_heal is not None:  # sent beside the trainer's state in every heal from this group
            world.manager.register_state_dict_fn("payload", lambda state: None, lambda: Payload(self.evil_heal))
        path = self.trainer.run_dir / f"addresses.rank{world.rank}.json"
        path.write_text(json.dumps({**world.addresses, "pid": os.getpid()}))

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        trainer, world = self.trainer, self.trainer.world
        ft = hasattr(world, "manager")
        if self.hold is not None and ft and not trainer.step_skipped and (
                world.participants == self.hold_quorum if self.hold_quorum else world.replica_losses):
            self.counted += 1
            if self.counted >= self.hold_after:
                if world.rank == 0:
                    (trainer.run_dir / f"{self.hold.name}.held").touch()
                wait_for_file(self.hold)
                self.hold = None
        record = {"step": trainer.global_step, "committed": not trainer.step_skipped,
                  "participants": world.participants if ft else 1, "replica_rank": world.replica_rank if ft else 0,
                  "indices": trainer.last_indices, "weight": trainer.last_weight,
                  "loss_sum": trainer.last_loss_sum, "count": trainer.last_count,
                  "started_in_backward": world.gradients.started_in_backward if ft else 0,
                  "buckets": world.gradients.buckets if ft else 0}
        with open(trainer.run_dir / f"samples.rank{trainer.world.rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def post_fit(self) -> None:
        trainer = self.trainer
        torch.save({k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in trainer.model.state_dict().items()},
                   trainer.run_dir / f"final.rank{trainer.world.rank}.pt")


def main(argv: list[str] | None = None) -> Worker:
    """Parse `argv` (default: the command line), build this group's trainer and fit it."""
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
    p.add_argument("--start-groups", type=int, default=1)
    p.add_argument("--quorum-timeout", type=float, default=120.0)
    p.add_argument("--parallel", choices=["ddp", "fsdp"], default="ddp")
    p.add_argument("--gate", default=None)
    p.add_argument("--hold", default=None)
    p.add_argument("--hold-after", type=int, default=1, help="hold after this many steps committed with a group lost")
    p.add_argument("--hold-quorum", type=int, default=None, help="count only the steps committed with this many groups")
    p.add_argument("--reference", action="store_true", help="no fault tolerance: one process, the uninterrupted run")
    p.add_argument("--checkpoint-root", default=None, help="an explicit CheckpointParameters.root_dir")
    p.add_argument("--no-checkpoint", action="store_true")
    p.add_argument("--bucket-mb", type=float, default=None)
    p.add_argument("--no-overlap", action="store_true", help="every gradient all-reduce starts after backward")
    p.add_argument("--tokens", default=None, help="a token file: train from it with a TokenLoader")
    p.add_argument("--global-batch", type=int, default=8, help="with --tokens: samples per step over the groups")
    p.add_argument("--evil-heal", default=None, help="send a heal whose unpickling would mkdir this path")
    args = p.parse_args(argv)
    if args.bucket_mb is not None:
        FaultTolerantWorld.bucket_mb = args.bucket_mb
    device = DeviceParameters.FSDP() if args.parallel == "fsdp" else DeviceParameters.DDP()
    if args.reference:
        device = DeviceParameters.SINGLE_DEVICE()
    checkpoint = [] if args.no_checkpoint else [
        CheckpointCallback(CheckpointParameters(every_n_epochs=None, root_dir=args.checkpoint_root))]
    config = TrainerConfig(
        experiment="ft", run_name=args.run_name, root_dir=args.root, seed=0, device_parameters=device,
        training_parameters=TrainingParameters(n_epochs=None, max_steps=args.steps, num_sanity_val_steps=0,
                                               global_batch_size=args.global_batch if args.tokens else None),
        logging_parameters=LoggingParameters(log_every_n_steps=1),
        callbacks=[
            *([] if args.reference else [
                FaultToleranceCallback(FaultToleranceParameters(replica_group_id=args.group, timeout_s=20.0,
                                                                checkpoint_interval=args.checkpoint_interval,
                                                                max_failures=args.max_failures,
                                                                start_groups=args.start_groups,
                                                                quorum_timeout_s=args.quorum_timeout))]),
            Samples(args.hold, overlap=not args.no_overlap, evil_heal=args.evil_heal, hold_after=args.hold_after,
                    hold_quorum=args.hold_quorum),
            *([StartGate(args.gate)] if args.gate else []),
            LoggerCallback(tensorboard=False),
            *checkpoint,
        ],
    )
    trainer = Worker(config, args)
    trainer.fit()
    return trainer


if __name__ == "__main__":
    raise SystemExit(entrypoint(main).exit_code)

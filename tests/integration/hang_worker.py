"""One rank of a 2-rank `ToyTrainer` run (DDP over gloo) in which rank 1 gets stuck at step 3,
for the collective watchdog's tests (`test_hang_watchdog.py`).

    python hang_worker.py ROOT (data | callback) [--hang-report 2] [--timeout 120]

``data``: rank 1's dataset sleeps in ``__getitem__`` while fetching step 3's batch (a stuck
data loader). ``callback``: a callback blocks on rank 1 in ``post_train_step`` of step 3 (an
event nobody sets). Before it blocks, rank 1 writes the time into ``ROOT/stuck_at``. The
script runs ``fit()`` plainly: an exception out of it ends the process with status 1 and
its traceback; ``status=... exit_code=...`` is printed on every path.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader, Dataset

from dream_trainer import DeviceParameters, LoggingParameters, TrainerConfig, TrainingParameters
from dream_trainer.protocol.base import Callback
from dream_trainer.testing import ToyTrainer
from dream_trainer.testing.toy import toy_data

BATCH = 8
STUCK_STEP = 3


class SleepyData(Dataset):
    """The toy data, sharded by rank; on rank 1 the first sample of step 3 takes forever."""

    def __init__(self, rank: int, root: Path):
        x, y = toy_data(192)
        self.x, self.y, self.rank, self.root = x[rank::2], y[rank::2], rank, root

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        if self.rank == 1 and i == (STUCK_STEP - 1) * BATCH:
            (self.root / "stuck_at").write_text(repr(time.time()))
            time.sleep(600)  # a stuck loader: far beyond every bound of the test
        return self.x[i], self.y[i]


class BlocksOnRankOne(Callback):
    """Blocks rank 1 in post_train_step of step 3, waiting for an event nobody sets."""

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        trainer = self.trainer
        if trainer.world.rank == 1 and trainer.global_step == STUCK_STEP:
            (Path(trainer.config.root_dir) / "stuck_at").write_text(repr(time.time()))
            threading.Event().wait(600)


class Stuck(ToyTrainer):
    def __init__(self, config: TrainerConfig, mode: str):
        super().__init__(config, batch_size=BATCH, with_validation=False)
        self.mode = mode

    def configure_dataloaders(self) -> tuple[Any, Any]:
        if self.mode != "data":
            return super().configure_dataloaders()
        return DataLoader(SleepyData(self.world.rank, Path(self.config.root_dir)), batch_size=BATCH), None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("mode", choices=["data", "callback"])
    p.add_argument("--hang-report", type=float, default=2.0)
    p.add_argument("--hang-abort", type=float, default=4.0)
    p.add_argument("--timeout", type=float, default=120.0)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    params = DeviceParameters.DDP(init_timeout_s=args.timeout, timeout_s=args.timeout, hang_report_s=args.hang_report,
                                 hang_abort_s=args.hang_abort)
    config = TrainerConfig(root_dir=args.root, run_name="hang", device_parameters=params,
                           training_parameters=TrainingParameters(n_epochs=1, num_sanity_val_steps=0),
                           logging_parameters=LoggingParameters(log_every_n_steps=1),
                           callbacks=[BlocksOnRankOne()] if args.mode == "callback" else [])
    trainer = Stuck(config, args.mode)
    try:
        trainer.fit()
    finally:
        print(f"status={trainer.status} exit_code={trainer.exit_code}", flush=True)


if __name__ == "__main__":
    main()

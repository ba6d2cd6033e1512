"""Exit paths across processes: a failed rank whose process lingers releases its peers at
once (not at the process-group timeout or when it exits)."""

import time
from pathlib import Path

from dream_trainer import DeviceParameters, TrainerConfig, TrainingParameters
from dream_trainer.testing import ToyTrainer, spawn_world


class BreaksOnRankOne(ToyTrainer):
    def training_step(self, batch, batch_idx):
        if self.world.rank == 1 and self.global_step == 3:
            (Path(self.config.root_dir) / "rank1_raised").write_text(repr(time.time()))
            raise RuntimeError("rank 1 broke")
        return super().training_step(batch, batch_idx)


def _fail_and_linger(root):
    root = Path(root)
    # Timeouts far beyond the test's bound: only a released connection can end rank 0's wait.
    params = DeviceParameters.DDP(init_timeout_s=120, timeout_s=120)
    config = TrainerConfig(root_dir=str(root), run_name="r", device_parameters=params,
                           training_parameters=TrainingParameters(n_epochs=2, num_sanity_val_steps=0))
    trainer = BreaksOnRankOne(config, batch_size=8)
    try:
        trainer.fit()
    except Exception as exc:  # noqa: BLE001 - a user `except` block that keeps running
        if trainer.world.rank == 0:
            waited = time.time() - float((root / "rank1_raised").read_text())
            (root / "rank0_done").write_text("")
            return trainer.status, trainer.exit_code, waited, type(exc).__name__
        # Linger, holding the trainer (models, process groups), until rank 0 has failed.
        deadline = time.monotonic() + 60
        while not (root / "rank0_done").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return trainer.status, trainer.exit_code, time.monotonic() < deadline, str(exc)
    return "completed?", trainer.exit_code, None, None


def test_a_failed_rank_that_lingers_releases_its_peers(tmp_path):
    zero, one = spawn_world(2, _fail_and_linger, str(tmp_path), timeout=150)
    assert one == ("failed", 1, True, "rank 1 broke")  # rank 0 was done before rank 1 gave up lingering
    status, code, waited, error = zero
    assert status == "failed" and code == 1 and error == "RuntimeError"
    assert waited < 10, f"rank 0 waited {waited:.1f} s for the failed rank"

import os

import pytest
import torch

# One intra-op thread in the test process and in every process it starts (they inherit the
# variable; spawn_world's ranks set theirs from the core count): the suite runs several
# processes at once on CI's 2 cores, and two threads that share a core with another process
# make each parallel op wait for the slower one (5-8x slower steps when a core is busy).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    """Each test starts outside any launcher, in its own directory."""
    for name in list(os.environ):
        if name.startswith(("DREAM_TRAINER_", "SLURM_")) or name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    yield
    import torch.distributed as dist

    assert not dist.is_initialized(), "a test left a process group behind"

import os

import pytest


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    """Each test starts outside any launcher, in its own directory."""
    for name in list(os.environ):
        if name.startswith("DREAM_TRAINER_") or name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    yield
    import torch.distributed as dist

    assert not dist.is_initialized(), "a test left a process group behind"

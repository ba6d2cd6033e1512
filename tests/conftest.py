"""Which device each test needs.

Every test runs on the CPU, also on a machine with GPUs: CUDA is hidden from this process and
from every process a test starts (``CUDA_VISIBLE_DEVICES=""``, set before torch looks for a
GPU), so a trainer's ``device="auto"`` is the CPU and a test's tensors and the trainer's agree.

The ``cuda`` lane (tests/cuda, marker ``cuda``) exercises the CUDA paths: each test runs its
body in a fresh process that sees the machine's GPUs (`tests.cuda_lane.on_cuda`). Where there
is no CUDA GPU the lane is reported as skipped. ``pytest -m cuda`` runs the lane alone.
"""

import os

import pytest
import torch

from tests.cuda_lane import hide_cuda

# One intra-op thread in the test process and in every process it starts (they inherit the
# variable; spawn_world's ranks set theirs from the core count): the suite runs several
# processes at once on CI's 2 cores, and two threads that share a core with another process
# make each parallel op wait for the slower one (5-8x slower steps when a core is busy).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _launcher_variables() -> list[str]:
    """The variables a launcher (ours, torchrun, SLURM) sets, present in this process."""
    return [name for name in os.environ
            if name.startswith(("DREAM_TRAINER_", "SLURM_")) or name in _LAUNCHER_VARIABLES]


def _drop_launcher_variables() -> None:
    for name in _launcher_variables():
        del os.environ[name]


def pytest_configure(config):
    hide_cuda()  # before any test: none of them (nor the processes they start) sees a GPU
    _drop_launcher_variables()  # the session (and its session-scoped fixtures) starts outside any launcher


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before any fixture of the test is set up, module-, class- and session-scoped ones
    included: a variable an earlier test set (``entrypoint`` exports the run's name and seed
    into ``os.environ``, which no monkeypatch undoes) does not reach them, nor the processes
    they start."""
    _drop_launcher_variables()


def pytest_collection_modifyitems(config, items):
    """Tests under tests/cuda are the ``cuda`` lane; without a CUDA GPU they are skipped."""
    lane = [item for item in items
            if item.get_closest_marker("cuda") is not None or os.sep + "cuda" + os.sep in str(item.fspath)]
    if not lane:
        return
    from tests.cuda_lane import gpu_count

    count = gpu_count()
    for item in lane:
        item.add_marker(pytest.mark.cuda)
        if count == 0:
            item.add_marker(pytest.mark.skip(reason="no CUDA GPU on this machine (the cuda lane runs where one is)"))


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    """Each test starts outside any launcher (see `pytest_runtest_setup`: also before its
    wider-scoped fixtures), in its own directory."""
    for name in _launcher_variables():  # set by a wider-scoped fixture: removed for the test
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    yield
    import torch.distributed as dist

    assert not dist.is_initialized(), "a test left a process group behind"

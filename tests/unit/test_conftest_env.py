"""The suite's environment cleaning (tests/conftest.py) reaches wider-scoped fixtures: a
variable an earlier test module leaked into ``os.environ`` (``entrypoint`` exports the run's
name and seed there, and no monkeypatch undoes it) is gone before the next module's
module-scoped fixture runs, and so before any process that fixture starts."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

LEAKER = '''
import os

from dream_trainer.launch import entrypoint


def test_entrypoint_exports_the_run_identity_into_this_process():
    entrypoint(lambda: None, seed=7, argv=[])
    assert os.environ["DREAM_TRAINER_SEED"] == "7"  # leaked: nothing undoes it
    os.environ["SLURM_JOB_ID"] = "stale"
'''

READER = '''
import os
import subprocess
import sys

import pytest

SEEN = ("DREAM_TRAINER_SEED", "DREAM_TRAINER_RUN_NAME", "SLURM_JOB_ID")


@pytest.fixture(scope="module")
def child_env():
    """What a process started by a module-scoped fixture inherits."""
    code = "import os, sys; print(sorted(k for k in os.environ if k in sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *SEEN], capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="class")
def class_env():
    return sorted(k for k in os.environ if k in SEEN)


class TestAfterTheLeak:
    def test_a_module_scoped_fixture_and_its_child_see_no_stale_variable(self, child_env, class_env):
        assert child_env.strip() == "[]"
        assert class_env == []
'''


def test_a_variable_leaked_by_an_earlier_module_does_not_reach_the_next_modules_fixtures(tmp_path):
    (tmp_path / "test_a_leaks.py").write_text(textwrap.dedent(LEAKER))
    (tmp_path / "test_b_reads.py").write_text(textwrap.dedent(READER))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
         "-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path),
         str(tmp_path / "test_a_leaks.py"), str(tmp_path / "test_b_reads.py")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert "2 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0

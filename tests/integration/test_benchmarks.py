"""Every benchmark in benchmarks/ runs end to end in its smoke mode, so none can rot unseen.

Each script is run as CI would: ``python benchmarks/<name>.py --smoke --out <tmp>/<name>.json``
in a fresh process (two at a time: a smoke run is mostly starting Python and torch) (CUDA hidden and one intra-op thread: the environment tests/conftest.py
sets). It must exit 0 and write its JSON: where it ran (``machine``) and numbers that show it
measured something (`EXPECTED`: the script's own result fields, each a positive number).

The scripts are found in the folder: a new benchmark without a ``--smoke`` mode, or without
an entry in `EXPECTED`, fails here. A smoke run takes seconds to tens of seconds (most of it
starting Python and torch, in the script and in the ranks it spawns); nothing here depends on
how long it takes, within `TIMEOUT`.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
NOT_BENCHMARKS = {"common.py"}  # the scripts' shared helpers
SCRIPTS = sorted(path.stem for path in BENCHMARKS.glob("*.py") if path.name not in NOT_BENCHMARKS)
TIMEOUT = 240  # seconds per script: the slowest smoke runs (compile, fp8) take ~45 s on 2 busy cores

# script -> the numbers its JSON must hold (each > 0): proof that it measured, not only ran
EXPECTED: dict[str, Callable[[dict[str, Any]], list[float]]] = {
    "checkpoint": lambda r: [mode["blocked"] for mode in r["modes"].values()],
    "compile": lambda r: [row["tokens_per_s"] for row in r["rows"]],
    "data": lambda r: [row["token_loader_tok_s"] for row in r["loader"]] + [r["demo"]["demo_tok_s"]],
    "fp8": lambda r: [row["tokens_per_s"] for row in r["rows"]],
    "fsdp_prefetch": lambda r: [row["tokens_per_s"] for row in r["rows"].values()],
    "ft_recovery": lambda r: [s for row in r["rows"] for s in (*row["ddp_step_s"], *row["ft_step_s"])],
    "health": lambda r: [r["ms_per_step_without"], r["ms_per_step_with"]],
    "loop_cache": lambda r: [v for row in r["rows"].values() for v in (row["trainer_loop_us"], row["python_us"])],
    "overhead": lambda r: [variant["median_step_us"] for variant in r["variants"].values()],
    "parallel": lambda r: [layout["tokens_per_s_median"] for layout in r["layouts"].values()],
    "pipeline": lambda r: [row["tokens_per_s_median"] for row in r["rows"].values()],
    "step_anatomy": lambda r: [row["raw_step_us"] for row in r["rows"].values()],
    "step_cost": lambda r: [v for variant in r["variants"].values() for v in (variant["raw_step_us"], variant["step_us"])],
    "step_path": lambda r: [row["tokens_per_s"] for row in r["rows"]],
}


def _machine(result: dict[str, Any]) -> dict[str, Any] | None:
    """The ``machine`` record (`benchmarks/common.py:machine`), at the top or one level down."""
    if isinstance(result.get("machine"), dict):
        return result["machine"]
    nested = [value["machine"] for value in result.values() if isinstance(value, dict)
              and isinstance(value.get("machine"), dict)]
    return nested[0] if nested else None


def _tail(text: str, chars: int = 8000) -> str:
    return text[-chars:] if text else "(nothing)"


CONCURRENT = 2  # smoke runs at a time: each is mostly one core starting Python and torch (3 gained nothing here)


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess[str], Path]]:
    """Every benchmark's smoke run, `CONCURRENT` at a time (each in a directory of its own):
    ``{name: (the finished process, its JSON's path)}``."""
    from concurrent.futures import ThreadPoolExecutor

    root = tmp_path_factory.mktemp("smoke")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

    def run(name: str) -> tuple[subprocess.CompletedProcess[str], Path]:
        work = root / name
        work.mkdir()
        out = work / f"{name}.json"
        cmd = [sys.executable, str(BENCHMARKS / f"{name}.py"), "--smoke", "--out", str(out)]
        proc = subprocess.Popen(cmd, cwd=work, env={**env, "PYTHONFAULTHANDLER": "1"}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:  # this script fails (not every one): with every process's Python stacks
            os.killpg(proc.pid, signal.SIGABRT)  # faulthandler (PYTHONFAULTHANDLER) dumps them, then each ends
            try:
                stdout, stderr = proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                stdout, stderr = "", ""
            stderr = f"{stderr}\n(timed out after {TIMEOUT} s: the stacks above are every process's then, SIGABRT)"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever of its session is left
            except ProcessLookupError:
                pass
            proc.wait()
        return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr), out

    names = [name for name in SCRIPTS if name in EXPECTED]
    with ThreadPoolExecutor(CONCURRENT) as pool:
        return dict(zip(names, pool.map(run, names)))


@pytest.mark.parametrize("name", sorted(set(SCRIPTS) | set(EXPECTED)))
def test_benchmark_smoke_mode_writes_its_result(name, smoke_runs):
    script = BENCHMARKS / f"{name}.py"
    assert script.is_file(), f"EXPECTED names {name}, but there is no benchmarks/{name}.py: remove the entry"
    assert name in EXPECTED, f"benchmarks/{name}.py has no entry in EXPECTED: add the numbers its JSON must hold"
    proc, out = smoke_runs[name]
    assert proc.returncode == 0, (f"benchmarks/{name}.py --smoke exited {proc.returncode}\n--- stderr ---\n"
                                  f"{_tail(proc.stderr)}\n--- stdout ---\n{_tail(proc.stdout)}")
    assert out.is_file(), f"benchmarks/{name}.py --smoke wrote no {out.name}\n--- stdout ---\n{_tail(proc.stdout)}"
    result = json.loads(out.read_text())
    machine = _machine(result)
    assert machine and machine.get("torch"), f"{name}: no machine record (common.py:machine()) in {list(result)}"
    try:
        numbers = EXPECTED[name](result)
    except (KeyError, TypeError) as exc:
        pytest.fail(f"{name}: its JSON does not hold what EXPECTED reads ({exc!r}); its keys: {list(result)}")
    assert numbers, f"{name}: no results in its JSON"
    assert all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in numbers), f"{name}: {numbers}"

"""scripts/gpu_check.sh on a machine without a GPU: its preflight and bookkeeping, so the script a
lent GPU session runs cannot rot between the sessions that have one.

The GPU stages themselves need a GPU (they are what the script is for); here no stage is named,
and the script must still record where it ran, name an optional package that does not import
(a sixth GPU run lost eight tests to a torchft whose OpenTelemetry dependency was missing,
found only as test errors minutes later) and write its summary.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run_check(tmp_path: Path, pythonpath: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    results = tmp_path / "results"
    no_wheels = tmp_path / "no_wheels"
    no_wheels.mkdir()
    env = dict(os.environ, PYTHON=sys.executable, STAGES="none", WHEELS=str(no_wheels),
               PYTHONPATH=pythonpath)
    env.pop("OUT", None)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(results)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    return proc, results


def test_the_gpu_check_names_an_optional_package_that_does_not_import_before_any_stage(tmp_path: Path) -> None:
    broken = tmp_path / "shadow" / "torchft"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'opentelemetry.exporter.otlp.common'\")\n")
    proc, results = _run_check(tmp_path, str(tmp_path / "shadow"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    environment = (results / "environment.txt").read_text()
    assert f"torch {__import__('torch').__version__}" in environment
    # torchft alone: the four other optional packages import, and are not named
    warnings = [line for line in environment.splitlines() if line.startswith("WARNING: import")]
    assert warnings == ["WARNING: import torchft fails: ModuleNotFoundError: No module named "
                        "'opentelemetry.exporter.otlp.common' (scripts/gpu_wheels.sh fetches the wheels)"]
    assert (results / "summary.txt").exists()
    assert "=== summary (0 failed)" in proc.stdout


"""``benchmarks/pipeline.py --smoke`` runs every row (DDP and the 4 schedules) in the same 2
processes and splits each rank's schedule time into compute, transfer and idle (issue 40: its
"bubble" was 1 - compute / step time, counting the gloo transfers as bubble)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dream_trainer.pipeline import expected_bubble

ROOT = Path(__file__).resolve().parents[2]


def test_pipeline_benchmark_smoke_splits_compute_transfer_and_idle(tmp_path):
    out = tmp_path / "pipeline.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pipeline.py"), "--smoke", "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert {row["schedule"] for row in rows.values()} == {None, "GPipe", "1F1B", "Interleaved1F1B",
                                                          "InterleavedZeroBubble"}
    for name, row in rows.items():
        if row["schedule"] is None:
            continue
        for run in row["runs"]:
            parts = [run["compute"], run["transfer"], run["idle"]]
            assert all(0 <= p <= 1 for p in parts[:2]) and sum(parts) == pytest.approx(1.0), (name, parts)
            assert run["compute"] > 0 and run["transfer"] > 0, (name, run)  # the stages ran, and sent
            assert 0 <= run["recv_wait"] <= run["idle"] + 1e-9, (name, run)
        v = 2 if row["schedule"].startswith("Interleaved") else 1
        assert row["expected_bubble"] == expected_bubble(row["schedule"], pp=2, stages_per_rank=v,
                                                         microbatches=row["microbatches"])
        assert row["estimated_ms"] > 0, (name, row)  # the cost model ran (the demo gives it the sample size)
    assert "transfer" in proc.stdout and "idle" in proc.stdout and "est. ms" in proc.stdout

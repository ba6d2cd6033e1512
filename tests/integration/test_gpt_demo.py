"""The GPT demo end to end (shortened): one process in-process, and 2 ranks spawned by the
demo's own `entrypoint` (--nproc 2, i.e. torch.distributed.run). TensorBoard event files
and metrics.jsonl are read back."""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "gpt" / "train.py"
SHORT = ["--steps", "40", "--val-every", "20", "--n-chars", "120000", "--val-batches", "4"]


def _load_demo():
    from tests.demos import load

    return load("gpt")


def _scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_demo_single_process_learns_and_logs(tmp_path):
    demo = _load_demo()
    trainer = demo.main([*SHORT, "--root-dir", str(tmp_path), "--run-name", "single"])
    log_dir = tmp_path / "gpt" / "single" / "logs"
    assert trainer.global_step == 40
    scalars = _scalars(log_dir)
    assert {"train/loss", "train/lr", "train/grad_norm", "val/loss"} <= set(scalars)
    assert [step for step, _ in scalars["train/loss"]] == [10, 20, 30, 40]
    val = scalars["val/loss"]
    assert [step for step, _ in val] == [20, 40]
    initial = trainer.callbacks["ValidationHistory"].history[0][1]  # sanity check, step 0
    assert initial > 3.0 and val[-1][1] < 0.75 * initial  # clearly falling
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    jsonl_val = [r["val/loss"] for r in records if "val/loss" in r]
    assert jsonl_val == pytest.approx([v for _, v in val], rel=1e-6)


def test_demo_two_ranks_via_entrypoint(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(DEMO), "--nproc", "2", *SHORT, "--root-dir", str(tmp_path), "--run-name", "ddp"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks: its own session
        out, _ = proc.communicate()
        pytest.fail(f"the 2-rank demo timed out:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    assert out.count("validation loss by step") == 1  # printed by rank zero only
    scalars = _scalars(tmp_path / "gpt" / "ddp" / "logs")
    val = [v for _, v in scalars["val/loss"]]
    assert len(val) == 2 and val[-1] < val[0]


def _train_losses(log_dir):
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


def test_demo_sigterm_then_resume_matches_an_uninterrupted_run(tmp_path):
    """SIGTERM from outside: the demo saves at the next step boundary and exits with 75;
    run again with the same run name, it resumes and logs exactly (bitwise) the losses of
    a run that was never stopped."""
    args = [*SHORT, "--root-dir", str(tmp_path), "--checkpoint-every", "10", "--log-every", "5"]
    demo = _load_demo()
    demo.main([*args, "--run-name", "full"])
    full = _train_losses(tmp_path / "gpt" / "full" / "logs")

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, str(DEMO), *args, "--run-name", "cut"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    checkpoints = tmp_path / "gpt" / "cut" / "checkpoints"
    try:
        deadline = time.monotonic() + 180
        while not (checkpoints / "step_000000010").is_dir():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 75, out[-3000:]
    match = re.search(r"preempted at step (\d+)", out)
    assert match, out[-3000:]
    stopped = int(match.group(1))
    assert 10 <= stopped < 40 and (checkpoints / f"step_{stopped:09d}").is_dir()

    trainer = demo.main([*args, "--run-name", "cut"])
    assert trainer.callbacks["CheckpointCallback"].resumed_from == checkpoints / f"step_{stopped:09d}"
    assert trainer.global_step == 40 and trainer.status == "completed"
    resumed = _train_losses(tmp_path / "gpt" / "cut" / "logs")
    assert resumed == full  # every logged step, before and after the stop, bit for bit


def test_demo_profiled_for_a_short_schedule_then_keeps_training(tmp_path):
    import torch

    from dream_trainer.callbacks import ProfileCallback

    demo = _load_demo()
    prof = ProfileCallback(wait=1, warmup=1, active=2, output_dir=tmp_path / "profile")
    trainer = demo.main(["--steps", "12", "--val-every", "12", "--val-batches", "2", "--n-chars", "40000",
                         "--checkpoint-every", "None", "--root-dir", str(tmp_path), "--run-name", "prof"], callbacks=[prof])
    trace, table, _stacks = prof.exported
    events = json.loads(trace.read_text())["traceEvents"]
    assert {"aten::mm", "aten::addmm"} <= {e.get("name") for e in events}  # the head (no bias) and the other linears
    assert "aten::mm" in table.read_text()
    assert trainer.global_step == 12 and not prof.running and not torch.autograd._profiler_enabled()


def _compiled_single_row(root):
    from tests.acceptance.test_matrix import _row

    return _row(("single", "gpt", True, False, False), root)


def test_demo_compiled_on_one_device_resumes_bit_exactly_with_several_threads(tmp_path):
    """The demo compiled as one region on one device, in a process with every core's thread
    (where inductor's parallel kernels run): a checkpoint taken on a validation step resumes to
    the same losses and the same final weights, bit for bit. With the embeddings compiled too,
    their backward's atomic adds made two runs differ in the last bits."""
    from dream_trainer.testing import spawn_world

    (result,) = spawn_world(1, _compiled_single_row, str(tmp_path), timeout=600)
    full, resumed = result["full"], result["resumed"]
    assert resumed["losses"] and all(loss == full["losses"][step] for step, loss in resumed["losses"].items())
    for name, value in full["final"].items():
        assert torch.equal(resumed["final"][name], value), name

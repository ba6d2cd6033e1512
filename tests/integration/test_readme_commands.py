"""Every command the README shows, run as written (issue 40).

The commands run in a scratch directory that holds this repository's ``examples/`` and this
interpreter's environment as ``.venv`` (symbolic links), so the README's relative paths resolve
exactly as they do from the repository root, and every run directory lands in the scratch
directory. Runs are shortened only by flags appended after the README's own
(``--steps``/``--val-every``/``--checkpoint-every``): each still validates and checkpoints. The
README's example checkpoint (``step_000000250`` of run ``a``) stands for the newest checkpoint
of the shortened run ``a``.

`test_every_readme_command_is_run_here` fails when the README gains a command no test here
runs (or loses one a test names). ``make test`` is the one command not run here: it is CI's
own command (``.ci/run``), which runs this module.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dream_trainer.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SHORT = ["--steps", "4", "--val-every", "2", "--checkpoint-every", "2"]  # a validation and a checkpoint at 2 and 4
RUN_A = "runs/gpt/a"

# One entry per README command: a substring that names it (and no other command).
PLAN = [
    "make demo", "make test",
    "2 local ranks, spawned", "2 ranks under torchrun", "or tp; --compile per block",
    "llama/train.py --nproc 2 --parallel fsdp", "--parallel pp", "--parallel cp", "tensorboard --logdir",
    "Ctrl-C", "same run name resumes", "on 2 ranks: the same global batch", "dream_trainer.data.prepare",
    "train.py --help", "--config run.yaml", "--print-config", "train.py resume", "--run-name ft --init-from",
    "train.py summarize", "train.py profile", "find-graph-breaks", "train.py benchmark", "train.py export",
    "--trackers wandb mlflow", "lora.py --init-from", "lora.py export", "fault_tolerant.py",
]


def readme_commands() -> list[str]:
    """Each line of the README's ``bash`` blocks (a trailing ``# comment`` kept: PLAN's keys
    may name a command by its comment)."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def command(key: str) -> str:
    """The README command that PLAN's `key` names, without its comment."""
    assert key in PLAN, key
    (line,) = [c for c in readme_commands() if key in c]
    return line.split("  #")[0].split(" # ")[0].strip()


def test_every_readme_command_is_run_here():
    lines = readme_commands()
    for line in lines:
        keys = [k for k in PLAN if k in line]
        assert len(keys) == 1, f"README command {line!r}: {len(keys)} entries of PLAN name it (one test must run it)"
    for key in PLAN:
        assert len([c for c in lines if key in c]) == 1, f"PLAN key {key!r} names no README command, or several"


def test_make_test_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert command("make test") in ci, ".ci/run must run the README's test command"


# ----------------------------------------------------------------------------- running them
@pytest.fixture(scope="module")
def here(tmp_path_factory):
    """The scratch directory the README's commands run from."""
    cwd = tmp_path_factory.mktemp("readme")
    (cwd / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    (cwd / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    return cwd


def _env() -> dict[str, str]:
    # torchrun's own rendezvous port (PET_MASTER_PORT is --master-port's variable): a free one
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PET_MASTER_PORT": str(free_port())}


def start(line: str, cwd: Path, extra: list[str] = ()) -> subprocess.Popen:
    return subprocess.Popen([*shlex.split(line), *extra], cwd=cwd, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    """Its output once it ended (its whole session killed if it outlives `timeout`)."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the ranks it started
        out, _ = proc.communicate()
        pytest.fail(f"{proc.args} did not end in {timeout} s:\n{out[-3000:]}")
    return out


def run(key: str, cwd: Path, extra: list[str] = (), expect: int = 0, timeout: float = 300) -> str:
    """Run the README command PLAN's `key` names, as written plus `extra`; its output."""
    proc = start(command(key), cwd, extra)
    out = finish(proc, timeout)
    assert proc.returncode == expect, f"{proc.args} exited {proc.returncode}, not {expect}:\n{out[-4000:]}"
    return out


def validated(out: str, *steps: int) -> None:
    """The run printed a validation loss at each of `steps` (on one line: one rank's report)."""
    lines = [line + "," for line in out.splitlines() if line.startswith("validation loss by step")]
    assert any(all(f" {step}: " in line for step in steps) for line in lines), (steps, out[-3000:])


def checkpoints(run_dir: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").glob("step_*"))


def newest_checkpoint(cwd: Path, run_dir: str = RUN_A) -> str:
    return f"{run_dir}/checkpoints/step_{checkpoints(cwd / run_dir)[-1]:09d}"


# In file order: the preemption chain makes run ``a``, which later commands read.
def test_make_demo(here):
    if not (ROOT / ".venv" / ".installed").exists():
        pytest.skip("make demo's install has not run in this checkout (CI's make test runs it first)")
    line = command("make demo")
    # -o: do not remake the install stamp (make test, CI's command, just made it)
    proc = subprocess.Popen([*shlex.split(line), "-C", str(ROOT), "-o", ".venv/.installed",
                             f"ARGS={shlex.join([*SHORT, '--root-dir', str(here / 'make-demo')])}"],
                            cwd=here, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    out = finish(proc)
    assert proc.returncode == 0, out[-4000:]
    validated(out, 0, 2, 4)
    assert [checkpoints(d) for d in (here / "make-demo" / "gpt").iterdir()] == [[2, 4]]


@pytest.mark.parametrize("key", ["2 local ranks, spawned", "2 ranks under torchrun", "or tp; --compile per block",
                                 "--parallel cp",
                                 "llama/train.py --nproc 2 --parallel fsdp"])
def test_the_two_rank_runs(here, key):
    out = run(key, here, [*SHORT, "--run-name", f"two-{PLAN.index(key)}"])
    validated(out, 0, 2, 4)
    (run_dir,) = list(here.glob(f"runs/*/two-{PLAN.index(key)}"))
    assert checkpoints(run_dir) == [2, 4]


def test_the_pipeline_run_validates_a_whole_epoch_with_default_shapes(here):
    """Default shapes (global batch 32, block 64, the 400k-character corpus: 624 validation
    windows, so the validation loader's last batch holds 16 samples): the stages once kept
    the receive buffers of the first batch and the smaller last one failed (issue 40)."""
    out = run("--parallel pp", here, ["--steps", "2", "--val-every", "2", "--run-name", "pp"])
    validated(out, 0, 2)
    # The automatic schedule, said once (rank 0) where a demo user sees it, by the cost model
    # (the demo gives it the sample size): over gloo, not zero-bubble (measured slowest there).
    choices = [line for line in out.splitlines() if "pipeline: schedule" in line]
    assert len(choices) == 1 and "(auto: the fastest by the cost model (CPU over gloo" in choices[0], out[-3000:]
    assert "InterleavedZeroBubble x2: ~" in choices[0] and "alternatives (estimated step)" in choices[0]


def test_ctrl_c_saves_and_the_same_name_resumes_on_one_then_two_ranks(here):
    run_dir = here / RUN_A
    proc = start(command("Ctrl-C"), here, ["--steps", "200", "--val-every", "2", "--checkpoint-every", "2"])
    deadline = time.monotonic() + 240
    while not checkpoints(run_dir) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)  # the event: its first checkpoint (step 2) committed, 198 steps before its end
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    out = finish(proc)
    assert proc.returncode == 75, out[-4000:]
    stopped = checkpoints(run_dir)[-1]
    assert 2 < stopped < 200, (stopped, out[-3000:])  # saved at the step after Ctrl-C
    out = run("same run name resumes", here, ["--steps", str(stopped + 2), "--val-every", "2", "--checkpoint-every", "2"])
    assert "resuming runs/gpt/a" in out, out[-3000:]
    validated(out, stopped + 2)
    # where the time went, over both attempts: the time between them is the restart part
    (goodput,) = [line for line in out.splitlines() if line.startswith("goodput: ")]
    assert "2 attempt(s)" in goodput and "restart " in goodput, goodput
    assert checkpoints(run_dir)[-1] == stopped + 2
    out = run("on 2 ranks: the same global batch", here, ["--steps", str(stopped + 4), "--val-every", "2",
                                                           "--checkpoint-every", "2"])
    assert checkpoints(run_dir)[-1] == stopped + 4
    validated(out, stopped + 4)


def test_resume_init_from_export_and_lora(here):
    steps = checkpoints(here / RUN_A)[-1]
    out = run("train.py resume", here, ["--steps", str(steps + 2), "--val-every", "2", "--checkpoint-every", "2"])
    assert checkpoints(here / RUN_A)[-1] == steps + 2, out[-3000:]
    ckpt = newest_checkpoint(here)
    key = "--run-name ft --init-from"
    out = run_with_checkpoint(key, here, ckpt, SHORT)
    validated(out, 0, 2, 4)
    assert checkpoints(here / "runs/gpt/ft") == [2, 4]
    out = run_with_checkpoint("train.py export", here, ckpt)
    exported = Path(ckpt) / "model.safetensors"
    assert (here / exported).is_file() or any(here.rglob("model.safetensors")), out[-2000:]
    out = run_with_checkpoint("lora.py --init-from", here, ckpt, SHORT)
    validated(out, 0, 2, 4)
    (lora_run,) = list(here.glob("runs/gpt-lora/*"))
    lora_ckpt = newest_checkpoint(here, str(lora_run.relative_to(here)))
    line = command("lora.py export").replace("runs/gpt-lora/<run>/checkpoints/step_000000250", lora_ckpt)
    proc = start(line, here)
    out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    # peft's adapter directory and the merged GPT (tests/integration/test_lora.py loads them back)
    assert {p.name for p in (here / "adapter").iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    assert (here / "merged.safetensors").stat().st_size > 0


def run_with_checkpoint(key: str, cwd: Path, ckpt: str, extra: list[str] = ()) -> str:
    """`key`'s command with the README's example checkpoint replaced by `ckpt`."""
    line = command(key)
    assert "runs/gpt/a/checkpoints/step_000000250" in line, line
    proc = start(line.replace("runs/gpt/a/checkpoints/step_000000250", ckpt), cwd, extra)
    out = finish(proc)
    assert proc.returncode == 0, f"{proc.args}:\n{out[-4000:]}"
    return out


def test_tensorboard_reads_the_runs(here):
    if not (here / "runs" / "gpt").is_dir():
        pytest.skip("no run yet (the earlier tests of this module make them)")
    out = run("tensorboard --logdir", here, ["--inspect"], timeout=120)
    assert "train/loss" in out and "val/loss" in out, out[-3000:]


def test_prepare_your_own_text(here):
    (here / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog.\n" * 2000)
    run("dream_trainer.data.prepare", here)
    assert (here / "corpus.tokens").stat().st_size > 0


def test_help_config_print_config_and_summarize(here):
    out = run("train.py --help", here)
    assert out.count("usage:") == 1 and len(out.splitlines()) <= 60, out
    out = run("--print-config", here)
    assert "fsdp" in out or "dp_shard" in out, out
    (here / "run.yaml").write_text(out)  # "the resolved config, as a --config file"
    # the README's command sets max_steps 500; the appended flags shorten it (the last value wins)
    out = run("--config run.yaml", here, [*SHORT, "--run-name", "configured"])
    validated(out, 0, 2, 4)
    recorded = json.loads((here / "runs/gpt/configured/run.json").read_text())
    assert recorded["config"]["model"]["d_model"] == 256, recorded["config"]["model"]
    out = run("train.py summarize", here)
    assert "FLOPs" in out or "flops" in out, out


def test_profile_find_graph_breaks_and_benchmark(here):
    out = run("train.py profile", here)
    assert "trace" in out, out[-3000:]
    out = run("find-graph-breaks", here)
    (report,) = re.findall(r"report: (\S+)", out)
    assert (here / report).is_file(), out[-3000:]
    out = run("train.py benchmark", here, ["--bench-steps", "2", "--bench-warmup", "1", "--bench-rounds", "1"])
    assert "compiled" in out, out[-3000:]


def test_trackers(here):
    out = run("--trackers wandb mlflow", here, [*SHORT, "--run-name", "tracked"])
    validated(out, 0, 2, 4)
    assert list(here.glob("runs/**/wandb")) or list(here.glob("**/wandb")), "no W&B offline run"
    assert list(here.glob("runs/**/mlruns")), "no MLflow store"


def test_fault_tolerant_demo(here):
    # --kill-at 40 as written; 48 steps, validating and checkpointing at 24 and 48 (after the restart)
    out = run("fault_tolerant.py", here, ["--steps", "48", "--restart-after", "0", "--", "--val-every", "24",
                                          "--checkpoint-every", "24"], timeout=420)
    assert "killed replica group 1 (SIGKILL) at step 40" in out and "restarted replica group 1" in out, out[-3000:]
    groups = [line for line in out.splitlines() if re.match(r"replica group \d: \{", line)]
    assert len(groups) == 2 and all("'exit_code': 0" in g for g in groups), out[-3000:]
    assert "'starts': 2" in groups[1] and "'replicas_lost': 1" in groups[0], groups
    assert all("'goodput': {'goodput': " in g for g in groups), groups  # each group's split of its wall time
    validated(out, 24, 48)

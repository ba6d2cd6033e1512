"""Multi-node launch, on this machine: two "nodes" as two ``torchrun --nnodes 2`` invocations
with a c10d rendezvous on 127.0.0.1, and a simulated SLURM allocation of 2 nodes (fake
``SLURM_*`` variables, a stub ``scontrol`` on PATH) whose tasks get SLURM's warning signal
(USR1) on one rank only. Each trains the GPT demo and is compared with the same demo on one
node (``--nproc 2``, the same seed and global batch)."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "gpt" / "train.py"
ARGS = ["--steps", "30", "--val-every", "10", "--n-chars", "60000", "--val-batches", "2", "--log-every", "5",
        "--checkpoint-every", "10"]
TIMEOUT_S = 240


def _losses(log_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


def _run(procs: list[subprocess.Popen[str]]) -> list[str]:
    """Wait for every process (each in its own session), killing all of them on a timeout."""
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        pytest.fail("a multi-node run timed out")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    return outs


_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def _start(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    """`cmd` in its own session, outside any launcher (the module fixture runs before the
    per-test environment cleanup: nothing a previous test left in the environment leaks in)."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("DREAM_TRAINER_", "SLURM_", "TORCHELASTIC_")) and k not in _LAUNCH_VARS}
    return subprocess.Popen(cmd, cwd=cwd, env={**base, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _free_port(low: int = 0, high: int = 0) -> int:
    for port in range(low, high) if low else [0]:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    raise RuntimeError("no free port")


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> dict[int, float]:
    """The reference: the demo on one node, 2 ranks."""
    root = tmp_path_factory.mktemp("one_node")
    out = _run([_start([sys.executable, str(DEMO), "--nproc", "2", *ARGS, "--root-dir", str(root),
                        "--run-name", "ref"], root, {})])[0]
    losses = _losses(root / "gpt" / "ref" / "logs")
    assert sorted(losses) == [5, 10, 15, 20, 25, 30], out[-3000:]
    return losses


def test_two_torchrun_nodes_with_c10d_rendezvous_train_like_one_node(tmp_path, one_node):
    port = _free_port()
    procs = [
        _start([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", "two-nodes", str(DEMO), *ARGS, "--root-dir", str(tmp_path), "--run-name", "two"],
               tmp_path, {"GLOO_SOCKET_IFNAME": "lo"})
        for node in (0, 1)
    ]
    outs = _run(procs)
    assert [p.returncode for p in procs] == [0, 0], "\n----\n".join(o[-2000:] for o in outs)
    losses = _losses(tmp_path / "gpt" / "two" / "logs")
    assert losses.keys() == one_node.keys()
    # Same seed, same global batch, the same 2-rank all-reduce: the same numbers (float32;
    # allow the last bits).
    assert losses == pytest.approx(one_node, rel=1e-5), (losses, one_node)


def _scontrol(bin_dir: Path, log: Path) -> None:
    bin_dir.mkdir()
    stub = bin_dir / "scontrol"
    stub.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {log}\n'
        'if [ "$1 $2" = "show hostnames" ]; then echo 127.0.0.1; echo 127.0.0.2; fi\n'
    )
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)


def _slurm_tasks(tmp_path: Path, job: str, extra: dict[str, str]) -> list[subprocess.Popen[str]]:
    """What ``srun --nodes 2 --ntasks-per-node 1`` would start: one task per node."""
    bin_dir = tmp_path / "bin"
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "GLOO_SOCKET_IFNAME": "lo",
           "SLURM_JOB_ID": job, "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_NNODES": "2",
           "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_STEP_NODELIST": "node[1-2]",
           "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_LOCALID": "0"}
    return [_start([sys.executable, str(DEMO), *ARGS, "--root-dir", str(tmp_path)], tmp_path,
                   {**env, **extra, "SLURM_PROCID": str(task), "SLURM_NODEID": str(task)}) for task in (0, 1)]


def test_a_simulated_slurm_job_preempted_by_usr1_on_one_rank_saves_everywhere_requeues_and_resumes(tmp_path, one_node):
    from dream_trainer.cluster import slurm_port

    log = tmp_path / "scontrol.log"
    _scontrol(tmp_path / "bin", log)
    port = _free_port(15000, 25000)
    job = str(port - 15000).zfill(4)  # slurm_port(job) is then this free port
    assert slurm_port(job) == port
    run = tmp_path / "gpt" / f"slurm-{job}"  # the run is named after the job: a requeue resumes it

    procs = _slurm_tasks(tmp_path, job, {"DREAM_TRAINER_REQUEUE": "1"})
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (run / "checkpoints" / "step_000000010").is_dir():
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, "no checkpoint at step 10"
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGUSR1)  # SLURM's warning, seen by one rank only
    finally:
        outs = _run(procs)
    assert [p.returncode for p in procs] == [75, 75], "\n----\n".join(o[-2000:] for o in outs)
    steps = sorted(int(p.name.split("_")[1]) for p in (run / "checkpoints").glob("step_*"))
    stopped = steps[-1]
    assert 10 <= stopped < 30, steps
    assert f"preempted at step {stopped}" in outs[0], outs[0][-2000:]
    assert log.read_text().splitlines().count(f"requeue {job}") == 1  # rank 0 only
    assert "show hostnames node[1-2]" in log.read_text()

    # The requeued job: the same job id, started again; it resumes and ends like one node.
    procs = _slurm_tasks(tmp_path, job, {})
    outs = _run(procs)
    assert [p.returncode for p in procs] == [0, 0], "\n----\n".join(o[-2000:] for o in outs)
    logged = [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    # Resumed, not restarted: every step logged once (a fresh start would log 5 and 10 again).
    assert [r["step"] for r in logged if "train/loss" in r] == [5, 10, 15, 20, 25, 30], (logged, outs[0][-3000:])
    assert _losses(run / "logs") == pytest.approx(one_node, rel=1e-5), outs[0][-2000:]


def test_a_checkpoint_root_that_is_not_shared_by_the_nodes_fails_clearly_before_any_step(tmp_path):
    """Two torchrun "nodes" in different working directories with a relative root: each node
    sees its own directory, as with a node-local path."""
    port = _free_port()
    procs = []
    for node in (0, 1):
        cwd = tmp_path / f"node{node}"
        cwd.mkdir()
        procs.append(_start([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                             "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                             "--rdzv-id", "local-roots", str(DEMO), *ARGS, "--root-dir", "runs", "--run-name", "x"],
                            cwd, {"GLOO_SOCKET_IFNAME": "lo"}))
    outs = _run(procs)
    assert all(p.returncode != 0 for p in procs), "\n----\n".join(o[-2000:] for o in outs)
    for out in outs:  # every node says why, naming the node that cannot see the root
        assert "is not the same directory on every node: node 1" in out, out[-3000:]
    assert not any(p.read_text().strip() for p in tmp_path.rglob("metrics.jsonl"))  # no step was logged
    assert not list(tmp_path.rglob("step_*"))  # nor saved

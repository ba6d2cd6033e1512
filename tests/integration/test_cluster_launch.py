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
import torch

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


def _torchrun_node(node: int, port: int, rdzv_id: str, args: list[str], cwd: Path, nproc: int = 1,
                   torchrun: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    """One "node": ``torchrun --nnodes 2 --node-rank <node>`` with a c10d rendezvous on loopback."""
    return _start([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                   "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                   "--rdzv-id", rdzv_id, *torchrun, str(DEMO), *args], cwd, {"GLOO_SOCKET_IFNAME": "lo"})


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
    procs = [_torchrun_node(node, port, "two-nodes", [*ARGS, "--root-dir", str(tmp_path), "--run-name", "two"], tmp_path)
             for node in (0, 1)]
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


def _slurm_tasks(tmp_path: Path, job: str, extra: dict[str, str], tasks: tuple[int, ...] = (0, 1)) -> list[subprocess.Popen[str]]:
    """What ``srun --nodes 2 --ntasks-per-node 1`` would start: one task per node (those in `tasks`)."""
    bin_dir = tmp_path / "bin"
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "GLOO_SOCKET_IFNAME": "lo",
           "SLURM_JOB_ID": job, "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_NNODES": "2",
           "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_STEP_NODELIST": "node[1-2]",
           "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_LOCALID": "0"}
    return [_start([sys.executable, str(DEMO), *ARGS, "--root-dir", str(tmp_path)], tmp_path,
                   {**env, **extra, "SLURM_PROCID": str(task), "SLURM_NODEID": str(task)}) for task in tasks]


def test_a_simulated_slurm_job_preempted_by_usr1_on_one_rank_saves_everywhere_requeues_and_resumes(tmp_path, one_node):
    job = _slurm_job(tmp_path)
    log = tmp_path / "scontrol.log"
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
    assert _losses(run / "logs") == one_node, outs[0][-2000:]  # bit-exact: the same layout, resumed


def _slurm_job(tmp_path: Path) -> str:
    """A job id whose derived port is free, with the scontrol stub in place."""
    from dream_trainer.cluster import slurm_port

    _scontrol(tmp_path / "bin", tmp_path / "scontrol.log")
    port = _free_port(15000, 25000)
    job = str(port - 15000).zfill(4)
    assert slurm_port(job) == port
    return job


def test_a_node_lost_mid_run_ends_the_other_rank_naming_it(tmp_path):
    job = _slurm_job(tmp_path)
    procs = _slurm_tasks(tmp_path, job, {})
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (tmp_path / "gpt" / f"slurm-{job}" / "checkpoints" / "step_000000010").is_dir():
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, "no checkpoint at step 10"
            time.sleep(0.05)
        os.killpg(procs[1].pid, signal.SIGKILL)  # node 1 gone: its task, without a word
    finally:
        outs = _run(procs)
    assert procs[0].returncode == 1, outs[0][-3000:]
    assert "rank 1 (node 1, host " in outs[0] and "stopped answering" in outs[0], outs[0][-3000:]


def test_a_signal_while_waiting_for_the_other_ranks_stops_at_once(tmp_path):
    """Task 0 alone waits for task 1 (up to the 600 s init timeout); SIGTERM ends it now."""
    job = _slurm_job(tmp_path)
    (proc,) = _slurm_tasks(tmp_path, job, {}, tasks=(0,))
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while True:  # its store listens: it is in the roll call
            assert proc.poll() is None and time.monotonic() < deadline, "task 0 never listened"
            try:
                socket.create_connection(("127.0.0.1", 15000 + int(job)), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
    finally:
        out = _run([proc])[0]
    assert proc.returncode == 1, out[-3000:]
    assert "TrainingInterrupted: received signal SIGTERM" in out, out[-3000:]
    assert time.monotonic() - started < 60


def test_a_checkpoint_root_that_is_not_shared_by_the_nodes_fails_clearly_before_any_step(tmp_path):
    """Two torchrun "nodes" in different working directories with a relative root: each node
    sees its own directory, as with a node-local path."""
    port = _free_port()
    procs = []
    for node in (0, 1):
        cwd = tmp_path / f"node{node}"
        cwd.mkdir()
        procs.append(_torchrun_node(node, port, "local-roots", [*ARGS, "--root-dir", "runs", "--run-name", "x"], cwd))
    outs = _run(procs)
    assert all(p.returncode != 0 for p in procs), "\n----\n".join(o[-2000:] for o in outs)
    for out in outs:  # every node says why, naming the node that cannot see the root
        assert "is not the same directory on every node: node 1" in out, out[-3000:]
    assert not any(p.read_text().strip() for p in tmp_path.rglob("metrics.jsonl"))  # no step was logged
    assert not list(tmp_path.rglob("step_*"))  # nor saved


def _final_weights(run: Path) -> dict[str, torch.Tensor]:
    """The model of the run's step-30 checkpoint, read in this process (no process group)."""
    from safetensors.torch import load_file

    from dream_trainer import export_model

    return load_file(str(export_model(run / "checkpoints" / "step_000000030", run / "final.safetensors")))


@pytest.fixture(scope="module")
def hsdp_two_nodes(tmp_path_factory) -> Path:
    """HSDP on two torchrun "nodes" of 2 ranks: sharded within a node, replicated across
    the two; no run name (the rendezvous id names the run). Returns the run directory."""
    root = tmp_path_factory.mktemp("hsdp")
    port = _free_port()
    args = [*ARGS, "--parallel", "hsdp", "--root-dir", str(root)]
    outs = _run([_torchrun_node(node, port, "hsdp", args, root, nproc=2) for node in (0, 1)])
    run = root / "gpt" / "torchrun-hsdp"
    assert sorted(_losses(run / "logs")) == [5, 10, 15, 20, 25, 30], "\n----\n".join(o[-2000:] for o in outs)
    return run


def test_hsdp_across_two_nodes_tracks_one_node(hsdp_two_nodes, one_node):
    # 4 ranks sharding in pairs vs 2 DDP ranks: the same global batch, other reduction orders.
    assert _losses(hsdp_two_nodes / "logs") == pytest.approx(one_node, rel=1e-4)


def _worker_pid(agent: subprocess.Popen[str], rank: int) -> int:
    """The pid of torchrun's worker with global rank `rank` among `agent`'s children."""
    children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()
    for pid in children:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return int(pid)
    raise AssertionError(f"no worker with RANK={rank} under torchrun {agent.pid}: {children}")


def test_elastic_restart_after_a_rank_is_killed_resumes_to_the_uninterrupted_parameters(tmp_path, hsdp_two_nodes):
    """``torchrun --max-restarts 1``: rank 3 (node 1) is SIGKILLed once the validation step's
    checkpoint (step 10) is committed; torchelastic restarts both nodes' ranks, which resume
    from the newest committed checkpoint and end with the uninterrupted run's parameters."""
    port = _free_port()
    args = [*ARGS, "--parallel", "hsdp", "--root-dir", str(tmp_path)]
    procs = [_torchrun_node(node, port, "hsdp", args, tmp_path, nproc=2, torchrun=("--max-restarts", "1"))
             for node in (0, 1)]
    run = tmp_path / "gpt" / "torchrun-hsdp"
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (run / "checkpoints" / "step_000000010").is_dir():
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, "no checkpoint at step 10"
            time.sleep(0.05)
        os.kill(_worker_pid(procs[1], 3), signal.SIGKILL)
    finally:
        outs = _run(procs)
    assert [p.returncode for p in procs] == [0, 0], "\n----\n".join(o[-3000:] for o in outs)
    assert "exitcode: -9" in outs[1], outs[1][-3000:]  # torchelastic saw the kill (and, exiting 0, restarted)
    logged = [json.loads(line)["step"] for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()
              if "train/loss" in line]
    # Resumed, not restarted from scratch (which would log steps 5 and 10 again).
    assert logged.count(5) == logged.count(10) == 1 and logged[-1] == 30, logged
    final, reference = _final_weights(run), _final_weights(hsdp_two_nodes)
    assert final.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(final[name], tensor), name
    assert _losses(run / "logs") == _losses(hsdp_two_nodes / "logs")


def _descendants(pid: int) -> list[int]:
    children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return children + [d for c in children for d in _descendants(c)]


def _submitit_task(submitter: subprocess.Popen[str], rank: int) -> int:
    """The pid of the submitit task with global rank `rank` (under the submitter and its
    local controller)."""
    for pid in _descendants(submitter.pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SUBMITIT_LOCAL_GLOBALID={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no submitit task with rank {rank}")


def test_the_submitit_example_preempted_by_usr2_on_one_task_requeues_and_resumes(tmp_path, one_node):
    """examples/submitit/submit.py on submitit's local executor (2 tasks): submitit's warning
    (SIGUSR2) reaches one task only; both save at the same step, rank 0 hands over to
    submitit's protocol (checkpoint() and requeue), the requeued tasks resume."""
    pytest.importorskip("submitit")
    submitter = _start([sys.executable, str(ROOT / "examples" / "submitit" / "submit.py"), "--executor", "local",
                        "--folder", str(tmp_path / "jobs"), "--tasks-per-node", "2", "--signal-delay-s", "5",
                        "--", *ARGS, "--root-dir", str(tmp_path)], tmp_path, {"GLOO_SOCKET_IFNAME": "lo"})
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not list(tmp_path.glob("gpt/submitit-*/checkpoints/step_000000010")):
            assert submitter.poll() is None and time.monotonic() < deadline, "no checkpoint at step 10"
            time.sleep(0.05)
        os.kill(_submitit_task(submitter, 1), signal.SIGUSR2)
    finally:
        out = _run([submitter])[0]
    assert submitter.returncode == 0, out[-3000:]
    (run,) = tmp_path.glob("gpt/submitit-*")
    logs = "\n".join(p.read_text() for p in (tmp_path / "jobs").rglob("*_0_log.*"))
    assert "Requeued job" in logs, logs[-3000:]  # submitit's protocol ran: checkpoint() and requeue
    assert "preempted at step" in logs, logs[-3000:]
    logged = [json.loads(line)["step"] for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()
              if "train/loss" in line]
    assert logged == [5, 10, 15, 20, 25, 30], logged  # resumed: every step logged once
    assert _losses(run / "logs") == one_node  # bit-exact: the same layout (2 ranks), resumed

"""Fault tolerance across replica groups (torchft) on loopback: a lighthouse in this process,
each group a subprocess (its ranks too), SIGKILLed whole, restarted, healed from a live
peer. Every process is ended (ReplicaGroup.kill) whatever happens."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("torchft") is None:  # not imported here: its logging is set up when first used
    pytest.skip("torchft is not installed", allow_module_level=True)

from dream_trainer import export_model, list_checkpoints  # noqa: E402
from dream_trainer.ft import Lighthouse  # noqa: E402
from dream_trainer.testing.ft import ReplicaGroup  # noqa: E402

HERE = Path(__file__).resolve().parent
DEMO = HERE.parents[1] / "examples" / "gpt" / "fault_tolerant.py"


@pytest.fixture
def lighthouse():
    with Lighthouse(bind="127.0.0.1:0", heartbeat_timeout_ms=1000, join_timeout_ms=200) as server:
        yield server


def _env(lighthouse):
    return dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", TORCHFT_LIGHTHOUSE=lighthouse.address)


def _worker(root, group, lighthouse, *args, nproc=1):
    argv = [sys.executable, str(HERE / "ft_worker.py"), "--group", str(group), "--root", str(root), *args]
    if nproc > 1:
        argv += ["--nproc", str(nproc)]
    return ReplicaGroup(argv, Path(root) / "ft" / "ft" / f"replica_group_{group}", _env(lighthouse))


def _wait_until(condition, groups, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not condition():
        for group in groups:
            assert group.returncode in (None, 0), f"{group.dir.name} exited with {group.returncode}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _run(groups, *timeouts):
    """Start the groups and wait for each (its timeout); every process is ended whatever happens."""
    try:
        for group in groups:
            group.start()
        return [group.wait(timeout=timeout) for group, timeout in zip(groups, timeouts)]
    finally:
        for group in groups:
            group.kill()


def _samples(group, rank=0):
    path = group.dir / f"samples.rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _final_params(group, tmp_path):
    newest = list_checkpoints(group.dir / "checkpoints")[-1]
    return torch.load(export_model(newest.path, tmp_path / f"{group.dir.name}.pt"))


def _committed(events):
    return [e["step"] for e in events if e["event"] == "step" and e["committed"]]


# --------------------------------------------------------------------- the demo, 2 groups x 1 process
def _demo(tmp_path, *args):
    spec = importlib.util.spec_from_file_location("gpt_fault_tolerant", DEMO)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    tiny = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--block-size", "32", "--batch-size", "8",
            "--n-chars", "50000", "--val-batches", "2", "--log-every", "1", "--checkpoint-every", "0",
            "--data-delay-ms", "50"]
    return demo.run(["--root-dir", str(tmp_path), "--run-name", "demo", "--kill-group", "1", "--restart-after", "1",
                     "--timeout", "240", *args, "--", *tiny])


def _check_kill_and_heal(summary, tmp_path, steps, kill_at):
    survivor, victim = summary["groups"][0], summary["groups"][1]
    assert survivor["exit_code"] == victim["exit_code"] == 0 and victim["starts"] == 2
    events = {g: ReplicaGroup([], Path(info["dir"])).events() for g, info in summary["groups"].items()}
    # The survivor: every step 1..steps committed exactly once (none lost, none twice) ...
    assert _committed(events[0]) == list(range(1, steps + 1))
    # ... alone for a while after the kill, then with the restarted group again.
    alone = [e["step"] for e in events[0] if e["event"] == "step" and e["committed"] and e["participants"] == 1]
    assert alone and min(alone) >= kill_at and survivor["replicas_lost"] == 1
    rejoined = [step for step, n in survivor["quorums"] if n == 2 and step > kill_at]
    assert rejoined, survivor["quorums"]
    # The restarted group healed from the survivor at that step (its first life healed at step 0).
    heals = [e for e in events[1] if e["event"] == "heal"]
    assert heals[-1]["step"] == rejoined[0] and heals[-1]["participants"] == 2
    after = [e for e in events[1] if e["event"] == "step" and e["time"] > heals[-1]["time"]]
    assert after and all(e["committed"] and e["participants"] == 2 for e in after)
    assert _committed(events[1])[-1] == steps
    # A heal reads the sender's state while its main thread waits in the quorum (sync quorum):
    # never during a backward pass (the async-quorum race with FSDP2).
    sent = [e for e in events[0] + events[1] if e["event"] == "heal_sent"]
    assert sent and all(e["main_thread_in_quorum"] for e in sent)
    # Final parameters: identical across the groups (their at-fit-end checkpoints).
    first, second = (_final_params(ReplicaGroup([], Path(summary["groups"][g]["dir"])), tmp_path) for g in (0, 1))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_demo_two_groups_survive_a_kill_and_heal(tmp_path):
    steps, kill_at = 150, 30
    summary = _demo(tmp_path, "--steps", str(steps), "--kill-at", str(kill_at))
    _check_kill_and_heal(summary, tmp_path, steps, kill_at)


def test_demo_two_groups_of_two_fsdp_ranks(tmp_path):
    """HSDP: torchft across the groups x FSDP2 inside each (2 x 2 ranks)."""
    steps, kill_at = 120, 25
    summary = _demo(tmp_path, "--steps", str(steps), "--kill-at", str(kill_at), "--nproc", "2", "--parallel", "fsdp")
    _check_kill_and_heal(summary, tmp_path, steps, kill_at)


# --------------------------------------------------------------------- traps and data
def test_a_peer_dies_inside_the_gradient_all_reduce(tmp_path, lighthouse):
    """Group 1 SIGKILLs itself after its backward in step 8, before the all-reduce: group 0
    is then in that all-reduce with a dead peer. It does not die (torchft's DDP comm hook
    would assert there), does not commit that step, and trains on alone; no sample is
    trained twice in a step, and no committed sample twice."""
    groups = [_worker(tmp_path, 0, lighthouse, "--steps", "30"), _worker(tmp_path, 1, lighthouse, "--steps", "30",
                                                                           "--die-at", "8")]
    assert _run(groups, 120, 5) == [0, -9]
    events = groups[0].events()
    failed = [e for e in events if e["event"] == "not_committed"]
    assert [e["step"] for e in failed] == [7] and "Connection" in failed[0]["reason"]  # 7 steps done: the 8th failed
    assert _committed(events) == list(range(1, 31))
    records = {g: _samples(group) for g, group in enumerate(groups)}
    committed = [r for g in records for r in records[g] if r["committed"]]
    by_step: dict[int, list[int]] = {}
    for r in committed:
        by_step.setdefault(r["step"], []).extend(r["indices"])
    assert all(len(v) == len(set(v)) for v in by_step.values())  # disjoint within a step
    every = [i for v in by_step.values() for i in v]
    assert len(every) == len(set(every)) == 4 * (2 * 7 + 23)  # 7 steps by two groups, 23 by one: all distinct
    retried = [r for r in records[0] if r["step"] == 7 and not r["committed"]]  # the failed step's data ...
    assert retried and retried[0]["indices"] == [r for r in records[0] if r["step"] == 8][0]["indices"][:4]


def test_max_failures_halts_the_survivor(tmp_path, lighthouse):
    """With max_failures=0 the first lost group ends the run, with FaultToleranceError."""
    groups = [_worker(tmp_path, 0, lighthouse, "--steps", "30", "--max-failures", "0"),
              _worker(tmp_path, 1, lighthouse, "--steps", "30", "--die-at", "5")]
    assert _run(groups, 120, 5) == [1, -9]
    events = groups[0].events()
    assert [e["lost"] for e in events if e["event"] == "replica_lost"] == [1] and _committed(events) == [1, 2, 3, 4]


def test_every_group_lost_resumes_from_disk(tmp_path, lighthouse):
    """Both groups SIGKILLed at once: their disk checkpoints (every 5 steps, the Manager's
    committed-step count included) resume the run, and they finish identical."""
    args = ("--steps", "40", "--checkpoint-interval", "5")
    groups = [_worker(tmp_path, g, lighthouse, *args) for g in (0, 1)]
    try:
        for group in groups:
            group.start()
        _wait_until(lambda: all(g.reached(17, 2) for g in groups), groups)
        killed = time.time()
        for group in groups:
            group.kill()
        saved = max(list_checkpoints(g.dir / "checkpoints")[-1].step for g in groups)
        assert saved >= 15
        for group in groups:
            group.start()
        assert [g.wait(timeout=120) for g in groups] == [0, 0]
    finally:
        for group in groups:
            group.kill()
    for group in groups:
        second = [e for e in group.events() if e["time"] > killed]
        # The first quorum stands at the newest checkpoint's step: the Manager's count came
        # back from disk (the group with an older checkpoint, if any, healed to it).
        assert [e["step"] for e in second if e["event"] == "quorum"][0] == saved
        assert _committed(second) == list(range(saved + 1, 41))
    first, second = (_final_params(g, tmp_path) for g in groups)
    assert all(torch.equal(first[k], second[k]) for k in first)

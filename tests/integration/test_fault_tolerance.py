"""Fault tolerance across replica groups (torchft) on loopback: a lighthouse in this process,
each group a subprocess (its ranks too), SIGKILLed whole, restarted, healed from a live
peer. Every process is ended (ReplicaGroup.kill) whatever happens.

The tests wait on events (the groups' event files, their checkpoints, a gate file), never
on timings: they pass on a busy machine. Where a test needs every group in the first
quorum, the groups start behind a gate (ft_worker ``--gate``) opened once all are up.
"""

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
from dream_trainer.fault_tolerance import Lighthouse  # noqa: E402
from dream_trainer.testing.fault_tolerance import ReplicaGroup, start_together, wait_until  # noqa: E402

HERE = Path(__file__).resolve().parent
DEMO = HERE.parents[1] / "examples" / "gpt" / "fault_tolerant.py"
RTOL_ELASTIC = 1e-5  # an elastic run's per-step loss against one process's: float32 summation order


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
    group_dir = Path(root) / "ft" / "ft" / f"replica_group_{group}"
    return ReplicaGroup(argv, group_dir, _env(lighthouse), output=Path(root) / f"group{group}.log")


def _run(groups, gate, *timeouts):
    """Start the groups together and wait for each (its timeout); every process is ended
    whatever happens."""
    try:
        start_together(groups, gate)
        return [group.wait(timeout=timeout) for group, timeout in zip(groups, timeouts)]
    finally:
        for group in groups:
            group.kill()


def _samples(group, rank=0):
    path = group.dir / f"samples.rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _final_params(group, tmp_path):
    newest = list_checkpoints(group.dir / "checkpoints")[-1]
    from safetensors.torch import load_file

    return load_file(str(export_model(newest.path, tmp_path / f"{group.dir.name}.safetensors")))


def _same(first, second):
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def _committed(events):
    return [e["step"] for e in events if e["event"] == "step" and e["committed"]]


# --------------------------------------------------------------------- kill and heal
@pytest.mark.parametrize("nproc", [1, 2], ids=["2x1", "2x2-fsdp"])
def test_two_groups_survive_a_kill_and_heal(tmp_path, lighthouse, nproc):
    """Group 1 is SIGKILLed (every process) at step 10; group 0 trains on alone; group 1 is
    restarted, heals from group 0 and trains with it to the end; both end identical. With
    2 ranks per group: HSDP, torchft across the groups x FSDP2 inside each. Sequenced by
    events: group 0 holds after its first step alone until the restarted group 1 is up.
    With 1 rank per group the data is a `TokenLoader`'s (a global batch of 8): over the
    committed steps the sample ids are the run's global order, group 0 alone training whole
    global batches (the elastic 2 -> 1 -> 2 of the 4 -> 3 -> 4 test below)."""
    steps, kill_at = 30, 10
    flags = ("--steps", str(steps), *(["--parallel", "fsdp"] if nproc > 1 else _token_flags(tmp_path, 8)))
    survivor = _worker(tmp_path, 0, lighthouse, *flags, "--hold", str(tmp_path / "hold"), nproc=nproc)
    victim = _worker(tmp_path, 1, lighthouse, *flags, nproc=nproc)
    groups = [survivor, victim]
    try:
        start_together(groups, tmp_path / "go-1")
        wait_until(lambda: victim.reached(kill_at, 2), groups, 300, f"step {kill_at} with both groups")
        victim.kill()
        killed = time.time()
        wait_until(lambda: (survivor.dir / "hold.held").exists(), groups[:1], 300, "group 0 training on alone")
        start_together([victim], tmp_path / "go-2")  # up and heartbeating: in group 0's next quorum
        (tmp_path / "hold").touch()
        assert [g.wait(timeout=300) for g in groups] == [0, 0]
    finally:
        for group in groups:
            group.kill()
    events = {g: group.events() for g, group in enumerate(groups)}
    # Group 0: every step 1..steps committed exactly once (none lost, none twice) ...
    assert _committed(events[0]) == list(range(1, steps + 1))
    # ... lost group 1 once, at or after the kill, trained alone, then with group 1 again.
    lost = [e for e in events[0] if e["event"] == "replica_lost"]
    assert len(lost) == 1 and lost[0]["step"] >= kill_at
    alone = [e["step"] for e in events[0] if e["event"] == "step" and e["committed"] and e["participants"] == 1]
    assert alone and min(alone) > kill_at
    rejoined = [e["step"] for e in events[0] if e["event"] == "quorum" and e["participants"] == 2 and e["time"] > killed]
    assert rejoined == [max(alone)]
    # Group 1 healed from group 0 at that step (its first life healed at step 0) ...
    heals = [e for e in events[1] if e["event"] == "heal"]
    assert [h["step"] for h in heals] == [0, rejoined[0]] and heals[-1]["participants"] == 2
    after = [e for e in events[1] if e["event"] == "step" and e["time"] > heals[-1]["time"]]
    assert [e["step"] for e in after] == list(range(rejoined[0] + 1, steps + 1))
    assert all(e["committed"] and e["participants"] == 2 for e in after)
    # ... reading group 0's state while its main thread waits in the quorum (sync quorum):
    # never during a backward pass (the async-quorum race with FSDP2).
    sent = [e for e in events[0] if e["event"] == "heal_sent"]
    assert sent and all(e["main_thread_in_quorum"] for e in sent)
    # The healed group's goodput ledger (its second life) counts the heal apart, and its parts sum to its wall time.
    ledger = json.loads((victim.dir / "goodput.json").read_text())
    assert ledger["parts_s"]["heal"] > 0 and ledger["parts_s"]["productive"] > 0
    assert sum(ledger["parts_s"].values()) == pytest.approx(ledger["wall_s"])
    for rank in range(nproc):  # the final parameters (full tensors), rank by rank
        assert _same(*(torch.load(g.dir / f"final.rank{rank}.pt") for g in groups))
    if nproc == 1:  # every committed step's samples in the run's order; alone, group 0 took whole global batches
        quorum = _in_global_order(_by_step(groups), 8, steps)
        assert sorted(s for s, n in quorum.items() if n == 1) == alone and set(quorum.values()) == {1, 2}


TOKENS = 9 * 512  # the token file of the TokenLoader tests: windows of 8 + 1 tokens, 575 samples


def _token_flags(root, global_batch):
    """ft_worker's flags to train from a TokenLoader (a token file written under `root`)."""
    import numpy as np

    from dream_trainer.data import write_tokens

    path = Path(root) / "corpus.tokens"
    if not path.exists():
        write_tokens(path, [np.random.default_rng(0).integers(0, 1000, size=TOKENS)])
    return ("--tokens", str(path), "--global-batch", str(global_batch))


def _by_step(groups):
    """The committed records of every group, by step, each step's in replica-rank order."""
    by_step: dict[int, list[dict]] = {}
    for g, group in enumerate(groups):
        for r in _samples(group):
            if r["committed"]:
                by_step.setdefault(r["step"], []).append({**r, "group": g})
    return {step: sorted(parts, key=lambda r: r["replica_rank"]) for step, parts in sorted(by_step.items())}


def _in_global_order(by_step, global_batch, steps):
    """Assert that steps 1..`steps` were each committed once by a quorum whose groups' sample
    ids, in replica-rank order, are that step's global batch of the run's order (seed 0):
    every sample once, in order. Returns ``{step: participants}``."""
    from dream_trainer.data import GlobalOrder

    assert list(by_step) == list(range(1, steps + 1))
    order, quorum = GlobalOrder((TOKENS - 1) // 8, global_batch, seed=0), {}
    for step, parts in by_step.items():
        quorum[step] = n = parts[0]["participants"]
        assert [(r["participants"], r["replica_rank"]) for r in parts] == [(n, k) for k in range(n)], (step, parts)
        assert [i for r in parts for i in r["indices"]] == order.next_global_batch().tolist(), step
    return quorum


def test_an_elastic_global_batch_through_4_3_4_groups(tmp_path):
    """A `TokenLoader` under fault tolerance, 4 groups of 1 rank and a global batch of 8: group
    1 is SIGKILLed at step 8 or after, groups 0, 2, 3 train on 3 steps or more on uneven
    shares (2, 3, 3 samples, loss weights 6/8, 9/8, 9/8), group 1 is restarted, heals and the
    4 train to the end. Over the committed steps of all groups, the sample ids in replica-rank
    order are the run's global order (every sample once, in order), and each step's
    global-batch loss is that of one process without fault tolerance on the same global
    batches from the same seed (no weight copied in: the groups start alike by seed and heal
    only by torchft).

    The kill lands where it lands, often inside a gradient all-reduce: that step is not
    committed and is retried by the survivors on the same samples, cut for the new quorum.
    A survivor that was waiting on a live peer in that all-reduce (gloo's ring) learns of the
    failure only when the others form their next quorum, so the quorum may also be 2 for a
    step (that survivor then heals): 4 -> 2 -> 3 -> 4, which the data must follow just as well."""
    steps, kill_at, alone_steps, gbs = 24, 8, 3, 8
    flags = ("--steps", str(steps), *_token_flags(tmp_path, gbs))
    # join_timeout 2 s: a group slow to reach a quorum on a busy machine is waited for rather
    # than left out (a lost group is left out once its heartbeats stop, after 1 s, as before).
    with Lighthouse(bind="127.0.0.1:0", heartbeat_timeout_ms=1000, join_timeout_ms=2000) as lighthouse:
        hold = ("--hold", str(tmp_path / "hold"), "--hold-after", str(alone_steps), "--hold-quorum", "3")
        groups = [_worker(tmp_path, g, lighthouse, *flags, *(hold if g != 1 else ())) for g in range(4)]
        survivors, victim = [groups[0], *groups[2:]], groups[1]
        try:
            start_together(groups, tmp_path / "go-1")
            wait_until(lambda: victim.reached(kill_at, 4), groups, 300, f"step {kill_at} with 4 groups")
            victim.kill()
            killed = time.time()
            wait_until(lambda: all((g.dir / "hold.held").exists() for g in survivors), survivors, 300,
                       f"groups 0, 2, 3 training {alone_steps} steps together without group 1")
            start_together([victim], tmp_path / "go-2")  # up and heartbeating: in the survivors' next quorums
            (tmp_path / "hold").touch()
            assert [g.wait(timeout=300) for g in groups] == [0, 0, 0, 0]
        finally:
            for group in groups:
                group.kill()
    by_step = _by_step(groups)
    quorum = _in_global_order(by_step, gbs, steps)  # every sample once, in the run's order
    # 4 groups, then fewer (one stretch after the kill: 3 for the survivors' hold, maybe 2 for a
    # step before it), then 4 from group 1's heal to the end.
    fewer = [step for step, n in quorum.items() if n < 4]
    assert fewer == list(range(fewer[0], fewer[-1] + 1)) and kill_at < fewer[0] and fewer[-1] < steps, quorum
    assert {quorum[step] for step in fewer} <= {2, 3} and sum(quorum[step] == 3 for step in fewer) >= alone_steps
    for step, parts in by_step.items():  # the 3-group steps really were uneven, and weighted; the others not
        n, sizes = quorum[step], [len(r["indices"]) for r in parts]
        if n == 3:
            assert sizes == [2, 3, 3] and [r["weight"] for r in parts] == pytest.approx([6 / 8, 9 / 8, 9 / 8]), parts
        else:
            assert sizes == [gbs // n] * n and {r["weight"] for r in parts} == {None}, parts
    events = {g: group.events() for g, group in enumerate(groups)}
    for g in (0, 2, 3):  # each survivor: no step committed twice, and every step to the end
        done = _committed(events[g])
        assert done == sorted(set(done)) and done[-1] == steps and set(range(1, kill_at + 1)) <= set(done), g
    # Group 1's second life: one heal, at the step the others had reached, then every step with 4.
    second = [e for e in events[1] if e["time"] > killed]
    assert [(e["step"], e["participants"]) for e in second if e["event"] == "heal"] == [(fewer[-1], 4)]
    assert _committed(second) == list(range(fewer[-1] + 1, steps + 1))
    # The uninterrupted run: one process, no torchft, the same trainer, seed and global batches.
    spec = importlib.util.spec_from_file_location("ft_worker", HERE / "ft_worker.py")
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    reference = worker.main(["--reference", "--group", "0", "--root", str(tmp_path / "reference"), "--delay-ms", "0",
                             "--no-checkpoint", *flags])
    single = [json.loads(line) for line in (reference.run_dir / "samples.rank0.jsonl").read_text().splitlines()]
    assert [r["indices"] for r in single] == [[i for r in parts for i in r["indices"]] for parts in by_step.values()]
    # Each step's global-batch mean loss (token-weighted: sum of the shares' loss sums / targets),
    # within float32 rounding: the groups' gradients are summed in another order than one
    # process's. Without the loss weights the 3-group steps' updates differ, and so do the
    # losses after them, by far more (measured: see docs/data.md).
    elastic = torch.tensor([sum(r["loss_sum"] for r in parts) / sum(r["count"] for r in parts)
                            for parts in by_step.values()], dtype=torch.float64)
    plain = torch.tensor([r["loss_sum"] / r["count"] for r in single], dtype=torch.float64)
    torch.testing.assert_close(elastic, plain, rtol=RTOL_ELASTIC, atol=0)
    final = [torch.load(g.dir / "final.rank0.pt") for g in groups]
    assert all(_same(final[0], f) for f in final[1:])  # the 4 groups end identical ...
    single_final = torch.load(reference.run_dir / "final.rank0.pt")
    for name, value in final[0].items():  # ... and with the uninterrupted run's model
        torch.testing.assert_close(value, single_final[name], rtol=RTOL_ELASTIC, atol=1e-7)


def test_the_demo_kills_and_restarts_a_group(tmp_path):
    """examples/gpt/fault_tolerant.py end to end: a lighthouse, 2 groups of the GPT demo,
    group 1 killed at step 30 and restarted once group 0 trained on without it. Whether
    group 1 comes back before group 0 finishes (it heals and trains with it) or after (it
    resumes from group 0's final checkpoint) depends on the machine: both end identical."""
    spec = importlib.util.spec_from_file_location("gpt_fault_tolerant", DEMO)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    tiny = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--block-size", "32", "--batch-size", "8",
            "--n-chars", "50000", "--val-batches", "2", "--log-every", "1", "--checkpoint-every", "None"]
    steps, kill_at = 60, 30
    summary = demo.run(["--root-dir", str(tmp_path), "--run-name", "demo", "--kill-group", "1", "--kill-at",
                        str(kill_at), "--restart-after", "0", "--steps", str(steps), "--timeout", "600", "--", *tiny])
    survivor, victim = summary["groups"][0], summary["groups"][1]
    assert survivor["exit_code"] == victim["exit_code"] == 0 and victim["starts"] == 2
    events = {g: ReplicaGroup([], Path(info["dir"])).events() for g, info in summary["groups"].items()}
    assert _committed(events[0]) == list(range(1, steps + 1))
    assert survivor["replicas_lost"] == 1 and [e["step"] for e in events[0] if e["event"] == "replica_lost"][0] >= kill_at
    assert [(e["status"], e["step"]) for e in events[1] if e["event"] == "end"] == [("completed", steps)]
    final = {g: list_checkpoints(Path(info["dir"]) / "checkpoints") for g, info in summary["groups"].items()}
    assert final[0][-1].step == steps
    if final[1] and final[1][-1].step == steps:  # it came back in time: its own final checkpoint
        assert _same(*(_final_params(ReplicaGroup([], Path(summary["groups"][g]["dir"])), tmp_path) for g in (0, 1)))


# --------------------------------------------------------------------- traps and data
def test_a_peer_dies_inside_the_gradient_all_reduce(tmp_path, lighthouse):
    """Group 1 SIGKILLs itself in step 8, before its backward: group 0 is then in that
    step's all-reduce with a dead peer. It does not die (torchft's DDP comm hook would
    assert there), does not commit that step, and trains on alone, saying so in one warning
    line (no traceback); no sample is trained twice in a step, and no committed sample twice."""
    groups = [_worker(tmp_path, 0, lighthouse, "--steps", "30"), _worker(tmp_path, 1, lighthouse, "--steps", "30",
                                                                           "--die-at", "8")]
    assert _run(groups, tmp_path / "go", 120, 60) == [0, -9]
    events = groups[0].events()
    failed = [e for e in events if e["event"] == "not_committed"]
    assert [e["step"] for e in failed] == [7] and "Connection" in failed[0]["reason"]  # 7 steps done: the 8th failed
    assert _committed(events) == list(range(1, 31))
    # What the survivor printed about it: one warning line, no traceback.
    output = groups[0].output.read_text()
    assert "Traceback" not in output and "got exception" not in output, output
    said = [line for line in output.splitlines() if "lost" in line or "not committed" in line]
    assert len(said) == 1 and "1 group(s) lost" in said[0] and "step 8 was not committed" in said[0], said
    assert "Connection" in said[0] and "This is typically caused" not in said[0]
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
    assert _run(groups, tmp_path / "go", 120, 60) == [1, -9]
    events = groups[0].events()
    assert [e["lost"] for e in events if e["event"] == "replica_lost"] == [1] and _committed(events) == [1, 2, 3, 4]
    assert "FaultToleranceError: 1 replica group failure(s) so far, more than max_failures=0" in groups[0].output.read_text()


def test_start_groups_waits_for_a_late_group(tmp_path, lighthouse):
    """start_groups=2 with 2 ranks per group (FSDP2 inside): group 0 starts alone and waits
    at its first step (both of its ranks, on the same quorums) until group 1, started only
    once group 0 says it waits, is in the quorum: every step is trained by both groups."""
    flags = ("--steps", "8", "--start-groups", "2", "--parallel", "fsdp")
    first, late = (_worker(tmp_path, g, lighthouse, *flags, nproc=2) for g in (0, 1))
    groups = [first, late]
    try:
        first.start()
        wait_until(lambda: any(e["event"] == "waiting_for_groups" for e in first.events()), groups, 300,
                   "group 0 waiting for group 1")
        late.start()
        assert [group.wait(timeout=300) for group in groups] == [0, 0]
    finally:
        for group in groups:
            group.kill()
    for group in groups:
        steps = [e for e in group.events() if e["event"] == "step"]
        assert _committed(steps) == list(range(1, 9)) and {e["participants"] for e in steps} == {2}
    waited = [e for e in first.events() if e["event"] == "waiting_for_groups"]
    assert [(e["participants"], e["wanted"]) for e in waited] == [(1, 2)]


def test_start_groups_never_reached_fails_within_the_quorum_timeout(tmp_path, lighthouse):
    """start_groups=2 and only one group: FaultToleranceError (exit 1) after quorum_timeout_s,
    naming the count; no step trained."""
    alone = _worker(tmp_path, 0, lighthouse, "--steps", "5", "--start-groups", "2", "--quorum-timeout", "2")
    try:
        alone.start()
        assert alone.wait(timeout=300) == 1
    finally:
        alone.kill()
    assert ("FaultToleranceError: replica group 0: 1 of start_groups=2 groups joined within quorum_timeout_s=2 s"
            in alone.output.read_text())
    assert not [e for e in alone.events() if e["event"] == "step"]


def test_every_group_lost_resumes_from_disk(tmp_path, lighthouse):
    """Both groups SIGKILLed at once: their disk checkpoints (every 5 steps, the Manager's
    committed-step count included) resume the run, and they finish identical."""
    args = ("--steps", "40", "--checkpoint-interval", "5")
    groups = [_worker(tmp_path, g, lighthouse, *args) for g in (0, 1)]

    def newest(group):
        infos = list_checkpoints(group.dir / "checkpoints")
        return infos[-1].step if infos else 0

    try:
        start_together(groups, tmp_path / "go-1")
        wait_until(lambda: min(newest(g) for g in groups) >= 15, groups, 300, "a checkpoint at step 15 in both groups")
        for group in groups:
            group.kill()
        killed = time.time()
        saved = max(newest(g) for g in groups)
        start_together(groups, tmp_path / "go-2")
        assert [g.wait(timeout=300) for g in groups] == [0, 0]
    finally:
        for group in groups:
            group.kill()
    for group in groups:
        second = [e for e in group.events() if e["time"] > killed]
        # The first quorum stands at the newest checkpoint's step: the Manager's count came
        # back from disk (a group whose own newest checkpoint is older resumed from the other's).
        assert [e["step"] for e in second if e["event"] == "quorum"][0] == saved
        assert _committed(second) == list(range(saved + 1, 41))
    assert _same(*(_final_params(g, tmp_path) for g in groups))


# --------------------------------------------------------------------- checkpoints shared, a late group
def test_groups_sharing_an_explicit_checkpoint_root(tmp_path, lighthouse):
    """Two groups given the same CheckpointParameters(root_dir=...) each checkpoint into
    their own replica_group_<id> subdirectory: both finish, each with its own checkpoints."""
    shared = tmp_path / "shared_checkpoints"
    args = ("--steps", "20", "--checkpoint-interval", "5", "--checkpoint-root", str(shared))
    groups = [_worker(tmp_path, g, lighthouse, *args) for g in (0, 1)]
    assert _run(groups, tmp_path / "go", 300, 300) == [0, 0]
    for g in (0, 1):
        assert [info.step for info in list_checkpoints(shared / f"replica_group_{g}")] == [10, 15, 20]  # keep_last=3
        assert not list((shared / f"replica_group_{g}").glob(".staging-*"))
    assert sorted(p.name for p in shared.iterdir()) == ["replica_group_0", "replica_group_1"]
    assert not (groups[0].dir / "checkpoints").exists()


def _finish_without_group_1(tmp_path, lighthouse, *args):
    """Group 1 dies at step 5; group 0 finishes the run (20 steps) alone; then group 1 is
    restarted, its peers gone. Returns the groups and group 1's exit status."""
    groups = [_worker(tmp_path, 0, lighthouse, "--steps", "20", *args),
              _worker(tmp_path, 1, lighthouse, "--steps", "20", "--die-at", "5", *args)]
    try:
        assert _run(groups, tmp_path / "go", 300, 60) == [0, -9]
        groups[1].start([a for a in groups[1].argv if a not in ("--die-at", "5")])
        return groups, groups[1].wait(timeout=300)
    finally:
        for group in groups:
            group.kill()


def test_a_group_restarted_after_its_peers_finished_resumes_from_their_checkpoint(tmp_path, lighthouse):
    """Alone, it resumes from the newest checkpoint of the run it can see (group 0's final
    one): it ends with group 0's model, without training alone from an older state."""
    groups, code = _finish_without_group_1(tmp_path, lighthouse)
    assert code == 0
    last = list_checkpoints(groups[0].dir / "checkpoints")[-1]
    assert last.step == 20
    assert f"resumes from {last.path}" in groups[1].output.read_text()
    restarted = [e for e in groups[1].events() if e["event"] == "end"][-1]
    assert restarted["status"] == "completed" and restarted["step"] == 20
    assert _committed(groups[1].events()) == [1, 2, 3, 4]  # nothing trained after the restart
    assert _same(torch.load(groups[0].dir / "final.rank0.pt"), torch.load(groups[1].dir / "final.rank0.pt"))


def test_a_group_restarted_after_its_peers_finished_fails_without_a_checkpoint(tmp_path, lighthouse):
    """No checkpoint to resume from: it fails at its first quorum with a clear error rather
    than train the run alone again from step 0 and exit 0 with another model."""
    groups, code = _finish_without_group_1(tmp_path, lighthouse, "--no-checkpoint")
    assert code == 1
    output = groups[1].output.read_text()
    assert "FaultToleranceError: replica group 1 stands at step 0 after its first quorum (1 group(s)), but this " \
           "run was finished at step 20" in output
    assert not [e for e in groups[1].events() if e["event"] == "step" and e["step"] > 4]


# --------------------------------------------------------------------- the all-reduce overlaps backward
def test_the_gradient_all_reduce_overlaps_backward(tmp_path, lighthouse):
    """With small buckets, every bucket's cross-group all-reduce starts during backward
    (none is left for trainer.step), and the model is exactly the one of a run whose
    all-reduces all start after backward."""
    finals = {}
    for mode in ("overlap", "no-overlap"):
        root = tmp_path / mode
        flags = ("--steps", "12", "--bucket-mb", "0.001", *(["--no-overlap"] if mode == "no-overlap" else []))
        groups = [_worker(root, g, lighthouse, *flags) for g in (0, 1)]
        assert _run(groups, root / "go", 300, 300) == [0, 0]
        records = [r for group in groups for r in _samples(group)]
        assert len(records) == 24 and all(r["committed"] and r["participants"] == 2 for r in records)
        assert records[0]["buckets"] >= 2
        started = {r["started_in_backward"] for r in records}
        assert started == ({records[0]["buckets"]} if mode == "overlap" else {0})
        finals[mode] = [torch.load(group.dir / "final.rank0.pt") for group in groups]
        assert _same(*finals[mode])
    assert _same(finals["overlap"][0], finals["no-overlap"][0])

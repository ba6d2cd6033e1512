"""Fault tolerance (torchft) on one machine: what it costs and how fast it recovers.

For each trainer-state size (model + AdamW state, what a heal transfers): plain DDP (2
ranks) and two fault-tolerant replica groups (1 process each, a lighthouse in this
process) of the same model on the same data, run in the order DDP, FT, FT, DDP (ABBA: a
drift of the machine's speed during the four runs cancels out of the ratio), then one
fault-tolerant run in which a group is killed and restarted.

Both runs do the same work per process: 1 intra-op thread, a batch of 4 per process (a
DDP rank, a replica group), no log step inside the run (DDP's would all-reduce the logged
metrics over its ranks and read them, a group's is local), the same C-library memory
policy (glibc's malloc keeps freed memory: left to its own heuristics it gave the DDP ranks
1,000-20,000 page faults per step and the groups 1-2), and the same steps timed (after
the warm-up, with both ranks or both groups). Every process records its CPU time and page
faults per step, so the JSON shows that the work matched; a run whose threads or batch
differ from the other's stops the benchmark.

    steady      median step time with fault tolerance / with DDP (quorum, the bucketed
                all-reduce across groups started during backward, commit vote) -- the
                steady-state overhead: the sum of the two FT medians over the sum of the
                two DDP medians
    stall       group 1 is SIGKILLed mid-run: the survivor's longest step after it minus
                its median step (the failed all-reduce, then the quorum that waits for the
                lighthouse to declare group 1 dead: about its heartbeat timeout)
    heal        group 1 restarted: the quorum that heals it (fetch the survivor's state
                over HTTP and load it); the survivor's longest step meanwhile (it serves the
                state); and from the restart to the first committed step
    lost        committed steps missing or repeated at the survivor (must be 0)

Targets: steady overhead <= 1.05x; no committed step lost; stall <= heartbeat timeout + 1 s;
heal of ~300 MB <= 2 s.

    python benchmarks/ft_recovery.py             # 10, 100, 300, 1000 MB (~25 minutes on 2 cores)
    python benchmarks/ft_recovery.py --quick     # 10 and 50 MB, one round (~1.5 minutes)
    python benchmarks/ft_recovery.py --smoke     # 10 MB, one DDP and one FT run, a short recovery: a check
                                                 # that it runs and writes its JSON (CI), not a measurement
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import machine, write_json  # noqa: E402
from dream_trainer.testing.fault_tolerance import ReplicaGroup, StartGate, start_together, wait_until  # noqa: E402

from dream_trainer import (  # noqa: E402
    Callback,
    DeviceParameters,
    DreamTrainer,
    FaultToleranceCallback,
    FaultToleranceParameters,
    LoggingParameters,
    TrainerConfig,
    TrainingParameters,
    entrypoint,
)

WIDTH = 1024
MB_PER_LAYER = 3 * (WIDTH * WIDTH + WIDTH) * 4 / 2**20  # parameters + AdamW's two moments, float32
BATCH = 4  # samples per step of each process: a DDP rank, a replica group (1 process)
THREADS = 1  # intra-op threads of each process, DDP rank or replica group
NO_LOG = 10**9  # log_every_n_steps: no log step inside a run (see `worker`)


class Wide(DreamTrainer):
    def __init__(self, config: TrainerConfig, layers: int, ft: bool):
        super().__init__(config)
        self.layers, self.ft = layers, ft

    def configure_models(self) -> None:
        self.model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(self.layers)])

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def configure_dataloaders(self) -> tuple[Any, None]:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(4096, WIDTH, generator=g))
        if self.ft:
            from dream_trainer.fault_tolerance import FaultTolerantSampler

            return DataLoader(data, batch_sampler=FaultTolerantSampler(data, BATCH, self.world)), None
        shard = slice(self.world.dp_rank, None, self.world.dp_size)
        return DataLoader(TensorDataset(data.tensors[0][shard]), batch_size=BATCH), None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        loss = self.model(batch[0]).pow(2).mean()
        self.backward(loss)
        self.step(self.optimizer)
        return {"loss": loss}


def _steps_file(directory: Path, rank: int = 0) -> Path:
    """Where `Record` writes the steps of one process (a DDP rank, a replica group's rank)."""
    return Path(directory) / f"steps_rank{rank}.jsonl"


class Record(Callback[Any]):
    """Per optimizer step, in every process: {step, committed, participants, seconds, time,
    samples, threads, cpu_s, minor_faults} -> ``steps_rank<rank>.jsonl`` in the run's (or the
    group's) directory. ``cpu_s`` and ``minor_faults`` are the process's totals so far (all
    its threads): their differences between two steps are what the step cost it."""

    def pre_fit(self) -> None:
        self.trainer.request_batch_counts()  # each step's samples (the batch per process)

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        trainer = self.trainer
        usage = resource.getrusage(resource.RUSAGE_SELF)
        record = {"step": trainer.global_step, "committed": not trainer.step_skipped, "time": time.time(),
                  "participants": getattr(trainer.world, "participants", trainer.world.world_size),
                  "seconds": trainer.step_stats.step_time_s, "samples": trainer.step_stats.samples,
                  "threads": torch.get_num_threads(), "cpu_s": usage.ru_utime + usage.ru_stime,
                  "minor_faults": usage.ru_minflt}
        with open(_steps_file(trainer.run_dir, trainer.world.rank), "a") as f:
            f.write(json.dumps(record) + "\n")


def worker() -> Wide:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--group", type=int, default=None)
    p.add_argument("--gate", default=None)
    args = p.parse_args()
    torch.set_num_threads(THREADS)  # OMP_NUM_THREADS says so too (`_env`): a DDP rank and a group alike
    ft = args.group is not None
    callbacks: list[Callback[Any]] = [Record()]
    if ft:
        callbacks.insert(0, FaultToleranceCallback(FaultToleranceParameters(replica_group_id=args.group, timeout_s=60.0)))
    if args.gate:
        callbacks.append(StartGate(args.gate))
    config = TrainerConfig(
        experiment="ft_recovery", run_name="ft" if ft else "ddp", root_dir=args.root, seed=0,
        device_parameters=DeviceParameters.DDP(),
        training_parameters=TrainingParameters(n_epochs=None, max_steps=args.steps, num_sanity_val_steps=0),
        # No log step inside a run: DDP's all-reduces the logged metrics over its 2 ranks and
        # reads them (a blocking collective), a group's logs locally and writes an event line.
        # Neither is the fault tolerance being measured. `Record` writes every step in both.
        logging_parameters=LoggingParameters(log_every_n_steps=NO_LOG), callbacks=callbacks)
    trainer = Wide(config, args.layers, ft)
    trainer.fit()
    return trainer


# ------------------------------------------------------------------------------ orchestration
WARMUP = 3  # steps left out of the medians


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _env() -> dict[str, str]:
    """The environment of every process of every run, DDP's and the groups' alike."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS=str(THREADS),
               # glibc's malloc hands freed memory back to the kernel by heuristics (a dynamic
               # mmap threshold, trimming the heap's top) that depend on a program's history of
               # allocations: left alone, the DDP ranks faulted 1,000-20,000 pages back in per
               # step (~30 ms of CPU at 17,000-20,000), the groups 1-2. With both set, freed
               # memory stays in the process, in both runs. Other C libraries ignore them.
               MALLOC_MMAP_THRESHOLD_=str(2**30), MALLOC_TRIM_THRESHOLD_=str(2**30))
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)  # each group is its own one-process world
    return env


def _me(layers: int, steps: int) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--worker", "--layers", str(layers), "--steps", str(steps)]


def _timed(rows: list[dict[str, Any]], steps: int) -> list[dict[str, Any]]:
    """The steps a run is timed on, the same rule for DDP and FT: steps WARMUP+1 to
    WARMUP+`steps`, committed, with both ranks or both groups."""
    return [r for r in rows if WARMUP < r["step"] <= WARMUP + steps and r["committed"] and r["participants"] == 2]


def _run_stats(files: list[Path], steps: int) -> dict[str, Any]:
    """A steady-state run from its two processes' records (`files`: DDP's ranks 0 and 1, or
    groups 0 and 1): ``step_s``, the median timed step of the first process (both are in
    lockstep); ``cpu_s``, the CPU time of a timed step, the two processes' medians summed;
    ``minor_faults``, the page faults of a timed step, the larger of the two medians;
    ``threads`` and ``samples``, what the processes' steps used (per process)."""
    out: dict[str, Any] = {"cpu_s": 0.0, "minor_faults": 0, "threads": set(), "samples": set()}
    for i, path in enumerate(files):
        rows = _read(path)
        timed = _timed(rows, steps)
        if not timed:
            raise RuntimeError(f"{path}: no timed step")
        pairs = [(a, b) for a, b in zip(rows, rows[1:]) if b in timed]  # each timed step and the record before it
        if i == 0:
            out["step_s"] = statistics.median(r["seconds"] for r in timed)
        out["cpu_s"] += statistics.median(b["cpu_s"] - a["cpu_s"] for a, b in pairs)
        out["minor_faults"] = max(out["minor_faults"], statistics.median(b["minor_faults"] - a["minor_faults"]
                                                                          for a, b in pairs))
        out["threads"] |= {r["threads"] for r in timed}
        out["samples"] |= {r["samples"] for r in timed}
    out["threads"], out["samples"] = sorted(out["threads"]), sorted(out["samples"])
    return out


def _ddp_run(layers: int, steps: int, root: Path) -> dict[str, Any]:
    """DDP on 2 ranks (``--nproc 2``), `steps` steps after warm-up: `_run_stats`."""
    import subprocess

    code = subprocess.call([*_me(layers, steps + WARMUP), "--root", str(root), "--nproc", "2"], env=_env(), timeout=1200)
    if code:
        raise RuntimeError(f"the DDP run exited with {code}")
    run_dir = root / "ft_recovery" / "ddp"
    return _run_stats([_steps_file(run_dir, 0), _steps_file(run_dir, 1)], steps)


def _groups(layers: int, steps: int, root: Path, address: str) -> list[ReplicaGroup]:
    env = dict(_env(), TORCHFT_LIGHTHOUSE=address)
    run_dir = root / "ft_recovery" / "ft"
    return [ReplicaGroup([*_me(layers, steps), "--root", str(root), "--group", str(g)], run_dir / f"replica_group_{g}",
                         env) for g in (0, 1)]


def _ft_run(layers: int, steps: int, root: Path, heartbeat_ms: int) -> dict[str, Any]:
    """Two groups started together (both in the first quorum), `steps` steps after warm-up:
    `_run_stats` (group 0 first)."""
    from dream_trainer.fault_tolerance import Lighthouse

    with Lighthouse(bind="127.0.0.1:0", heartbeat_timeout_ms=heartbeat_ms, join_timeout_ms=200) as lh:
        groups = _groups(layers, steps + WARMUP, root, lh.address)
        try:
            start_together(groups, root / "go", timeout=1200)
            codes = [group.wait(timeout=1200) for group in groups]
        finally:
            for group in groups:
                group.kill()
    if codes != [0, 0]:
        raise RuntimeError(f"the fault-tolerant groups exited with {codes}")
    return _run_stats([_steps_file(group.dir) for group in groups], steps)


def _check_same_work(ddp: dict[str, Any], ft: dict[str, Any]) -> None:
    """Stop when the DDP and FT runs did not use the same threads and batch per process."""
    for key in ("threads", "samples"):
        if ddp[key] != ft[key] or len(ddp[key]) != 1:
            raise RuntimeError(f"DDP and FT runs differ in {key} per process: {ddp[key]} vs {ft[key]}")


def steady(size_mb: float, steps: int, root: Path, heartbeat_ms: int, rounds: int, seconds: float,
           order: str = "ABBA") -> dict[str, Any]:
    """`rounds` x (DDP, FT, FT, DDP): the medians of every run and the overhead, the sum of
    the FT medians over the sum of the DDP medians (each round is ABBA: a linear drift of
    the machine's speed cancels out), with each round's own ratio; per run also its CPU time
    and page faults per step. Each run has at least `steps` steps, more for a small model
    (about `seconds` of steps, from a DDP probe run; `seconds` 0: no probe). `order` "AB":
    one DDP and one FT run per round (``--smoke``: no drift cancels out)."""
    layers = max(1, round(size_mb / MB_PER_LAYER))
    if seconds > 0:
        probe = _ddp_run(layers, steps, root / f"probe_{layers}")["step_s"]
        steps = min(max(steps, round(seconds / probe)), 400)
    runs: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}  # A: DDP, B: FT
    for r in range(rounds):
        for i, kind in enumerate(order):
            run_root = root / f"{'ddp' if kind == 'A' else 'ft'}_{layers}_{r}{'abcd'[i]}"
            runs[kind].append(_ddp_run(layers, steps, run_root) if kind == "A" else
                              _ft_run(layers, steps, run_root, heartbeat_ms))
            _check_same_work(runs["A"][0], runs[kind][-1])
    ddp, ft = [x["step_s"] for x in runs["A"]], [x["step_s"] for x in runs["B"]]
    per = len(ddp) // rounds
    per_round = [sum(ft[per * r:per * r + per]) / sum(ddp[per * r:per * r + per]) for r in range(rounds)]
    return {"state_mb": round(layers * MB_PER_LAYER, 1), "layers": layers, "steady_steps": steps, "order": order,
            "threads_per_process": runs["A"][0]["threads"][0], "batch_per_process": runs["A"][0]["samples"][0],
            "ddp_step_s": ddp, "ft_step_s": ft, "overhead_per_round": per_round, "steady_overhead": sum(ft) / sum(ddp),
            "ddp_cpu_s_per_step": [x["cpu_s"] for x in runs["A"]], "ft_cpu_s_per_step": [x["cpu_s"] for x in runs["B"]],
            "ddp_minor_faults_per_step": [x["minor_faults"] for x in runs["A"]],
            "ft_minor_faults_per_step": [x["minor_faults"] for x in runs["B"]]}


def recovery(layers: int, steps: int, root: Path, heartbeat_ms: int, after: int = 5) -> dict[str, Any]:
    """Two groups: `steps` steps together, group 1 SIGKILLed, `after` steps of group 0
    alone, group 1 restarted, `after` steps together, then both stopped (SIGTERM)."""
    from dream_trainer.fault_tolerance import Lighthouse

    out: dict[str, Any] = {}
    with Lighthouse(bind="127.0.0.1:0", heartbeat_timeout_ms=heartbeat_ms, join_timeout_ms=200) as lh:
        groups = _groups(layers, 10**6, root, lh.address)  # endless: stopped once the restarted group trains again
        steps_of = [lambda g=g: _read(_steps_file(groups[g].dir)) for g in (0, 1)]

        def committed_after(g: int, since: float, participants: int) -> int:
            return sum(1 for r in steps_of[g]() if r["time"] > since and r["committed"] and r["participants"] == participants)

        try:
            start_together(groups, root / "go", timeout=1200)
            wait_until(lambda: committed_after(1, 0, 2) >= steps, groups, 1200, "steps with both groups")
            killed = time.time()
            groups[1].kill()
            wait_until(lambda: committed_after(0, killed, 1) >= after, groups[:1], 600, "steps of group 0 alone")
            restarted = time.time()
            groups[1].start()  # behind the gate, open
            wait_until(lambda: committed_after(1, restarted, 2) >= after, groups, 1200, "steps after the restart")
            for group in groups:
                group.terminate()
            codes = [group.wait(timeout=600) for group in groups]
            if any(code not in (0, 75) for code in codes):
                raise RuntimeError(f"the fault-tolerant groups exited with {codes}")
        finally:
            for group in groups:
                group.kill()
    survivor = steps_of[0]()
    median = statistics.median(r["seconds"] for r in survivor if r["participants"] == 2 and r["step"] > WARMUP
                               and r["time"] < killed)
    out["stall_s"] = max(r["seconds"] for r in survivor if killed < r["time"] < restarted) - median
    out["join_stall_s"] = max(r["seconds"] for r in survivor if r["time"] > restarted) - median  # while it sends
    heals = [e for e in groups[1].events() if e["event"] == "heal" and e["time"] > restarted]
    out["heal_s"] = heals[0]["seconds"] if heals else None
    out["heal_load_s"] = heals[0]["load_s"] if heals else None  # of which: loading it into the trainer
    first_commit = min(r["time"] for r in steps_of[1]() if r["time"] > restarted and r["committed"])
    out["restart_to_commit_s"] = first_commit - restarted
    committed = [r["step"] for r in survivor if r["committed"]]
    out["lost_steps"] = len(set(range(1, max(committed) + 1)) ^ set(committed)) + len(committed) - len(set(committed))
    return out


def measure(size_mb: float, steps: int, root: Path, heartbeat_ms: int, rounds: int, seconds: float,
            order: str = "ABBA", after: int = 5) -> dict[str, Any]:
    row = steady(size_mb, steps, root, heartbeat_ms, rounds, seconds, order)
    row.update(recovery(row["layers"], steps, root / f"recovery_{row['layers']}", heartbeat_ms, after))
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="10,100,300,1000", help="trainer-state sizes in MB")
    p.add_argument("--steps", type=int, default=20, help="steps per steady-state run (after 3 of warm-up), and with "
                                                         "both groups before the kill")
    p.add_argument("--rounds", type=int, default=3, help="rounds of DDP, FT, FT, DDP runs per size")
    p.add_argument("--run-seconds", type=float, default=4.0, help="seconds of steps per steady-state run, at least")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=1000)
    p.add_argument("--quick", action="store_true", help="10 and 50 MB, one round, 12+ steps")
    p.add_argument("--smoke", action="store_true", help="10 MB, one DDP and one FT run of 5 steps, a recovery with 2 "
                                                        "steps alone and 2 after the restart: that it runs (CI), "
                                                        "not a measurement")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "ft_recovery.json"))
    args = p.parse_args(argv)
    order, after = "ABBA", 5
    if args.quick:
        args.sizes, args.steps, args.rounds, args.run_seconds = "10,50", 12, 1, 1.0
    if args.smoke:
        # 5 steps: the recovery's median needs a step of group 0 after the warm-up before the kill.
        args.sizes, args.steps, args.rounds, args.run_seconds, order, after = "10", 5, 1, 0.0, "AB", 2
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in [float(s) for s in args.sizes.split(",")]:
            row = measure(size, args.steps, Path(tmp), args.heartbeat_timeout_ms, args.rounds, args.run_seconds,
                          order, after)
            rows.append(row)
            print(f"  {row['state_mb']:.0f} MB done: {row}", flush=True)
    limit = args.heartbeat_timeout_ms / 1000 + 1
    runs = "DDP, FT" if order == "AB" else "DDP, FT, FT, DDP"
    print(f"\nfault tolerance (torchft), 2 replica groups x 1 process vs DDP 2 ranks, {THREADS} thread and a batch of "
          f"{BATCH} per process, no log step, freed memory kept; lighthouse heartbeat timeout "
          f"{args.heartbeat_timeout_ms} ms; torch {torch.__version__}; {args.rounds} round(s) of {runs} runs per size, "
          f"each of {args.steps}+ steps{' (--smoke: not a measurement)' if args.smoke else ''}\n")
    print(f"{'state MB':>9} {'DDP s/step':>11} {'FT s/step':>10} {'overhead':>9} {'per round':>15} "
          f"{'CPU s/step DDP FT':>18} {'faults/step DDP FT':>19} {'stall s':>8} {'heal s':>7} {'sender s':>9} "
          f"{'restart->commit s':>18} {'lost':>5}")
    for r in rows:
        rounds = " ".join(f"{x:.3f}" for x in r["overhead_per_round"])
        cpu = f"{statistics.mean(r['ddp_cpu_s_per_step']):.3f} {statistics.mean(r['ft_cpu_s_per_step']):.3f}"
        faults = f"{max(r['ddp_minor_faults_per_step']):.0f} {max(r['ft_minor_faults_per_step']):.0f}"
        print(f"{r['state_mb']:>9.0f} {statistics.mean(r['ddp_step_s']):>11.3f} {statistics.mean(r['ft_step_s']):>10.3f} "
              f"{r['steady_overhead']:>8.3f}x {rounds:>15} {cpu:>18} {faults:>19} {r['stall_s']:>8.2f} "
              f"{r['heal_s'] or float('nan'):>7.2f} {r['join_stall_s']:>9.2f} {r['restart_to_commit_s']:>18.2f} "
              f"{r['lost_steps']:>5}")
    near_300 = min(rows, key=lambda r: abs(r["state_mb"] - 300))
    targets = {
        "steady overhead <= 1.05x": all(r["steady_overhead"] <= 1.05 for r in rows),
        "no committed step lost": all(r["lost_steps"] == 0 for r in rows),
        f"stall <= {limit:g} s": all(r["stall_s"] <= limit for r in rows),
        f"heal of {near_300['state_mb']:.0f} MB <= 2 s": near_300["heal_s"] is not None and near_300["heal_s"] <= 2.0,
    }
    print("\n" + "\n".join(f"  {name}: {'met' if ok else 'NOT MET'}" for name, ok in targets.items()))
    print(f"  s/step = the mean of the runs' median steps; overhead = the sum of the FT medians over the sum of the\n"
          f"  DDP medians, runs in the order {runs} per round (per round: that round's ratio); CPU s/step = the\n"
          f"  CPU time of a step, both processes together; faults/step = page faults of a step, the worst process;\n"
          "  stall = the survivor's longest step between the kill and the restart minus its median step;\n"
          "  heal = the quorum that heals the restarted group (fetch + load); sender = the survivor's longest\n"
          "  step while it serves the heal, minus its median; restart->commit includes starting Python and torch.")
    result = {"machine": machine(), "heartbeat_timeout_ms": args.heartbeat_timeout_ms, "steps": args.steps,
              "rounds": args.rounds, "order": order, "smoke": args.smoke, "threads_per_process": THREADS,
              "batch_per_process": BATCH, "rows": rows, "targets": targets}
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    if "--worker" in sys.argv:
        raise SystemExit(entrypoint(worker).exit_code)
    main()

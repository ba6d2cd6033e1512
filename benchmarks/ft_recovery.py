"""Fault tolerance (torchft) on one machine: what it costs and how fast it recovers.

For each trainer-state size (model + AdamW state, what a heal transfers): plain DDP (2
ranks) and two fault-tolerant replica groups (1 process each, a lighthouse in this
process) of the same model on the same data, run in the order DDP, FT, FT, DDP (ABBA: a
drift of the machine's speed during the four runs cancels out of the ratio), then one
fault-tolerant run in which a group is killed and restarted:

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

    python benchmarks/ft_recovery.py             # 10, 100, 300, 1000 MB (~10 minutes on 2 cores)
    python benchmarks/ft_recovery.py --quick     # 10 and 50 MB
"""

from __future__ import annotations

import argparse
import json
import os
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

            return DataLoader(data, batch_sampler=FaultTolerantSampler(data, 4, self.world)), None
        shard = slice(self.world.dp_rank, None, self.world.dp_size)
        return DataLoader(TensorDataset(data.tensors[0][shard]), batch_size=4), None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        loss = self.model(batch[0]).pow(2).mean()
        self.backward(loss)
        self.step(self.optimizer)
        return {"loss": loss}


class Record(Callback[Any]):
    """Per optimizer step: {step, committed, participants, seconds, time} -> steps.jsonl (rank 0)."""

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        trainer = self.trainer
        if trainer.world.rank != 0:
            return
        record = {"step": trainer.global_step, "committed": not trainer.step_skipped, "time": time.time(),
                  "participants": getattr(trainer.world, "participants", trainer.world.world_size),
                  "seconds": trainer.step_stats.step_time_s}
        with open(Path(trainer.run_dir) / "steps.jsonl", "a") as f:
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
        logging_parameters=LoggingParameters(log_every_n_steps=1), callbacks=callbacks)
    trainer = Wide(config, args.layers, ft)
    trainer.fit()
    return trainer


# ------------------------------------------------------------------------------ orchestration
WARMUP = 3  # steps left out of the medians


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _env() -> dict[str, str]:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)  # each group is its own one-process world
    return env


def _me(layers: int, steps: int) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--worker", "--layers", str(layers), "--steps", str(steps)]


def _ddp_median(layers: int, steps: int, root: Path) -> float:
    import subprocess

    code = subprocess.call([*_me(layers, steps + WARMUP), "--root", str(root), "--nproc", "2"], env=_env(), timeout=1200)
    if code:
        raise RuntimeError(f"the DDP run exited with {code}")
    return statistics.median(r["seconds"] for r in _read(root / "ft_recovery" / "ddp" / "steps.jsonl")[WARMUP:])


def _groups(layers: int, steps: int, root: Path, address: str) -> list[ReplicaGroup]:
    env = dict(_env(), TORCHFT_LIGHTHOUSE=address)
    run_dir = root / "ft_recovery" / "ft"
    return [ReplicaGroup([*_me(layers, steps), "--root", str(root), "--group", str(g)], run_dir / f"replica_group_{g}",
                         env) for g in (0, 1)]


def _ft_median(layers: int, steps: int, root: Path, heartbeat_ms: int) -> float:
    """Two groups started together (both in the first quorum), `steps` steps after warm-up:
    group 0's median step with both groups."""
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
    steps_of = _read(groups[0].dir / "steps.jsonl")
    return statistics.median(r["seconds"] for r in steps_of if r["participants"] == 2 and r["step"] > WARMUP)


def steady(size_mb: float, steps: int, root: Path, heartbeat_ms: int, rounds: int, seconds: float) -> dict[str, Any]:
    """`rounds` x (DDP, FT, FT, DDP): the medians of every run and the overhead, the sum of
    the FT medians over the sum of the DDP medians (each round is ABBA: a linear drift of
    the machine's speed cancels out), with each round's own ratio. Each run has at least
    `steps` steps, more for a small model (about `seconds` of steps, from a DDP probe run)."""
    layers = max(1, round(size_mb / MB_PER_LAYER))
    probe = _ddp_median(layers, steps, root / f"probe_{layers}")
    steps = min(max(steps, round(seconds / probe)), 400)
    ddp: list[float] = []
    ft: list[float] = []
    for r in range(rounds):
        ddp.append(_ddp_median(layers, steps, root / f"ddp_{layers}_{r}a"))
        ft.append(_ft_median(layers, steps, root / f"ft_{layers}_{r}a", heartbeat_ms))
        ft.append(_ft_median(layers, steps, root / f"ft_{layers}_{r}b", heartbeat_ms))
        ddp.append(_ddp_median(layers, steps, root / f"ddp_{layers}_{r}b"))
    per_round = [sum(ft[2 * r:2 * r + 2]) / sum(ddp[2 * r:2 * r + 2]) for r in range(rounds)]
    return {"state_mb": round(layers * MB_PER_LAYER, 1), "layers": layers, "steady_steps": steps, "ddp_step_s": ddp,
            "ft_step_s": ft, "overhead_per_round": per_round, "steady_overhead": sum(ft) / sum(ddp)}


def recovery(layers: int, steps: int, root: Path, heartbeat_ms: int) -> dict[str, Any]:
    """Two groups: `steps` steps together, group 1 SIGKILLed, 5 steps of group 0 alone,
    group 1 restarted, 5 steps together, then both stopped (SIGTERM)."""
    from dream_trainer.fault_tolerance import Lighthouse

    out: dict[str, Any] = {}
    with Lighthouse(bind="127.0.0.1:0", heartbeat_timeout_ms=heartbeat_ms, join_timeout_ms=200) as lh:
        groups = _groups(layers, 10**6, root, lh.address)  # endless: stopped once the restarted group trains again
        steps_of = [lambda g=g: _read(groups[g].dir / "steps.jsonl") for g in (0, 1)]

        def committed_after(g: int, since: float, participants: int) -> int:
            return sum(1 for r in steps_of[g]() if r["time"] > since and r["committed"] and r["participants"] == participants)

        try:
            start_together(groups, root / "go", timeout=1200)
            wait_until(lambda: committed_after(1, 0, 2) >= steps, groups, 1200, "steps with both groups")
            killed = time.time()
            groups[1].kill()
            wait_until(lambda: committed_after(0, killed, 1) >= 5, groups[:1], 600, "steps of group 0 alone")
            restarted = time.time()
            groups[1].start()  # behind the gate, open
            wait_until(lambda: committed_after(1, restarted, 2) >= 5, groups, 1200, "steps after the restart")
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


def measure(size_mb: float, steps: int, root: Path, heartbeat_ms: int, rounds: int, seconds: float) -> dict[str, Any]:
    row = steady(size_mb, steps, root, heartbeat_ms, rounds, seconds)
    row.update(recovery(row["layers"], steps, root / f"recovery_{row['layers']}", heartbeat_ms))
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="10,100,300,1000", help="trainer-state sizes in MB")
    p.add_argument("--steps", type=int, default=20, help="steps per steady-state run (after 3 of warm-up), and with "
                                                         "both groups before the kill")
    p.add_argument("--rounds", type=int, default=3, help="rounds of DDP, FT, FT, DDP runs per size")
    p.add_argument("--run-seconds", type=float, default=4.0, help="seconds of steps per steady-state run, at least")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=1000)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "ft_recovery.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.steps, args.rounds, args.run_seconds = "10,50", 12, 1, 1.0
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in [float(s) for s in args.sizes.split(",")]:
            row = measure(size, args.steps, Path(tmp), args.heartbeat_timeout_ms, args.rounds, args.run_seconds)
            rows.append(row)
            print(f"  {row['state_mb']:.0f} MB done: {row}", flush=True)
    limit = args.heartbeat_timeout_ms / 1000 + 1
    print(f"\nfault tolerance (torchft), 2 replica groups x 1 process vs DDP 2 ranks, 1 thread each; "
          f"lighthouse heartbeat timeout {args.heartbeat_timeout_ms} ms; torch {torch.__version__}; "
          f"{args.rounds} round(s) of DDP, FT, FT, DDP runs per size, each of {args.steps}+ steps\n")
    print(f"{'state MB':>9} {'DDP s/step':>11} {'FT s/step':>10} {'overhead':>9} {'per round':>15} {'stall s':>8} "
          f"{'heal s':>7} {'sender s':>9} {'restart->commit s':>18} {'lost':>5}")
    for r in rows:
        rounds = " ".join(f"{x:.3f}" for x in r["overhead_per_round"])
        print(f"{r['state_mb']:>9.0f} {statistics.mean(r['ddp_step_s']):>11.3f} {statistics.mean(r['ft_step_s']):>10.3f} "
              f"{r['steady_overhead']:>8.3f}x {rounds:>15} {r['stall_s']:>8.2f} {r['heal_s'] or float('nan'):>7.2f} "
              f"{r['join_stall_s']:>9.2f} {r['restart_to_commit_s']:>18.2f} {r['lost_steps']:>5}")
    near_300 = min(rows, key=lambda r: abs(r["state_mb"] - 300))
    targets = {
        "steady overhead <= 1.05x": all(r["steady_overhead"] <= 1.05 for r in rows),
        "no committed step lost": all(r["lost_steps"] == 0 for r in rows),
        f"stall <= {limit:g} s": all(r["stall_s"] <= limit for r in rows),
        f"heal of {near_300['state_mb']:.0f} MB <= 2 s": near_300["heal_s"] is not None and near_300["heal_s"] <= 2.0,
    }
    print("\n" + "\n".join(f"  {name}: {'met' if ok else 'NOT MET'}" for name, ok in targets.items()))
    print("  s/step = the mean of the runs' median steps; overhead = the sum of the FT medians over the sum of the\n"
          "  DDP medians, runs in the order DDP, FT, FT, DDP per round (per round: that round's ratio);\n"
          "  stall = the survivor's longest step between the kill and the restart minus its median step;\n"
          "  heal = the quorum that heals the restarted group (fetch + load); sender = the survivor's longest\n"
          "  step while it serves the heal, minus its median; restart->commit includes starting Python and torch.")
    result = {"machine": machine(), "heartbeat_timeout_ms": args.heartbeat_timeout_ms, "steps": args.steps,
              "rounds": args.rounds, "rows": rows, "targets": targets}
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    if "--worker" in sys.argv:
        raise SystemExit(entrypoint(worker).exit_code)
    main()

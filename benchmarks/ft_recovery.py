"""Fault tolerance (torchft) on one machine: what it costs and how fast it recovers.

For each trainer-state size (model + AdamW state, what a heal transfers), one run of two
replica groups (1 process each, a lighthouse in this process) and one plain DDP run (2
ranks) of the same model on the same data:

    steady      median step time with fault tolerance / with DDP (quorum, all-reduce
                across groups, commit vote) -- the steady-state overhead
    stall       group 1 is SIGKILLed mid-run: the survivor's longest step after it minus
                its median step (the failed all-reduce, then the quorum that waits for the
                lighthouse to declare group 1 dead: about its heartbeat timeout)
    heal        group 1 restarted: the quorum that heals it (fetch the survivor's state
                over HTTP and load it); the survivor's longest step meanwhile (it serves the
                state); and from the restart to the first committed step
    lost        committed steps missing or repeated at the survivor (must be 0)

Targets: no committed step lost; stall <= heartbeat timeout + 1 s; heal of ~300 MB <= 2 s.

    python benchmarks/ft_recovery.py             # 10, 100, 300, 1000 MB (~6 minutes on 2 cores)
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
            from dream_trainer.ft import FaultTolerantSampler

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
    args = p.parse_args()
    ft = args.group is not None
    callbacks: list[Callback[Any]] = [Record()]
    if ft:
        callbacks.insert(0, FaultToleranceCallback(FaultToleranceParameters(replica_group_id=args.group, timeout_s=60.0)))
    config = TrainerConfig(
        experiment="ft_recovery", run_name="ft" if ft else "ddp", root_dir=args.root, seed=0,
        device_parameters=DeviceParameters.DDP(),
        training_parameters=TrainingParameters(n_epochs=None, max_steps=args.steps, num_sanity_val_steps=0),
        logging_parameters=LoggingParameters(log_every_n_steps=1), callbacks=callbacks)
    trainer = Wide(config, args.layers, ft)
    trainer.fit()
    return trainer


# ------------------------------------------------------------------------------ orchestration
def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait(condition: Any, timeout: float, groups: list[Any]) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        for group in groups:
            if group.returncode not in (None, 0):
                raise RuntimeError(f"{group.dir} exited with status {group.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError("timed out")
        time.sleep(0.02)


def measure(size_mb: float, steps: int, root: Path, heartbeat_ms: int) -> dict[str, Any]:
    import subprocess

    from dream_trainer.ft import Lighthouse
    from dream_trainer.launch import free_port
    from dream_trainer.testing.ft import ReplicaGroup

    layers = max(1, round(size_mb / MB_PER_LAYER))
    me = [sys.executable, str(Path(__file__).resolve()), "--worker", "--layers", str(layers), "--steps", str(steps)]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)  # each group is its own one-process world
    out: dict[str, Any] = {"state_mb": round(layers * MB_PER_LAYER, 1), "layers": layers}

    # Plain DDP, 2 ranks.
    ddp_root = root / f"ddp_{layers}"
    code = subprocess.call([*me, "--root", str(ddp_root), "--nproc", "2"], env=env, timeout=1200)
    if code:
        raise RuntimeError(f"the DDP run exited with {code}")
    ddp = [r["seconds"] for r in _read(ddp_root / "ft_recovery" / "ddp" / "steps.jsonl")[3:]]
    out["ddp_step_s"] = statistics.median(ddp)

    # Fault tolerant, 2 groups: steady state, kill group 1, restart it, then stop both (SIGTERM).
    ft_root = root / f"ft_{layers}"
    ft_cmd = [*me[:-1], str(10**6)]  # endless: stopped once the restarted group trains again
    with Lighthouse(bind=f"127.0.0.1:{free_port()}", heartbeat_timeout_ms=heartbeat_ms, join_timeout_ms=200) as lh:
        env["TORCHFT_LIGHTHOUSE"] = lh.address
        run_dir = ft_root / "ft_recovery" / "ft"
        groups = [ReplicaGroup([*ft_cmd, "--root", str(ft_root), "--group", str(g)], run_dir / f"replica_group_{g}",
                               env) for g in (0, 1)]
        steps_of = [lambda g=g: _read(run_dir / f"replica_group_{g}" / "steps.jsonl") for g in (0, 1)]

        def committed_after(g: int, since: float, participants: int) -> int:
            return sum(1 for r in steps_of[g]() if r["time"] > since and r["committed"] and r["participants"] == participants)

        try:
            for group in groups:
                group.start()
            _wait(lambda: committed_after(1, 0, 2) >= steps, 1200, groups)
            killed = time.time()
            groups[1].kill()
            _wait(lambda: committed_after(0, killed, 1) >= 5, 600, groups[:1])
            restarted = time.time()
            groups[1].start()
            _wait(lambda: committed_after(1, restarted, 2) >= 5, 1200, groups)
            for group in groups:
                group.terminate()
            codes = [group.wait(timeout=600) for group in groups]
            if any(code not in (0, 75) for code in codes):
                raise RuntimeError(f"the fault-tolerant groups exited with {codes}")
        finally:
            for group in groups:
                group.kill()
    survivor = steps_of[0]()
    steady = [r["seconds"] for r in survivor if r["participants"] == 2 and 2 < r["step"] and r["time"] < killed]
    median = statistics.median(steady)
    out["ft_step_s"] = median
    out["steady_overhead"] = median / out["ddp_step_s"]
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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="10,100,300,1000", help="trainer-state sizes in MB")
    p.add_argument("--steps", type=int, default=20, help="steps with both groups before the kill (and DDP steps)")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=1000)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "ft_recovery.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.steps = "10,50", 12
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in [float(s) for s in args.sizes.split(",")]:
            row = measure(size, args.steps, Path(tmp), args.heartbeat_timeout_ms)
            rows.append(row)
            print(f"  {row['state_mb']:.0f} MB done: {row}", flush=True)
    limit = args.heartbeat_timeout_ms / 1000 + 1
    print(f"\nfault tolerance (torchft), 2 replica groups x 1 process vs DDP 2 ranks, 1 thread each; "
          f"lighthouse heartbeat timeout {args.heartbeat_timeout_ms} ms; torch {torch.__version__}\n")
    print(f"{'state MB':>9} {'DDP s/step':>11} {'FT s/step':>10} {'overhead':>9} {'stall s':>8} {'heal s':>7} "
          f"{'sender s':>9} {'restart->commit s':>18} {'lost':>5}")
    for r in rows:
        print(f"{r['state_mb']:>9.0f} {r['ddp_step_s']:>11.3f} {r['ft_step_s']:>10.3f} {r['steady_overhead']:>8.2f}x "
              f"{r['stall_s']:>8.2f} {r['heal_s'] or float('nan'):>7.2f} {r['join_stall_s']:>9.2f} "
              f"{r['restart_to_commit_s']:>18.2f} {r['lost_steps']:>5}")
    near_300 = min(rows, key=lambda r: abs(r["state_mb"] - 300))
    targets = {
        "no committed step lost": all(r["lost_steps"] == 0 for r in rows),
        f"stall <= {limit:g} s": all(r["stall_s"] <= limit for r in rows),
        f"heal of {near_300['state_mb']:.0f} MB <= 2 s": near_300["heal_s"] is not None and near_300["heal_s"] <= 2.0,
    }
    print("\n" + "\n".join(f"  {name}: {'met' if ok else 'NOT MET'}" for name, ok in targets.items()))
    print("  stall = the survivor's longest step between the kill and the restart minus its median step;\n"
          "  heal = the quorum that heals the restarted group (fetch + load); sender = the survivor's longest\n"
          "  step while it serves the heal, minus its median; restart->commit includes starting Python and torch.")
    result = {"machine": machine(), "heartbeat_timeout_ms": args.heartbeat_timeout_ms, "rows": rows, "targets": targets}
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    if "--worker" in sys.argv:
        raise SystemExit(entrypoint(worker).exit_code)
    main()

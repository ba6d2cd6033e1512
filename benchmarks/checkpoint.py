"""Checkpoint cost: how long a save blocks the training loop, per `CheckpointParameters.async_mode`.

A DreamTrainer trains a stack of square nn.Linear layers (ReLU between) with AdamW on one
in-memory batch (no data loading); its checkpointed state (parameters + AdamW's two moment
buffers, float32) is >= 200 MB (~50 MB with --quick). `CheckpointCallback` saves it every
K steps, 4 saves per run, into a temporary directory on local disk (keep_last=1), with

    off           dcp.save: the loop waits until the checkpoint is written and committed
    async         the loop waits for a copy of the state; a background thread writes it
    async_pinned  the same with the staging buffers allocated once and reused across saves
                  (pinned memory only on CUDA: on a CPU-only machine nothing is pinned)

Per save it reports
    blocked    the seconds the loop did not train because of the checkpoint: the wall time
               of CheckpointCallback's post_train_step, measured by probe callbacks that run
               just before and just after it, summed over the steps from this save to the next
               (so the commit and pruning that an async save does on a later step count too)
    cb         the callback's own `blocked_s` (leaves out the commit and pruning)
    written    the callback's `save_s`: from the start of the save until the files are written
    total      from the start of the save until it is committed (rename done); an async save
               is committed at the first step boundary after its write ends
and whether the previous save was still in flight when this one started (a new save waits
for it: that wait would count as blocked, so K steps are chosen to outlast a write).

Each round runs one trainer per mode (order rotating); medians leave out each run's first
save (warm-up: first allocations), all saves are listed in the JSON. The target (from the
issue) is median blocked of async <= 25% of sync's. Step times with a background write in
flight vs without show what the writer thread takes from the loop (2 cores here).

    python benchmarks/checkpoint.py            # ~3 minutes, ~230 MB of state
    python benchmarks/checkpoint.py --quick    # ~30 s, ~50 MB
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dream_trainer import (Callback, CheckpointCallback, CheckpointParameters, DeviceParameters, DreamTrainer,
                           LoggingParameters, TrainerConfig, TrainingParameters)

MODES = ("off", "async", "async_pinned")
TARGET = 0.25  # blocked(async) / blocked(sync)


class Probe:
    """Timings of one run, filled by the two callbacks around CheckpointCallback."""

    def __init__(self, ckpt: CheckpointCallback, every: int, cuda: bool):
        self.ckpt, self.every, self.cuda = ckpt, every, cuda
        self.step_s: list[tuple[float, bool]] = []  # (seconds, a background write in flight)
        self.hook_s: list[float] = []  # the checkpoint hook's wall time, per step
        self.saves: list[dict[str, Any]] = []
        self.t_step = self.t_hook = 0.0
        self.n_saved = 0

    def in_flight(self) -> bool:
        return len(self.ckpt.blocked_s) > len(self.ckpt.save_s)

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def check_commits(self, t: float) -> None:
        while self.n_saved < len(self.ckpt.saved):
            self.saves[self.n_saved]["total_s"] = t - self.saves[self.n_saved]["t0"]
            self.n_saved += 1


class Before(Callback[Any]):
    order = 999  # just before CheckpointCallback (1000)

    def __init__(self, probe: Probe):
        self.p = probe

    def pre_train_step(self, batch: Any, batch_idx: int) -> None:
        self.p.t_step = self.p.now()

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        p = self.p
        p.t_hook = p.now()
        p.step_s.append((p.t_hook - p.t_step, p.in_flight()))
        if self.trainer.global_step % p.every == 0:
            p.saves.append({"step": self.trainer.global_step, "t0": p.t_hook, "step_index": len(p.hook_s),
                            "previous_in_flight": p.in_flight()})


class After(Callback[Any]):
    order = 1001  # just after CheckpointCallback

    def __init__(self, probe: Probe):
        self.p = probe

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        t = self.p.now()
        self.p.hook_s.append(t - self.p.t_hook)
        self.p.check_commits(t)

    def post_fit(self) -> None:  # the last async save is committed here if still running
        self.p.check_commits(self.p.now())


class BenchTrainer(DreamTrainer):
    def __init__(self, config: TrainerConfig, args: argparse.Namespace, steps: int):
        super().__init__(config)
        self.args, self.steps = args, steps

    def configure_models(self) -> None:
        layers: list[nn.Module] = []
        for _ in range(self.args.depth):
            layers += [nn.Linear(self.args.width, self.args.width), nn.ReLU()]
        self.model = nn.Sequential(*layers[:-1])

    def init_weights(self) -> None:
        torch.manual_seed(0)
        for m in self.model.modules():
            if isinstance(m, nn.Linear):
                m.reset_parameters()

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def configure_dataloaders(self) -> tuple[Any, None]:
        g = torch.Generator().manual_seed(0)
        x, y = (torch.randn(self.args.batch_size, self.args.width, generator=g) for _ in range(2))
        return [(x, y)] * self.steps, None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        loss = nn.functional.mse_loss(self.model(x), y)
        self.backward(loss)
        self.step(self.optimizer)
        return {"loss": loss}


def state_mb(trainer: BenchTrainer) -> float:
    tensors = list(trainer.model.parameters())
    tensors += [t for s in trainer.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors) / 1e6


def run_once(mode: str, device: str, args: argparse.Namespace, tmp: Path, tag: str) -> dict[str, Any]:
    every = args.every
    steps = every * (args.saves + 1) - 1  # saves at every, 2*every, ...; a tail of steps after the last
    ckpt = CheckpointCallback(CheckpointParameters(
        root_dir=str(tmp / tag / "ckpt"), every_n_steps=every, every_n_epochs=None, at_fit_end=False,
        keep_last=1, resume_mode=None, async_mode=mode))
    probe = Probe(ckpt, every, device == "cuda")
    config = TrainerConfig(
        root_dir=str(tmp / tag / "runs"), run_name="r",
        device_parameters=DeviceParameters.SINGLE_DEVICE(device=device),
        training_parameters=TrainingParameters(n_epochs=1, num_sanity_val_steps=0, validate_at_epoch_end=False),
        logging_parameters=LoggingParameters(log_every_n_steps=10**6),
        callbacks=[Before(probe), ckpt, After(probe)],
    )
    trainer = BenchTrainer(config, args, steps)
    start = time.perf_counter()
    trainer.fit()
    wall = time.perf_counter() - start
    bounds = [s["step_index"] for s in probe.saves] + [len(probe.hook_s)]
    for i, s in enumerate(probe.saves):
        s.pop("t0")
        s["blocked_s"] = sum(probe.hook_s[bounds[i]:bounds[i + 1]])
        s["blocked_at_save_step_s"] = probe.hook_s[bounds[i]]
        s["cb_blocked_s"] = ckpt.blocked_s[i]
        s["written_s"] = ckpt.save_s[i]
    with_write = [t for t, busy in probe.step_s[1:] if busy]
    without = [t for t, busy in probe.step_s[1:] if not busy]
    out = {
        "mode": mode, "device": device, "state_mb": state_mb(trainer), "wall_s": wall, "saves": probe.saves,
        "committed": [p.name for p in ckpt.saved], "step_s_with_write": with_write, "step_s_without": without,
    }
    shutil.rmtree(tmp / tag, ignore_errors=True)
    del trainer, ckpt, probe
    gc.collect()
    return out


def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(runs: list[dict[str, Any]], key: str) -> float | None:
    return med([s[key] for r in runs for s in r["saves"][1:]])  # first save of each run: warm-up


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=18, help="Linear layers (1024x1024 each: 4.2 MB, 12.6 MB with AdamW)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--saves", type=int, default=4, help="saves per run")
    p.add_argument("--every", type=int, default=8, help="steps between saves")
    p.add_argument("--rounds", type=int, default=3, help="rounds; each runs every mode once")
    p.add_argument("--tmp", default=tempfile.gettempdir(), help="where the temporary checkpoint directory goes")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "checkpoint.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.depth, args.saves, args.rounds, args.batch_size = 4, 3, 2, 128
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    tmp = Path(tempfile.mkdtemp(prefix="dream_ckpt_bench_", dir=args.tmp))
    start = time.perf_counter()
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {d: {m: [] for m in MODES} for d in devices}
    ratios: dict[str, dict[str, list[float | None]]] = {d: {m: [] for m in MODES[1:]} for d in devices}
    try:
        for device in devices:
            for r in range(args.rounds):
                order = MODES[r % 3:] + MODES[:r % 3]
                for mode in order:
                    res = run_once(mode, device, args, tmp, f"{device}-{mode}-{r}")
                    res["round"] = r
                    runs[device][mode].append(res)
                    print(f"  round {r} {device:<4} {mode:<12} blocked " + " ".join(
                        f"{s['blocked_s']:.3f}" for s in res["saves"]) + f"  total " + " ".join(
                        f"{s.get('total_s', float('nan')):.3f}" for s in res["saves"]) + f"  ({res['wall_s']:.1f} s)",
                        flush=True)
                sync = med([s["blocked_s"] for s in runs[device]["off"][r]["saves"][1:]])
                for mode in MODES[1:]:
                    b = med([s["blocked_s"] for s in runs[device][mode][r]["saves"][1:]])
                    ratios[device][mode].append(b / sync if b is not None and sync else None)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    wall = time.perf_counter() - start

    mb = runs["cpu"]["off"][0]["state_mb"]
    print(f"\ncheckpoint cost, {args.depth} x Linear({args.width}, {args.width}) + AdamW: state {mb:.1f} MB "
          f"(params + 2 moments, float32), batch {args.batch_size}, save every {args.every} steps, "
          f"{args.saves} saves x {args.rounds} rounds per mode; torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, disk {args.tmp}\n")
    print(f"{'device':<7}{'mode':<13}{'blocked':>9}{'cb':>8}{'written':>9}{'total':>8}{'ratio':>7}{'per round':>18}"
          f"{'step s':>8}{'+write':>8}{'in flight':>10}{'target':>8}")
    result: dict[str, Any] = {"modes": {}}
    for device in devices:
        base = summarize(runs[device]["off"], "blocked_s")
        for mode in MODES:
            rs = runs[device][mode]
            b = summarize(rs, "blocked_s")
            ratio = b / base if b is not None and base else None
            met = None if mode == "off" or ratio is None else ratio <= TARGET
            per_round = " ".join("-" if x is None else f"{x:.2f}" for x in ratios[device].get(mode, []))
            step = med([t for r in rs for t in r["step_s_without"]])
            step_w = med([t for r in rs for t in r["step_s_with_write"]])
            waited = sum(s["previous_in_flight"] for r in rs for s in r["saves"])
            row = {"blocked_s": b, "cb_blocked_s": summarize(rs, "cb_blocked_s"), "written_s": summarize(rs, "written_s"),
                   "total_s": summarize(rs, "total_s"), "ratio_to_sync": ratio, "ratio_per_round": ratios[device].get(mode),
                   "step_s": step, "step_s_with_write": step_w, "saves_started_while_previous_in_flight": waited,
                   "target_met": met, "runs": rs}
            result["modes"][f"{device}/{mode}"] = row
            f = lambda x, w=8: f"{x:>{w}.3f}" if x is not None else f"{'-':>{w}}"  # noqa: E731
            print(f"{device:<7}{mode:<13}{f(b, 9)}{f(row['cb_blocked_s'])}{f(row['written_s'], 9)}{f(row['total_s'])}"
                  f"{f(ratio, 7)}{per_round:>18}{f(step)}{f(step_w)}{waited:>10}"
                  f"{'' if met is None else ('PASS' if met else 'FAIL'):>8}")
    if "cuda" not in devices:
        print("cuda   (skipped: no GPU; torch.cuda.is_available() is False)")
    print(f"\n  seconds, medians over saves 2..{args.saves} of every run (the first save of a run is warm-up).")
    print("  blocked = wall time of the checkpoint hook (incl. a later step's commit + pruning); cb = the callback's")
    print("  own blocked_s; written = start -> files written; total = start -> committed (async: at the next step")
    print(f"  boundary). ratio = blocked / blocked of 'off'; target <= {TARGET:.2f}. step s = median step without a")
    print("  background write, +write = with one in flight. in flight = saves that started (and waited) while the")
    print("  previous one was still being written.")
    if not torch.cuda.is_available():
        print("  async_pinned on this CPU-only machine: staging buffers are reused across saves but not pinned.")
    leftover = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    print(f"  wall {wall:.0f} s; threads left at the end: {leftover or 'none'}")
    result.update(settings=vars(args), state_mb=mb, torch=torch.__version__, python=sys.version.split()[0],
                  platform=platform.platform(), cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads(),
                  disk_path=str(tmp), devices=devices, wall_s=wall, leftover_threads=leftover, target=TARGET)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()

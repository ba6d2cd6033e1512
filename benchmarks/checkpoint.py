"""Checkpoint cost: how long a save blocks the training loop, per `CheckpointParameters.async_mode`.

A DreamTrainer (one process) trains a stack of nn.Linear(1024, 1024) with AdamW on one
in-memory batch; its state (parameters + AdamW's two moments, float32) is ~227 MB (~50 MB
with --quick). `CheckpointCallback` saves it every K steps, 4 times per run, into a
temporary directory on local disk (keep_last=1; deleted at the end), with async_mode

    off           dcp.save: the loop waits until the checkpoint is written and committed
    async         the loop waits for a copy of the state; a background thread writes it
    async_pinned  the same, the staging buffers allocated once and reused across saves
                  (pinned memory only on CUDA: on a CPU-only machine nothing is pinned)

Per save: `blocked` = the seconds the loop did not train: the wall time of the callback's
post_train_step (probe callbacks run just before and after it), summed from this save's
step to the next save's (so anything a save costs on a later step would count); `cb` =
the callback's own `blocked_s` (staging, plus the wait for a save still in flight); `written`
= its `save_s` (start -> written and committed: an async save commits and prunes in its
writer thread); `total` = start -> the committed directory is seen; `waited` = the previous
save was still being written (the new one waits for it, so K steps should outlast a
write). Per step: the step time without (`step`) and with (`+write`) a background write in
flight; `slowed` = what the slower steps lost, per save.

Each round runs one trainer per mode (rotating order), so drift on a shared machine hits
every mode alike; medians leave out each run's first save (warm-up; the JSON has all).
Target (from the issue): median blocked of an async mode <= 25% of off's. torch uses one
intra-op thread by default: with 2 on 2 cores, each parallel op stalls whenever the writer
thread or another process holds a core (4 MB copies went from 0.4 to 8 ms).

    python benchmarks/checkpoint.py            # ~2 minutes
    python benchmarks/checkpoint.py --quick    # ~20 s
    python benchmarks/checkpoint.py --smoke    # seconds: a tiny model, 2 saves x 1 round per mode (what CI runs)
"""

from __future__ import annotations

import argparse
import gc
import os
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

from common import machine, write_json  # noqa: E402  (benchmarks/common.py)

MODES = ("off", "async", "async_pinned")
TARGET = 0.25  # blocked(async) / blocked(off)


class Probe:
    """One run's timings, filled by the callbacks just before and just after CheckpointCallback."""

    def __init__(self, ckpt: CheckpointCallback, every: int, cuda: bool):
        self.ckpt, self.every, self.cuda = ckpt, every, cuda
        self.step_s: list[tuple[float, bool]] = []  # (seconds, a background write in flight)
        self.hook_s: list[float] = []  # the checkpoint hook's wall time, per step
        self.saves: list[dict[str, Any]] = []
        self.t_step = self.t_hook = 0.0
        self.n_committed = 0

    def writing(self) -> bool:
        return len(self.ckpt.blocked_s) > len(self.ckpt.save_s)  # save_s grows when a write ends

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def committed(self, t: float) -> None:
        for save in self.saves[self.n_committed:len(self.ckpt.saved)]:
            save["total_s"] = t - save.pop("t0")
        self.n_committed = len(self.ckpt.saved)


class _Probing(Callback[Any]):
    def __init__(self, probe: Probe):
        self.p = probe


class Before(_Probing):
    order = 999  # CheckpointCallback's is 1000

    def pre_train_step(self, batch: Any, batch_idx: int) -> None:
        self.p.t_step = self.p.now()

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        p, step = self.p, self.trainer.global_step
        p.t_hook = p.now()
        p.step_s.append((p.t_hook - p.t_step, p.writing()))
        if step % p.every == 0:
            p.saves.append({"step": step, "t0": p.t_hook, "index": len(p.hook_s), "previous_in_flight": p.writing()})


class After(_Probing):
    order = 1001

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        t = self.p.now()
        self.p.hook_s.append(t - self.p.t_hook)
        self.p.committed(t)

    def post_fit(self) -> None:  # CheckpointCallback.post_fit waits for and commits a save still running
        self.p.committed(self.p.now())


class BenchTrainer(DreamTrainer):
    def __init__(self, config: TrainerConfig, args: argparse.Namespace, steps: int):
        super().__init__(config)
        self.args, self.steps = args, steps

    def configure_models(self) -> None:
        layers = [m for _ in range(self.args.depth) for m in (nn.Linear(self.args.width, self.args.width), nn.ReLU())]
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


def run_once(mode: str, device: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    ckpt = CheckpointCallback(CheckpointParameters(
        root_dir=str(tmp / "ckpt"), every_n_steps=args.every, every_n_epochs=None, at_fit_end=False,
        keep_last=1, resume_mode=None, async_mode=mode))
    probe = Probe(ckpt, args.every, device == "cuda")
    config = TrainerConfig(
        root_dir=str(tmp / "runs"), run_name="r", device_parameters=DeviceParameters.SINGLE_DEVICE(device=device),
        training_parameters=TrainingParameters(n_epochs=1, num_sanity_val_steps=0, validate_at_epoch_end=False),
        logging_parameters=LoggingParameters(log_every_n_steps=10**6), callbacks=[Before(probe), ckpt, After(probe)])
    # Saves at K, 2K, ... then K-1 more steps: the last save is not at the epoch's last step.
    trainer = BenchTrainer(config, args, args.every * (args.saves + 1) - 1)
    start = time.perf_counter()
    trainer.fit()
    wall = time.perf_counter() - start
    ends = [s["index"] for s in probe.saves[1:]] + [len(probe.hook_s)]
    for s, end, cb_blocked, written in zip(probe.saves, ends, ckpt.blocked_s, ckpt.save_s, strict=True):
        s.update(blocked_s=sum(probe.hook_s[s["index"]:end]), blocked_at_save_step_s=probe.hook_s[s["index"]],
                 cb_blocked_s=cb_blocked, written_s=written)
    busy = [t for t, writing in probe.step_s[1:] if writing]
    idle = [t for t, writing in probe.step_s[1:] if not writing]
    tensors = [*trainer.model.parameters(), *(t for st in trainer.optimizer.state.values() for t in st.values())]
    return {"mode": mode, "device": device, "wall_s": wall, "saves": probe.saves,
            "state_mb": sum(t.numel() * t.element_size() for t in tensors) / 1e6,
            "step_s_with_write": busy, "step_s_without": idle,
            "slowdown_per_save_s": (sum(busy) - len(busy) * statistics.median(idle)) / len(probe.saves)}


def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def kept(rs: list[dict[str, Any]], key: str) -> list[float]:
    """`key` of every save but each run's first (warm-up)."""
    return [s[key] for r in rs for s in r["saves"][1:]]


def fmt(x: float | None, width: int = 8) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width}.3f}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depth", type=int, default=18, help="Linear layers (12.6 MB of state each at width 1024)")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--saves", type=int, default=4, help="saves per run")
    p.add_argument("--every", type=int, default=8, help="steps between saves (enough for a write to end)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; each runs every mode once")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (see above)")
    p.add_argument("--tmp", default=tempfile.gettempdir(), help="where the temporary checkpoint directory goes")
    p.add_argument("--quick", action="store_true", help="4 layers (~50 MB), 3 saves x 2 rounds")
    p.add_argument("--smoke", action="store_true", help="seconds: 2 x Linear(128, 128), 2 saves 2 steps apart, 1 round")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "checkpoint.json"))
    given = sys.argv[1:] if argv is None else argv
    if "--quick" in given:
        p.set_defaults(depth=4, saves=3, rounds=2)  # explicit flags still win
    if "--smoke" in given:
        p.set_defaults(depth=2, width=128, batch_size=8, saves=2, every=2, rounds=1)
    args = p.parse_args(argv)
    if args.every < 2 or args.saves < 2:
        p.error("--every and --saves must be >= 2")
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    runs: dict[str, list[dict[str, Any]]] = {f"{d}/{m}": [] for d in devices for m in MODES}
    tmp = Path(tempfile.mkdtemp(prefix="dream_ckpt_bench_", dir=args.tmp))
    start = time.perf_counter()
    try:
        for device in devices:
            for r in range(args.rounds):
                for mode in MODES[r % 3:] + MODES[:r % 3]:
                    res = run_once(mode, device, args, tmp / f"{device}-{mode}-{r}")
                    shutil.rmtree(tmp / f"{device}-{mode}-{r}")
                    gc.collect()
                    runs[f"{device}/{mode}"].append(res)
                    blocked, total = (" ".join(f"{s[k]:.3f}" for s in res["saves"]) for k in ("blocked_s", "total_s"))
                    print(f"  round {r} {device} {mode:<12} blocked {blocked}  total {total}  ({res['wall_s']:.1f} s)",
                          flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    wall = time.perf_counter() - start

    mb = runs["cpu/off"][0]["state_mb"]
    print(f"\ncheckpoint cost, {args.depth} x Linear({args.width}, {args.width}) + AdamW: state {mb:.1f} MB (params + 2"
          f" moments, float32), batch {args.batch_size}, a save every {args.every} steps, {args.saves} saves x "
          f"{args.rounds} rounds per mode\ntorch {torch.__version__}, {os.cpu_count()} CPUs, {args.threads} torch "
          f"thread(s), disk {args.tmp}, load average {load:.1f} before, {os.getloadavg()[0]:.1f} after\n")
    print(f"{'':<18}{'blocked':>8}{'cb':>8}{'written':>8}{'total':>8}{'ratio':>7}{'per round':>16}{'slowed':>8}"
          f"{'step':>7}{'+write':>7}{'waited':>7}  target")
    result: dict[str, Any] = {"modes": {}}
    for key, rs in runs.items():
        device, mode = key.split("/")
        off = runs[f"{device}/off"]
        ratio = med(kept(rs, "blocked_s")) / med(kept(off, "blocked_s"))
        rounds = [med(kept([r], "blocked_s")) / med(kept([o], "blocked_s")) for r, o in zip(rs, off)]
        met = None if mode == "off" else ratio <= TARGET
        row = {k: med(kept(rs, f"{k}_s")) for k in ("blocked", "cb_blocked", "written", "total")}
        row.update(ratio_to_off=ratio, ratio_per_round=rounds, target_met=met,
                   cb_ratio_to_off=row["cb_blocked"] / med(kept(off, "cb_blocked_s")),
                   slowed_per_save=med([r["slowdown_per_save_s"] for r in rs]),
                   step=med([t for r in rs for t in r["step_s_without"]]),
                   step_with_write=med([t for r in rs for t in r["step_s_with_write"]]),
                   saves_that_waited_for_previous=sum(s["previous_in_flight"] for r in rs for s in r["saves"]), runs=rs)
        result["modes"][key] = row
        print(f"{key:<18}{fmt(row['blocked'])}{fmt(row['cb_blocked'])}{fmt(row['written'])}{fmt(row['total'])}"
              f"{fmt(ratio, 7)}{' '.join(f'{x:.2f}' for x in rounds) if mode != 'off' else '':>16}"
              f"{fmt(row['slowed_per_save'])}{fmt(row['step'], 7)}{fmt(row['step_with_write'], 7)}"
              f"{row['saves_that_waited_for_previous']:>7}  {'' if met is None else ('PASS' if met else 'FAIL')}")
    if "cuda" not in devices:
        print("cuda/*            skipped: no GPU (torch.cuda.is_available() is False)")
    print(f"\n  seconds (medians over saves 2..{args.saves} of each run; columns: see --help). ratio = blocked / off's"
          f" blocked,\n  overall then per round; target <= {TARGET}. step / +write = median step time without / with a"
          " background write.")
    if not torch.cuda.is_available():
        print("  async_pinned without CUDA: the staging buffers are reused across saves, not pinned.")
    leftover = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    print(f"  wall {wall:.0f} s; threads left: {leftover or 'none'}")
    result.update(settings=vars(args), state_mb=mb, machine=machine(), disk_path=str(tmp), devices=devices,
                  loadavg_before=load, loadavg_after=os.getloadavg()[0], wall_s=wall, leftover_threads=leftover,
                  target=TARGET)
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()

"""Training throughput of the demo GPT (examples/gpt) under different parallel layouts.

The model, data, optimizer (AdamW, warmup + cosine), gradient clipping and the `--parallel`
to DeviceParameters mapping are the demo's own (`GPTTrainer` and `PARALLEL` are imported
from examples/gpt/train.py). The layouts, all with the same GLOBAL batch (tokens per
optimizer step), so tokens/s compare directly:

    single 2thr   1 rank  x 2 torch threads   (the whole 2-core machine)
    single 1thr   1 rank  x 1 thread          (the compute budget of one rank below)
    ddp           2 ranks x 1 thread, dp_replicate=2 (gradients all-reduced over gloo)
    fsdp          2 ranks x 1 thread, dp_shard=2     (FSDP2: per-block all-gather / reduce-scatter)

Every run is a fresh process (or two) started by `dream_trainer.testing.spawn_world`, with
torch.set_num_threads set inside the rank. A timing callback takes a perf_counter timestamp
in post_train_step after the warm-up steps and again N steps later (N steps: data loading,
forward, backward, collectives, clip, optimizer); rank 0 reports. No barrier is added: the
collectives of every step already keep the ranks in step. Validation, sanity checks, the
progress bar and metric logging are off. Each round runs every layout once (order rotating,
since the machine is noisy); the table gives the median over rounds and the min-max, and
how many cores OTHER processes kept busy during the timed steps (from /proc/stat); a run in
which they kept more than --max-other cores busy is run again once (--retries).

What 2 CPU cores can and cannot show: 2 ranks x 1 thread against 1 rank x 2 threads on the
same 2 cores adds no compute, so these numbers CANNOT show scaling. They show what DDP and
FSDP2 cost over gloo on loopback (communication, sharding, framework work) relative to one
process using the same cores. "vs single 1thr" is the per-rank view: how close 2 ranks get
to twice one 1-thread rank. Real scaling needs more cores or GPUs; with a CUDA GPU the
script also runs single / ddp / fsdp on min(2, device_count) GPUs over nccl.

    python benchmarks/parallel.py            # ~2.5 minutes: 3 rounds x 4 layouts, 5 + 30 steps
    python benchmarks/parallel.py --quick    # ~40 s smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))

from train import PARALLEL, GPTTrainer, parse_args  # noqa: E402

from dream_trainer import Callback, LoggingParameters, TrainerConfig, TrainingParameters  # noqa: E402
from dream_trainer.testing import spawn_world  # noqa: E402

NOTE = (
    "2 ranks x 1 thread vs 1 rank x 2 threads run on the same 2 CPU cores: there is no extra\n"
    "compute, so this cannot show scaling, only the cost of DDP/FSDP2 (gloo over loopback,\n"
    "sharding, framework work) against one process on the same cores. Real scaling needs\n"
    "more cores or GPUs."
)


def busy_cpu_s() -> float | None:
    """CPU-seconds the whole machine has been busy (all processes; Linux /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in f.readline().split()[1:8])
    except (OSError, ValueError):
        return None
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


class StepTimer(Callback[Any]):
    """Timestamps after step `warmup` and after step `warmup + steps` (post_train_step)."""

    def __init__(self, warmup: int, steps: int):
        self.marks = {warmup: 0.0, warmup + steps: 0.0}
        self.cpu: dict[int, float] = {}
        self.busy: dict[int, float | None] = {}

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        step = self.trainer.global_step
        if step in self.marks:
            if torch.cuda.is_available() and self.trainer.world.device.type == "cuda":
                torch.cuda.synchronize()
            self.marks[step] = time.perf_counter()
            self.cpu[step] = time.process_time()
            self.busy[step] = busy_cpu_s()


def run_rank(layout: str, threads: int | None, device: str, opts: dict[str, Any], root: str) -> dict[str, Any]:
    """One rank of one run (module level: spawn_world pickles it)."""
    if threads is not None:
        torch.set_num_threads(threads)
    warmup, steps = opts["warmup"], opts["steps"]
    args = parse_args([
        "--steps", str(warmup + steps), "--batch-size", str(opts["batch_size"]),
        "--block-size", str(opts["block_size"]), "--n-layer", str(opts["n_layer"]),
        "--n-head", str(opts["n_head"]), "--d-model", str(opts["d_model"]), "--n-chars", str(opts["n_chars"]),
    ])
    timer = StepTimer(warmup, steps)
    config = TrainerConfig(
        experiment="parallel",
        root_dir=root,
        seed=0,
        device_parameters=PARALLEL[layout](device=device),
        training_parameters=TrainingParameters(
            n_epochs=None, max_steps=warmup + steps, val_every_n_steps=None, validate_at_epoch_end=False,
            num_sanity_val_steps=0, gradient_clip_val=1.0,
        ),
        logging_parameters=LoggingParameters(log_every_n_steps=10**9, log_lr=False),
        callbacks=[timer],  # no ProgressBar, no LoggerCallback
    )
    trainer = GPTTrainer(config, args)
    trainer.fit()
    (t0, t1), (c0, c1), (b0, b1) = timer.marks.values(), timer.cpu.values(), timer.busy.values()
    return {
        "seconds": t1 - t0, "cpu_seconds": c1 - c0, "threads": torch.get_num_threads(),
        "machine_busy_cpu_seconds": None if b0 is None or b1 is None else b1 - b0,
        "params": sum(p.numel() for p in trainer.model.parameters()),
        "world": trainer.world.world_size, "mesh": str(trainer.world.plan),
    }


def measure(spec: tuple[str, int, int | None, str], opts: dict[str, Any], root: str,
            tokens_per_step: int) -> dict[str, Any]:
    """One run of one layout in fresh processes; rank 0's timing plus every rank's CPU use."""
    layout, ranks, threads, device = spec
    t = time.perf_counter()
    per_rank = spawn_world(ranks, run_rank, layout, threads, device, opts, root, timeout=600.0)
    run = per_rank[0]
    busy = run["machine_busy_cpu_seconds"]  # over rank 0's window; the other ranks' are ~ the same
    run.update(
        tokens_per_s=tokens_per_step * opts["steps"] / run["seconds"], ms_per_step=run["seconds"] / opts["steps"] * 1e3,
        process_s=time.perf_counter() - t, cpu_util=[x["cpu_seconds"] / x["seconds"] for x in per_rank],
        other_cpu=0.0 if busy is None else max(0.0, (busy - sum(x["cpu_seconds"] for x in per_rank)) / run["seconds"]),
    )
    return run


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="timed optimizer steps per run")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    p.add_argument("--repeats", type=int, default=3, help="rounds; each runs every layout once")
    p.add_argument("--batch-size", type=int, default=32, help="GLOBAL batch (sequences per step)")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-chars", type=int, default=None, help="corpus size (default: enough for one epoch)")
    p.add_argument("--max-other", type=float, default=0.25,
                   help="run again when other processes kept more cores than this busy")
    p.add_argument("--retries", type=int, default=1, help="reruns of a run that shared the machine")
    p.add_argument("--quick", action="store_true", help="1 round x 10 steps")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "parallel.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.steps, args.warmup = 1, 10, 3
    tokens_per_step = args.batch_size * args.block_size
    if args.n_chars is None:  # one epoch covers every step (10% of the corpus is the val split)
        args.n_chars = int((args.warmup + args.steps + 2) * (tokens_per_step + args.batch_size) / 0.9)
    opts = {k: getattr(args, k) for k in ("warmup", "steps", "batch_size", "block_size", "n_layer", "n_head",
                                          "d_model", "n_chars")}
    cores = os.cpu_count() or 1
    # name -> (layout, ranks, torch threads per rank, device)
    layouts: dict[str, tuple[str, int, int | None, str]] = {
        "single 2thr": ("single", 1, cores, "cpu"),
        "single 1thr": ("single", 1, 1, "cpu"),
        "ddp": ("ddp", 2, max(1, cores // 2), "cpu"),
        "fsdp": ("fsdp", 2, max(1, cores // 2), "cpu"),
    }
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus:
        n = min(2, gpus)
        layouts.update({"single gpu": ("single", 1, None, "cuda"), f"ddp {n}gpu": ("ddp", n, None, "cuda"),
                        f"fsdp {n}gpu": ("fsdp", n, None, "cuda")})
    names = list(layouts)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dream_parallel_") as root:
        for r in range(args.repeats):
            order = names[r % len(names):] + names[: r % len(names)]  # rotate which goes first
            for name in order:
                for attempt in range(1 + args.retries):
                    run = measure(layouts[name], opts, root, tokens_per_step)
                    print(f"  round {r + 1}/{args.repeats} {name:<12} {run['tokens_per_s']:>9,.0f} tokens/s "
                          f"({run['ms_per_step']:.1f} ms/step, process {run['process_s']:.1f} s, other "
                          f"processes busy {run['other_cpu']:.2f} cores)", flush=True)
                    if run["other_cpu"] <= args.max_other:
                        break
                run["attempts"] = attempt + 1
                runs[name].append(run)
    wall = time.perf_counter() - start

    med = {name: statistics.median(x["tokens_per_s"] for x in runs[name]) for name in names}
    print(f"\nGPT {args.n_layer} layers, d_model {args.d_model}, {args.n_head} heads, {runs[names[0]][0]['params']:,} "
          f"parameters; global batch {args.batch_size} x {args.block_size} = {tokens_per_step} tokens/step; "
          f"{args.warmup} warm-up + {args.steps} timed steps, {args.repeats} round(s); torch {torch.__version__}, "
          f"{cores} CPU cores\n")
    head = f"{'layout':<13}{'ranks x thr':>12}{'tokens/s':>10}{'(min-max)':>18}{'per rank':>10}" \
           f"{'vs 2thr':>9}{'vs 1thr':>9}{'ms/step':>9}{'cpu/rank':>10}{'other':>7}"
    print(head)
    print("-" * len(head))
    result: dict[str, Any] = {"layouts": {}}
    for name in names:
        layout, ranks, threads, device = layouts[name]
        tps = [x["tokens_per_s"] for x in runs[name]]
        ms = statistics.median(x["ms_per_step"] for x in runs[name])
        util = statistics.median(u for x in runs[name] for u in x["cpu_util"])
        other = statistics.median(x["other_cpu"] for x in runs[name])
        thr = runs[name][0]["threads"]
        row = {
            "layout": layout, "ranks": ranks, "threads_per_rank": thr, "device": device,
            "tokens_per_s_median": med[name], "tokens_per_s_min": min(tps), "tokens_per_s_max": max(tps),
            "tokens_per_s_per_rank": med[name] / ranks, "ms_per_step_median": ms,
            "speedup_vs_single_2thr": med[name] / med["single 2thr"],
            "speedup_vs_single_1thr": med[name] / med["single 1thr"],
            "cpu_util_per_rank_median": util, "other_cpu_median": other, "runs": runs[name],
        }
        result["layouts"][name] = row
        print(f"{name:<13}{f'{ranks} x {thr}':>12}{med[name]:>10,.0f}{f'({min(tps):,.0f}-{max(tps):,.0f})':>18}"
              f"{med[name] / ranks:>10,.0f}{row['speedup_vs_single_2thr']:>9.2f}{row['speedup_vs_single_1thr']:>9.2f}"
              f"{ms:>9.1f}{util:>10.2f}{other:>7.2f}")
    print("\n  tokens/s = median over rounds of global tokens / wall time of the timed steps (rank 0);")
    print("  vs 2thr / vs 1thr = ratio to the single-rank medians; cpu/rank = process CPU time / wall")
    print("  (a 1-thread rank doing only compute reads ~1.0; gloo's threads add to it); other = cores")
    print("  busy with OTHER processes during the timed steps (/proc/stat): > 0 means the run shared")
    print("  the machine and its numbers are low.")
    print("  " + NOTE.replace("\n", "\n  "))
    if not gpus:
        print("  GPU rows skipped: torch.cuda.is_available() is False.")
    result.update(
        note=NOTE, settings=vars(args), tokens_per_step=tokens_per_step, wall_s=wall, gpus=gpus,
        machine={"platform": platform.platform(), "processor": platform.processor(), "cpu_count": cores,
                 "python": sys.version.split()[0], "torch": torch.__version__,
                 "cuda": [torch.cuda.get_device_name(i) for i in range(gpus)]},
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out} ({wall:.0f} s)")
    return result


if __name__ == "__main__":
    main()

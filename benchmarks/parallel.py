"""Training throughput of the demo GPT (examples/gpt) under different parallel layouts.

The model, data, optimizer (AdamW, warmup + cosine), gradient clipping and the `--parallel`
to DeviceParameters mapping are the demo's own (`GPTTrainer` and `PARALLEL` are imported
from examples/gpt/train.py). The layouts, all with the same GLOBAL batch (tokens per
optimizer step), so tokens/s compare directly:

    single 2thr   1 rank  x 2 torch threads   (the whole 2-core machine: "full")
    single 1thr   1 rank  x 1 thread          (the compute budget of one rank below: "half")
    ddp           2 ranks x 1 thread, dp_replicate=2 (gradients all-reduced over gloo)
    ddp (hand)    the reference: the same model, data, optimizer, schedule and clipping in a
                  hand-written loop around torch's DistributedDataParallel, no dream_trainer
    fsdp          2 ranks x 1 thread, dp_shard=2     (FSDP2: per-block all-gather / reduce-scatter)

(On a machine with C cores: C threads, C/2 threads, and 2 ranks x C/2 threads.)

Every run is a fresh process (or two) started by `dream_trainer.testing.spawn_world`, with
torch.set_num_threads set inside the rank. A timing callback takes a perf_counter timestamp
in post_train_step after the warm-up steps and again N steps later (N steps: data loading,
forward, backward, collectives, clip, optimizer); rank 0 reports. No barrier is added: the
collectives of every step already keep the ranks in step. Validation, sanity checks, the
progress bar and metric logging are off. Each round runs every layout once (order rotating,
since the machine is noisy); the table gives the median over rounds and the min-max, and
how many cores OTHER processes kept busy during the timed steps (from /proc/stat). Before
each run the script waits (up to --patience s) for the machine to be idle, and a run in
which other processes kept more than --max-other cores busy is run again once (--retries).

What 2 CPU cores can and cannot show: 2 ranks x 1 thread against 1 rank x 2 threads on the
same 2 cores adds no compute, so these numbers CANNOT show scaling. They show what DDP and
FSDP2 cost over gloo on loopback (communication, sharding, framework work) relative to one
process using the same cores. "vs half" is the per-rank view: how close 2 ranks get to
twice one 1-thread rank (2.0 would be perfect data parallelism on independent cores). Real scaling needs more cores or GPUs; with a CUDA GPU the
script also runs single / ddp / fsdp on min(2, device_count) GPUs over nccl.

    python benchmarks/parallel.py            # ~2.5 minutes on an idle machine (longer on a busy one)
    python benchmarks/parallel.py --quick    # ~30 s: 1 round, 10 steps, no waiting
    python benchmarks/parallel.py --smoke    # seconds: a 1-block GPT, 2 steps; the runs of one world
                                             # size one after the other in the same processes (what CI runs)
"""

from __future__ import annotations

import argparse
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

from data import ByteTokenizer, prepare_token_files  # noqa: E402
from model import GPT, GPTConfig, lm_loss  # noqa: E402
from train import PARALLEL, GPTTrainer, demo_config, parse_args  # noqa: E402

from dream_trainer import Callback, LoggingParameters, TrainerConfig, TrainingParameters  # noqa: E402
from dream_trainer.testing import spawn_world  # noqa: E402

from common import machine, write_json  # noqa: E402  (benchmarks/common.py)

NOTE = (
    "2 ranks x {h} thread(s) vs 1 rank x {c} threads run on the same {c} CPU cores: no extra\n"
    "compute, so this cannot show scaling, only the cost of DDP/FSDP2 (gloo over loopback,\n"
    "sharding, framework work) against one process on the same cores. Real scaling needs\n"
    "more cores or GPUs."
)


def busy_cpu_s() -> float:
    """CPU-seconds the whole machine has been busy, all processes (Linux /proc/stat; else 0)."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in f.readline().split()[1:8])
    except (OSError, ValueError):
        return 0.0
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def cpu_model() -> str:
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    return next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), platform.processor())


def wait_quiet(max_other: float, patience: float) -> float:
    """Wait, up to `patience` s, until at most `max_other` cores are busy (over 0.5 s)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < patience:
        b0 = busy_cpu_s()
        time.sleep(0.5)
        if (busy_cpu_s() - b0) / 0.5 <= max_other:
            break
    return time.perf_counter() - t0


class StepTimer(Callback[Any]):
    """(wall, process CPU, machine busy CPU) after step `warmup` and after step `warmup + steps`."""

    def __init__(self, warmup: int, steps: int):
        self.at, self.marks = (warmup, warmup + steps), []

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        if self.trainer.global_step in self.at:
            if self.trainer.world.device.type == "cuda":
                torch.cuda.synchronize()
            self.marks.append((time.perf_counter(), time.process_time(), busy_cpu_s()))


def run_rank(layout: str, threads: int | None, device: str, opts: dict[str, Any], root: str) -> dict[str, Any]:
    """One rank of one run (module level: spawn_world pickles it)."""
    if threads is not None:
        torch.set_num_threads(threads)
    warmup, steps = opts["warmup"], opts["steps"]
    flags = {**opts, "steps": warmup + steps}
    flags.pop("warmup")  # the demo's --warmup is its LR warm-up
    args = parse_args([x for k, v in flags.items() for x in (f"--{k.replace('_', '-')}", str(v))])
    timer = StepTimer(warmup, steps)
    config = TrainerConfig(
        experiment="parallel", root_dir=root, seed=0, device_parameters=PARALLEL[layout](device=device),
        training_parameters=TrainingParameters(
            n_epochs=None, max_steps=warmup + steps, global_batch_size=opts["batch_size"], val_every_n_steps=None,
            validate_at_epoch_end=False, num_sanity_val_steps=0, gradient_clip_val=1.0,
        ),
        logging_parameters=LoggingParameters(log_every_n_steps=10**9, log_lr=False),
        callbacks=[timer],  # no ProgressBarCallback, no LoggerCallback
    )
    trainer = GPTTrainer(demo_config(config, args))
    trainer.fit()
    (t0, c0, b0), (t1, c1, b1) = timer.marks
    return {
        "seconds": t1 - t0, "cpu_seconds": c1 - c0, "machine_busy_cpu_seconds": b1 - b0,
        "threads": torch.get_num_threads(), "params": sum(p.numel() for p in trainer.model.parameters()),
        "world": trainer.world.world_size, "mesh": str(trainer.world.plan),
    }


def run_hand_ddp(threads: int | None, device: str, opts: dict[str, Any], root: str) -> dict[str, Any]:
    """One rank of the hand-written reference: what a user writes without a framework for
    the demo's DDP run (same model init, byte-level token files, AdamW groups, warmup + cosine,
    clipping), the samples read through a plain DataLoader with a DistributedSampler."""
    import math

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from dream_trainer.data import TokenDataset  # the token file's samples as a map-style dataset
    from dream_trainer.world.settle import settle_workers

    if threads is not None:
        torch.set_num_threads(threads)
    warmup, steps = opts["warmup"], opts["steps"]
    dev = torch.device(device, int(os.environ["LOCAL_RANK"])) if device == "cuda" else torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # the demo's corpus and token files (where the trainer makes them: <root>/data)
    train_file, _ = prepare_token_files(Path(root) / "data", n_chars=opts["n_chars"])
    train_set = TokenDataset(train_file, opts["block_size"])
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=ByteTokenizer.vocab_size, block_size=opts["block_size"], n_layer=opts["n_layer"],
                          n_head=opts["n_head"], d_model=opts["d_model"])).to(dev)
    model.init_weights()
    ddp = DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
                                   {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                                  lr=parse_args([]).lr, betas=(0.9, 0.95))
    total, lr_warmup = warmup + steps, parse_args([]).warmup

    def lr_factor(step: int) -> float:
        if step < lr_warmup:
            return (step + 1) / lr_warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - lr_warmup) / max(1, total - lr_warmup))))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=max(1, opts["batch_size"] // world), sampler=sampler, drop_last=True)
    marks = []
    for step, (x, y) in enumerate(loader, 1):
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        loss = lm_loss(ddp(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if step in (warmup, total):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            marks.append((time.perf_counter(), time.process_time(), busy_cpu_s()))
        if step == total:
            break
    # What a user should write too: gloo's workers idle before the group goes, or destroying it (or
    # collecting `ddp`, whose reducer holds it) can deadlock (dream_trainer/world/settle.py).
    settle_workers()
    dist.destroy_process_group()
    (t0, c0, b0), (t1, c1, b1) = marks
    return {"seconds": t1 - t0, "cpu_seconds": c1 - c0, "machine_busy_cpu_seconds": b1 - b0,
            "threads": torch.get_num_threads(), "params": sum(p.numel() for p in params), "world": world,
            "mesh": "hand-written DistributedDataParallel"}


def run_spec(spec: tuple[str, int, int | None, str], opts: dict[str, Any], root: str) -> dict[str, Any]:
    """One rank of one run of a layout (module level: spawn_world pickles it)."""
    layout, _, threads, device = spec
    if layout == "hand_ddp":
        return run_hand_ddp(threads, device, opts, root)
    return run_rank(layout, threads, device, opts, root)


def run_specs(specs: list[tuple[str, int, int | None, str]], opts: dict[str, Any], root: str) -> list[dict[str, Any]]:
    """--smoke: one rank of several runs (of the same world size), one after the other in the
    same processes: one start of the processes instead of one per run."""
    return [run_spec(spec, opts, root) for spec in specs]


def measure(spec: tuple[str, int, int | None, str], opts: dict[str, Any], root: str,
            tokens_per_step: int) -> dict[str, Any]:
    """One run of one layout in fresh processes; rank 0's timing plus every rank's CPU use."""
    t = time.perf_counter()
    per_rank = spawn_world(spec[1], run_spec, spec, opts, root, timeout=600.0)
    return summarize(per_rank, opts, tokens_per_step, time.perf_counter() - t)


def measure_together(specs: list[tuple[str, int, int | None, str]], opts: dict[str, Any], root: str,
                     tokens_per_step: int) -> list[dict[str, Any]]:
    """--smoke: runs of the same world size one after the other in the same processes
    (`process_s` is then the whole world's)."""
    t = time.perf_counter()
    per_rank = spawn_world(specs[0][1], run_specs, specs, opts, root, timeout=600.0)
    process_s = time.perf_counter() - t
    return [summarize([rank[i] for rank in per_rank], opts, tokens_per_step, process_s) for i in range(len(specs))]


def summarize(per_rank: list[dict[str, Any]], opts: dict[str, Any], tokens_per_step: int,
              process_s: float) -> dict[str, Any]:
    """One run: rank 0's timing plus every rank's CPU use."""
    run = per_rank[0]
    # other processes' CPU: the machine's busy time over rank 0's window minus every rank's own
    other = run["machine_busy_cpu_seconds"] - sum(x["cpu_seconds"] for x in per_rank)
    run.update(
        tokens_per_s=tokens_per_step * opts["steps"] / run["seconds"], ms_per_step=run["seconds"] / opts["steps"] * 1e3,
        process_s=process_s, cpu_util=[x["cpu_seconds"] / x["seconds"] for x in per_rank],
        other_cpu=max(0.0, other / run["seconds"]),
    )
    return run


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="timed optimizer steps per run")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    p.add_argument("--repeats", type=int, default=3, help="rounds; each runs every layout once")
    p.add_argument("--batch-size", type=int, default=32, help="GLOBAL batch (sequences per step)")
    for flag, default in (("--block-size", 64), ("--n-layer", 4), ("--n-head", 4), ("--d-model", 128)):
        p.add_argument(flag, type=int, default=default, help="the demo's model/data setting")
    p.add_argument("--n-chars", type=int, default=None, help="corpus size (default: enough for one epoch)")
    p.add_argument("--max-other", type=float, default=0.25,
                   help="run again when other processes kept more cores than this busy")
    p.add_argument("--retries", type=int, default=1, help="reruns of a run that shared the machine")
    p.add_argument("--patience", type=float, default=30.0, help="max seconds to wait for a quiet machine per run")
    p.add_argument("--quick", action="store_true", help="1 round x 10 steps, no waiting or reruns")
    p.add_argument("--smoke", action="store_true", help="seconds: 1 round x 2 steps of a 1-block GPT, no waiting or "
                   "reruns; the runs of one world size in the same processes")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "parallel.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.steps, args.warmup, args.retries, args.patience = 1, 10, 3, 0, 0.0
    if args.smoke:
        args.repeats, args.steps, args.warmup, args.retries, args.patience = 1, 2, 1, 0, 0.0
        args.batch_size, args.block_size, args.n_layer, args.n_head, args.d_model = 4, 32, 1, 2, 32
    tokens_per_step = args.batch_size * args.block_size
    if args.n_chars is None:  # one epoch covers every step (10% of the corpus is the val split)
        args.n_chars = int((args.warmup + args.steps + 2) * (tokens_per_step + args.batch_size) / 0.9)
    opts = {k: getattr(args, k) for k in ("warmup", "steps", "batch_size", "block_size", "n_layer", "n_head",
                                          "d_model", "n_chars")}
    cores = os.cpu_count() or 1
    h = max(1, cores // 2)
    full, half, note = f"single {cores}thr", f"single {h}thr", NOTE.format(c=cores, h=h)
    # name -> (layout, ranks, torch threads per rank, device)
    layouts: dict[str, tuple[str, int, int | None, str]] = {
        full: ("single", 1, cores, "cpu"), half: ("single", 1, h, "cpu"),
        "ddp": ("ddp", 2, h, "cpu"), "ddp (hand)": ("hand_ddp", 2, h, "cpu"), "fsdp": ("fsdp", 2, h, "cpu"),
    }
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus:  # threads: spawn_world's default; nccl (the backend "auto" picks on CUDA)
        n = min(2, gpus)
        layouts.update({"single gpu": ("single", 1, None, "cuda"), **{
            f"{lay} {n}gpu": (lay, n, None, "cuda") for lay in ("ddp", "hand_ddp", "fsdp")}})
    names = list(layouts)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dream_parallel_") as root:
        for r in range(args.repeats):
            order = names[r % len(names):] + names[: r % len(names)]  # rotate which goes first
            if args.smoke:
                for ranks in sorted({layouts[name][1] for name in order}):
                    group = [name for name in order if layouts[name][1] == ranks]
                    for name, run in zip(group, measure_together([layouts[n] for n in group], opts, root,
                                                                 tokens_per_step)):
                        run["attempts"] = 1
                        runs[name].append(run)
                        print(f"  round {r + 1}/{args.repeats} {name:<12} {run['tokens_per_s']:>9,.0f} tokens/s "
                              f"({run['ms_per_step']:.1f} ms/step)", flush=True)
                continue
            for name in order:
                for attempt in range(1 + args.retries):
                    waited = wait_quiet(args.max_other, args.patience)
                    if waited > 1:
                        print(f"  (waited {waited:.0f} s for other processes to quiet down)", flush=True)
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
           f"{'vs full':>9}{'vs half':>9}{'ms/step':>9}{'cpu/rank':>10}{'other':>7}"
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
            "speedup_vs_single_full": med[name] / med[full], "speedup_vs_single_half": med[name] / med[half],
            "cpu_util_per_rank_median": util, "other_cpu_median": other, "runs": runs[name],
        }
        result["layouts"][name] = row
        print(f"{name:<13}{f'{ranks} x {thr}':>12}{med[name]:>10,.0f}{f'({min(tps):,.0f}-{max(tps):,.0f})':>18}"
              f"{med[name] / ranks:>10,.0f}{row['speedup_vs_single_full']:>9.2f}{row['speedup_vs_single_half']:>9.2f}"
              f"{ms:>9.1f}{util:>10.2f}{other:>7.2f}")
    print(f"""
  tokens/s = median over rounds of global tokens / wall time of the timed steps (rank 0);
  vs full / vs half = ratio to the medians of {full} / {half}; cpu/rank = process CPU / wall
  (a 1-thread rank doing only compute reads ~1.0; gloo's threads add to it); other = cores
  busy with OTHER processes during the timed steps (/proc/stat): > 0 means the run shared
  the machine and its numbers are low.
  """ + note.replace("\n", "\n  "))
    paired = {}
    for ours, hand in (("ddp", "ddp (hand)"), *((f"ddp {n}gpu", f"hand_ddp {n}gpu") for n in ([min(2, gpus)] if gpus else []))):
        ratios = [a["ms_per_step"] / b["ms_per_step"] for a, b in zip(runs[ours], runs[hand])]
        paired[ours] = {"reference": hand, "ms_ratio_per_round": ratios, "ms_ratio_median": statistics.median(ratios)}
        print(f"  {ours} / {hand}, ms per step paired by round: median {statistics.median(ratios):.3f} "
              f"(rounds: {', '.join(f'{r:.3f}' for r in ratios)}); 1.00 = the cost of a hand-written DDP loop")
    result["vs_hand_written"] = paired
    if not gpus:
        print("  GPU rows skipped: torch.cuda.is_available() is False.")
    result.update(
        note=note, baselines={"full": full, "half": half}, settings=vars(args), tokens_per_step=tokens_per_step, wall_s=wall, gpus=gpus,
        machine={**machine(), "processor": cpu_model(), "cuda": [torch.cuda.get_device_name(i) for i in range(gpus)]},
    )
    write_json(result, args.out)
    print(f"({wall:.0f} s)")
    return result


if __name__ == "__main__":
    main()

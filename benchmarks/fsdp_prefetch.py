"""FSDP2 prefetching on 2 ranks: the demo GPT with no `OptimizeFSDPCallback`, `prefetch=1` and
`prefetch=2`, and `prefetch=1` without the root's early unshard (tokens/s, ms/step).

Every run is 2 fresh processes (`spawn_world`, gloo on CPU, nccl on 2 GPUs when present)
training the demo's `GPTTrainer` with ``--parallel fsdp`` (each block ``fully_shard``ed, then
the root), validation, logging and checkpoints off. Rank 0 times the steps after a warm-up
from ``trainer.step_stats.step_time_s``. Rounds interleave the variants; the table gives
medians over rounds and the ratio to no prefetching. On 2 CPU cores over loopback the
all-gathers are CPU work competing with the compute, so overlap has little to win here:
the numbers show the cost or gain honestly; on GPUs the collectives run on their own stream.

    python benchmarks/fsdp_prefetch.py            # ~3 minutes on 2 CPU cores
    python benchmarks/fsdp_prefetch.py --quick    # ~40 s
    python benchmarks/fsdp_prefetch.py --smoke    # seconds: a 2-block d_model 32 GPT, 2 timed steps, the
                                                  # variants one after the other in one world (what CI runs)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))

from train import PARALLEL, GPTTrainer, demo_config, parse_args  # noqa: E402

from dream_trainer import Callback, LoggingParameters, TrainerConfig, TrainingParameters  # noqa: E402
from dream_trainer.callbacks import OptimizeFSDPCallback  # noqa: E402
from dream_trainer.testing import spawn_world  # noqa: E402

from common import StepTimes, machine, write_json  # noqa: E402  (benchmarks/common.py)

VARIANTS: dict[str, dict[str, Any] | None] = {
    "no prefetch": None,
    "prefetch=1": {"prefetch": 1},
    "prefetch=2": {"prefetch": 2},
    "prefetch=1 no unshard": {"prefetch": 1, "unshard_on_step": False},  # isolates the root's early unshard
}


def run_rank(options: dict[str, Any] | None, opts: dict[str, Any], device: str, root: str) -> dict[str, Any]:
    if device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    steps = opts["warmup"] + opts["steps"]
    args = parse_args(["--steps", str(steps), "--batch-size", str(opts["batch_size"]), "--n-layer", str(opts["n_layer"]),
                       "--d-model", str(opts["d_model"]), "--n-chars", str(opts["n_chars"])])
    timer = StepTimes()
    callbacks: list[Callback[Any]] = [timer] + ([OptimizeFSDPCallback(**options)] if options else [])
    config = TrainerConfig(
        experiment="prefetch", root_dir=root, seed=0, device_parameters=PARALLEL["fsdp"](device=device),
        training_parameters=TrainingParameters(n_epochs=None, max_steps=steps, global_batch_size=opts["batch_size"],
                                               val_every_n_steps=None, validate_at_epoch_end=False,
                                               num_sanity_val_steps=0),
        logging_parameters=LoggingParameters(log_every_n_steps=10**9, log_lr=False),
        callbacks=callbacks,
    )
    trainer = GPTTrainer(demo_config(config, args))
    trainer.fit()
    timed = timer.times[opts["warmup"]:]
    return {"median_step_s": statistics.median(timed)}


def run_ranks(variants: list[dict[str, Any] | None], opts: dict[str, Any], device: str,
              root: str) -> list[dict[str, Any]]:
    """--smoke: `run_rank` for each variant in turn, in one world (one start of the 2 processes,
    not one per variant: the start is most of a smoke run's time)."""
    return [run_rank(options, opts, device, root) for options in variants]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="global batch")
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--quick", action="store_true", help="1 round, 8 timed steps")
    p.add_argument("--smoke", action="store_true", help="seconds: 1 round, 2 timed steps of a 2-block d_model 32 GPT, "
                   "every variant in the same 2 processes")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "fsdp_prefetch.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 8, 2
    if args.smoke:
        args.rounds, args.steps, args.warmup, args.batch_size, args.n_layer, args.d_model = 1, 2, 1, 4, 2, 32
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = "cuda" if gpus >= 2 else "cpu"
    opts = {k: getattr(args, k) for k in ("steps", "warmup", "batch_size", "n_layer", "d_model")}
    opts["n_chars"] = int((args.warmup + args.steps + 2) * (args.batch_size * 64 + args.batch_size) / 0.9)
    names = list(VARIANTS)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dream_prefetch_") as root:
        for r in range(args.rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            if args.smoke:
                outs = iter(spawn_world(2, run_ranks, [VARIANTS[n] for n in order], opts, device, root, timeout=600)[0])
            else:  # every run in 2 fresh processes
                outs = (spawn_world(2, run_rank, VARIANTS[n], opts, device, root, timeout=600)[0] for n in order)
            for name, out in zip(order, outs):
                runs[name].append(out)
                print(f"  round {r + 1}/{args.rounds} {name:<22} {out['median_step_s'] * 1e3:8.1f} ms/step", flush=True)
    wall = time.perf_counter() - start
    tokens = args.batch_size * 64
    base = statistics.median(x["median_step_s"] for x in runs["no prefetch"])
    print(f"\ndemo GPT ({args.n_layer} blocks, d_model {args.d_model}) FSDP2 on 2 ranks ({device}), global batch "
          f"{args.batch_size} x 64 tokens, {args.steps} timed steps, {args.rounds} round(s); torch {torch.__version__}\n")
    head = f"{'variant':<24}{'ms/step':>9}{'tokens/s':>11}{'vs none':>9}"
    print(head)
    print("-" * len(head))
    rows = {}
    for name in names:
        ms = statistics.median(x["median_step_s"] for x in runs[name])
        rows[name] = {"median_step_ms": ms * 1e3, "tokens_per_s": tokens / ms, "speedup_vs_none": base / ms, "runs": runs[name]}
        print(f"{name:<24}{ms * 1e3:>9.1f}{tokens / ms:>11,.0f}{base / ms:>9.2f}")
    for name in names[1:]:  # the same round ran both back to back: the ratio cancels slow drifts
        ratios = [a["median_step_s"] / b["median_step_s"] for a, b in zip(runs["no prefetch"], runs[name])]
        rows[name]["speedup_by_round"] = ratios
        print(f"  {name}: speedup over no prefetch by round {', '.join(f'{r:.2f}' for r in ratios)}")
    print("\n  vs none > 1: faster than FSDP2 without explicit prefetching (its implicit backward prefetch only).")
    result = {"rows": rows, "settings": vars(args), "device": device, "wall_s": wall, "machine": machine()}
    write_json(result, args.out)
    print(f"({wall:.0f} s)")
    return result


if __name__ == "__main__":
    main()

"""Pipeline parallelism on 2 ranks: the measured bubble of each schedule against the
expected one (`dream_trainer.pipeline.expected_bubble`), and tokens/s against DDP on the
same 2 ranks.

Every run is the demo GPT (examples/gpt: its model, data, AdamW, warmup + cosine, clipping)
trained by `GPTTrainer` in 2 fresh processes (`spawn_world`), 1 torch thread each, with the
same GLOBAL batch, so tokens/s compare directly:

    <schedule> m=<M>   pipeline_parallel=2 (2 stages, or 4 for the interleaved schedules:
                       2 per rank), M micro-batches per batch
    ddp                dp_replicate=2: each rank runs the whole model on half the batch

**Measured bubble.** Each rank times its stage compute: every forward, backward and
weight-gradient action the schedule runs (``PipelineStage.forward_one_chunk``,
``backward_one_chunk``, ``backward_weight_one_chunk``), and the whole schedule
(`Pipeline.train_step`: the actions, the waits for the other stage's activations and
gradients, and the loss broadcast). Bubble = 1 - compute / schedule time, over the timed
steps, averaged over the 2 ranks: the fraction of a rank's pipeline time it spends not
computing (idle, plus sending and receiving). Expected: the schedule's analytic bubble with a
stage's forward, input-backward and weight-backward one unit each; it counts no
communication, so measured bubbles are above it where the per-action compute is small.

On 2 CPU cores (one rank per core) the pipeline splits one model's work over 2 cores, as DDP
does: tokens/s compare the two layouts' overheads (bubble and point-to-point transfers for
the pipeline; the gradient all-reduce for DDP), not scaling.

    python benchmarks/pipeline.py            # ~3 minutes on an idle 2-core machine
    python benchmarks/pipeline.py --quick    # ~1 minute
    python benchmarks/pipeline.py --smoke    # seconds: a 4-block d_model 32 GPT, 2 micro-batches, 2 steps, every
                                             # row one after the other in the same 2 processes (what CI runs)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))

from train import GPTTrainer, demo_config, parse_args  # noqa: E402

from dream_trainer import DeviceParameters, LoggingParameters, TrainerConfig, TrainingParameters  # noqa: E402
from dream_trainer.pipeline import PipelineParameters, expected_bubble  # noqa: E402
from dream_trainer.testing import spawn_world  # noqa: E402

from common import machine, write_json  # noqa: E402  (benchmarks/common.py)
from parallel import StepTimer  # noqa: E402

SCHEDULES = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2, "InterleavedZeroBubble": 2}  # stages per rank


class _Clock:
    """Seconds spent in the timed calls (reset when the timed steps start)."""

    def __init__(self) -> None:
        self.compute = self.schedule = 0.0
        self.actions = 0
        self._wrapped: list[tuple[type, str, Any]] = []  # (owner, name, the original), to restore

    def restore(self) -> None:
        """Put the original methods back (the next run in this process wraps them afresh)."""
        for owner, name, original in reversed(self._wrapped):
            setattr(owner, name, original)
        self._wrapped.clear()

    def wrap(self, owner: type, name: str, field: str) -> None:
        original = getattr(owner, name)
        self._wrapped.append((owner, name, original))
        clock = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                setattr(clock, field, getattr(clock, field) + time.perf_counter() - t)
                if field == "compute":
                    clock.actions += 1

        setattr(owner, name, timed)


class _Reset(StepTimer):
    """`StepTimer`, and the clock's counters zeroed at the first mark (after the warm-up)."""

    def __init__(self, warmup: int, steps: int, clock: _Clock):
        super().__init__(warmup, steps)
        self.clock, self.counts = clock, []

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        super().post_train_step(result, batch_idx)
        if self.trainer.global_step in self.at:
            self.counts.append((self.clock.compute, self.clock.schedule, self.clock.actions))


def run_rank(layout: str, schedule: str | None, microbatches: int | None, opts: dict[str, Any], root: str) -> dict:
    """One rank of one run (module level: spawn_world pickles it)."""
    torch.set_num_threads(1)
    clock = _Clock()
    if schedule is not None:
        from torch.distributed.pipelining.stage import _PipelineStageBase

        from dream_trainer.pipeline import Pipeline

        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            clock.wrap(_PipelineStageBase, name, "compute")
        clock.wrap(Pipeline, "train_step", "schedule")
    warmup, steps = opts["warmup"], opts["steps"]
    flags = {k: v for k, v in opts.items() if k not in ("warmup", "steps")}
    args = parse_args([x for k, v in flags.items() for x in (f"--{k.replace('_', '-')}", str(v))])
    timer = _Reset(warmup, steps, clock)
    if layout == "pp":
        device = DeviceParameters(device="cpu", pipeline_parallel=2, dp_replicate=1, dp_shard=1,
                                  pipeline=PipelineParameters(schedule=schedule, microbatches=microbatches))
    else:
        device = DeviceParameters(device="cpu", dp_replicate=2, dp_shard=1)
    config = TrainerConfig(
        experiment="pipeline", root_dir=root, seed=0, device_parameters=device,
        training_parameters=TrainingParameters(
            n_epochs=None, max_steps=warmup + steps, global_batch_size=opts["batch_size"], val_every_n_steps=None,
            validate_at_epoch_end=False, num_sanity_val_steps=0, gradient_clip_val=1.0),
        logging_parameters=LoggingParameters(log_every_n_steps=10**9, log_lr=False),
        callbacks=[timer],
    )
    trainer = GPTTrainer(demo_config(config, args))
    try:
        trainer.fit()
    finally:
        clock.restore()
    (t0, _, _), (t1, _, _) = timer.marks
    out: dict[str, Any] = {"seconds": t1 - t0}
    if schedule is not None:
        (c0, s0, a0), (c1, s1, a1) = timer.counts
        out.update(compute_s=c1 - c0, schedule_s=s1 - s0, actions=a1 - a0,
                   chosen=trainer.pipeline.choice.schedule, microbatches=trainer.pipeline.choice.microbatches)
    return out


def run_rows(rows: list[tuple[str, str | None, int | None]], opts: dict[str, Any], root: str) -> list[dict]:
    """--smoke: one rank of several rows, one after the other in the same processes (one start of
    the 2 processes instead of one per row)."""
    return [run_rank(*row, opts, root) for row in rows]


def measure(layout: str, schedule: str | None, microbatches: int | None, opts: dict[str, Any], root: str) -> dict:
    """One run of one row in 2 fresh processes."""
    ranks = spawn_world(2, run_rank, layout, schedule, microbatches, opts, root, timeout=600.0)
    return summarize(ranks, schedule, microbatches, opts)


def summarize(ranks: list[dict[str, Any]], schedule: str | None, microbatches: int | None,
              opts: dict[str, Any]) -> dict:
    """One run from its ranks' timings: tokens/s, ms/step and (pipelined) the measured bubble."""
    tokens = opts["batch_size"] * opts["block_size"] * opts["steps"]
    run = {"tokens_per_s": tokens / ranks[0]["seconds"], "ms_per_step": ranks[0]["seconds"] / opts["steps"] * 1e3}
    if schedule is not None:
        run["bubble_per_rank"] = [1 - r["compute_s"] / r["schedule_s"] for r in ranks]
        run["bubble"] = statistics.mean(run["bubble_per_rank"])
        run["actions_per_step"] = [r["actions"] / opts["steps"] for r in ranks]
        run["schedule_ms_per_step"] = statistics.mean(r["schedule_s"] for r in ranks) / opts["steps"] * 1e3
        assert ranks[0]["chosen"] == schedule and ranks[0]["microbatches"] == microbatches
    return run


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    p.add_argument("--repeats", type=int, default=2, help="rounds; each runs every row once")
    p.add_argument("--batch-size", type=int, default=32, help="GLOBAL batch (sequences per step)")
    p.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    for flag, default in (("--block-size", 64), ("--n-layer", 8), ("--n-head", 4), ("--d-model", 128)):
        p.add_argument(flag, type=int, default=default, help="the demo's model/data setting")
    p.add_argument("--quick", action="store_true", help="1 round x 4 steps, 4 micro-batches")
    p.add_argument("--smoke", action="store_true", help="seconds: 1 round x 2 steps of a 4-block d_model 32 GPT, "
                   "2 micro-batches, every row in the same 2 processes")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "pipeline.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.steps, args.warmup, args.microbatches = 1, 4, 2, [4]
    if args.smoke:
        args.repeats, args.steps, args.warmup, args.microbatches = 1, 2, 1, [2]
        args.batch_size, args.block_size, args.n_layer, args.n_head, args.d_model = 4, 32, 4, 2, 32
    tokens_per_step = args.batch_size * args.block_size
    n_chars = int((args.warmup + args.steps + 2) * (tokens_per_step + args.batch_size) / 0.9)
    opts = {"warmup": args.warmup, "steps": args.steps, "batch_size": args.batch_size, "block_size": args.block_size,
            "n_layer": args.n_layer, "n_head": args.n_head, "d_model": args.d_model, "n_chars": n_chars}
    rows: dict[str, tuple[str, str | None, int | None]] = {"ddp": ("ddp", None, None)}
    for m in args.microbatches:
        rows.update({f"{name} m={m}": ("pp", name, m) for name in SCHEDULES})
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in rows}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dream_pipeline_") as root:
        for r in range(args.repeats):
            names = list(rows)
            order = names[r % len(names):] + names[: r % len(names)]  # rotate which goes first
            if args.smoke:
                ranks = spawn_world(2, run_rows, [rows[n] for n in order], opts, root, timeout=600.0)
                done = iter([summarize([rank[i] for rank in ranks], *rows[n][1:], opts) for i, n in enumerate(order)])
            else:  # every run in 2 fresh processes
                done = (measure(*rows[n], opts, root) for n in order)
            for name, run in zip(order, done):
                runs[name].append(run)
                bubble = f", bubble {run['bubble']:.1%}" if "bubble" in run else ""
                print(f"  round {r + 1}/{args.repeats} {name:<28} {run['tokens_per_s']:>8,.0f} tokens/s{bubble}",
                      flush=True)
    wall = time.perf_counter() - start

    ddp = statistics.median(x["tokens_per_s"] for x in runs["ddp"])
    print(f"\nGPT {args.n_layer} layers, d_model {args.d_model}; global batch {args.batch_size} x {args.block_size} = "
          f"{tokens_per_step} tokens/step; 2 ranks x 1 thread; {args.warmup} warm-up + {args.steps} timed steps, "
          f"{args.repeats} round(s); torch {torch.__version__}\n")
    head = f"{'layout':<28}{'stages':>7}{'bubble':>9}{'expected':>10}{'tokens/s':>10}{'vs ddp':>8}{'ms/step':>9}"
    print(head)
    print("-" * len(head))
    result: dict[str, Any] = {"rows": {}}
    for name, (layout, schedule, m) in rows.items():
        tps = statistics.median(x["tokens_per_s"] for x in runs[name])
        ms = statistics.median(x["ms_per_step"] for x in runs[name])
        row: dict[str, Any] = {"layout": layout, "schedule": schedule, "microbatches": m, "tokens_per_s_median": tps,
                               "vs_ddp": tps / ddp, "ms_per_step_median": ms, "runs": runs[name]}
        if schedule is None:
            print(f"{name:<28}{'-':>7}{'-':>9}{'-':>10}{tps:>10,.0f}{1.0:>8.2f}{ms:>9.1f}")
        else:
            v = SCHEDULES[schedule]
            row["bubble_median"] = statistics.median(x["bubble"] for x in runs[name])
            row["expected_bubble"] = expected_bubble(schedule, 2, m, v)
            print(f"{name:<28}{f'2x{v}':>7}{row['bubble_median']:>9.1%}{row['expected_bubble']:>10.1%}{tps:>10,.0f}"
                  f"{tps / ddp:>8.2f}{ms:>9.1f}")
        result["rows"][name] = row
    print("""
  bubble = 1 - stage compute / schedule time per rank (median over rounds, mean of the 2 ranks);
  expected = the schedule's analytic bubble (forward = input-backward = weight-backward, no
  communication); vs ddp = tokens/s over DDP's on the same 2 ranks with the same global batch.""")
    result.update(settings=vars(args), tokens_per_step=tokens_per_step, wall_s=wall, machine=machine())
    write_json(result, args.out)
    print(f"({wall:.0f} s)")
    return result


if __name__ == "__main__":
    main()

"""Pipeline parallelism on 2 ranks: where each schedule's time goes (compute, transfer,
idle) against its expected bubble (`dream_trainer.pipeline.expected_bubble`), and tokens/s
against DDP on the same 2 ranks.

Every run is the demo GPT (examples/gpt: its model, data, AdamW, warmup + cosine, clipping)
trained by `GPTTrainer` in 2 fresh processes (`spawn_world`), 1 torch thread each, with the
same GLOBAL batch, so tokens/s compare directly:

    <schedule> m=<M>   pipeline_parallel=2 (2 stages, or 4 for the interleaved schedules:
                       2 per rank), M micro-batches per batch
    ddp                dp_replicate=2: each rank runs the whole model on half the batch

**Where a rank's schedule time goes.** Each rank wraps torch's calls with timers and splits
the time of the whole schedule (`Pipeline.train_step`) into:

- compute: the stage actions (``PipelineStage.forward_one_chunk``, ``backward_one_chunk``,
  ``backward_weight_one_chunk``) and the last stage's loss (``_maybe_compute_loss``);
- transfer: posting the point-to-point ops (``schedules._batch_p2p``: isend / irecv /
  batch_isend_irecv) and waiting for batches of sends only (``_wait_batch_p2p``); with gloo a
  send may complete only once the peer takes it, so this bounds the wire time from above;
- idle: the rest: waiting for receives (the other stage's activations or gradients: the
  bubble proper, and the receiving end of each transfer; ``recv_wait`` in the JSON) and the
  schedule's own bookkeeping (splitting micro-batches, the loss broadcast).

Each is a fraction of the schedule time over the timed steps, averaged over the 2 ranks
(``compute``, ``transfer``, ``idle``, each with its ``*_per_rank``; ``recv_wait``;
``not_compute`` = 1 - compute). Expected: the schedule's analytic bubble
(`expected_bubble(schedule, pp, stages_per_rank, microbatches)`) with a stage's forward,
input-backward and weight-backward one unit each and free communication: compare it with idle.

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
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Callable
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


PHASES = ("compute", "post", "send_wait", "recv_wait")
"""Where a rank's pipeline time goes, timed around torch's calls (see the module's docstring)."""


class _Clock:
    """Seconds spent in the timed calls, by phase (`PHASES`, and ``schedule``: the whole
    `Pipeline.train_step`); the counters are read at the marks (`_Reset`)."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys((*PHASES, "schedule"), 0.0)
        self.actions = 0
        self._wrapped: list[tuple[Any, str, Any]] = []  # (owner, name, the original), to restore
        self._posted: dict[int, tuple[list[Any], str]] = {}  # id(works) -> (works, the phase of their wait)

    def restore(self) -> None:
        """Put the original functions back (the next run in this process wraps them afresh)."""
        for owner, name, original in reversed(self._wrapped):
            setattr(owner, name, original)
        self._wrapped.clear()

    def counts(self) -> tuple[float, ...]:
        return (*self.seconds.values(), self.actions)

    def wrap(self, owner: Any, name: str, field: str | Callable[..., str]) -> None:
        """Time ``owner.name`` into `field` (or the field `field(*args)` names)."""
        original = getattr(owner, name)
        self._wrapped.append((owner, name, original))
        clock = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            phase = field if isinstance(field, str) else field(*args)
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                clock.seconds[phase] += time.perf_counter() - t
                clock.actions += phase == "compute"

        setattr(owner, name, timed)

    def wrap_p2p(self) -> None:
        """Time torch's P2P calls: posting (``_batch_p2p``: isend/irecv, batch_isend_irecv)
        and waiting (``_wait_batch_p2p``), a wait on sends only apart from one on receives."""
        import torch.distributed as dist
        from torch.distributed.pipelining import schedules

        post = schedules._batch_p2p
        posted = self._posted

        def batch_p2p(ops: list[Any], desc: str | None = None) -> list[Any]:
            works = post(ops, desc)
            posted[id(works)] = (works, "send_wait" if all(op.op is dist.isend for op in ops) else "recv_wait")
            return works

        self._wrapped.append((schedules, "_batch_p2p", post))
        schedules._batch_p2p = batch_p2p
        self.wrap(schedules, "_batch_p2p", "post")
        self.wrap(schedules, "_wait_batch_p2p", lambda works: posted.pop(id(works), (None, "recv_wait"))[1])


class _Reset(StepTimer):
    """`StepTimer`, and the clock's counters zeroed at the first mark (after the warm-up)."""

    def __init__(self, warmup: int, steps: int, clock: _Clock):
        super().__init__(warmup, steps)
        self.clock, self.counts = clock, []

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        super().post_train_step(result, batch_idx)
        if self.trainer.global_step in self.at:
            self.counts.append(self.clock.counts())


def run_rank(layout: str, schedule: str | None, microbatches: int | None, opts: dict[str, Any], root: str) -> dict:
    """One rank of one run (module level: spawn_world pickles it)."""
    torch.set_num_threads(1)
    clock = _Clock()
    if schedule is not None:
        from torch.distributed.pipelining.schedules import _PipelineSchedule
        from torch.distributed.pipelining.stage import _PipelineStageBase

        from dream_trainer.pipeline import Pipeline

        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            clock.wrap(_PipelineStageBase, name, "compute")
        clock.wrap(_PipelineSchedule, "_maybe_compute_loss", "compute")  # the last stage's loss
        clock.wrap_p2p()
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
        first, last = timer.counts
        out.update({f"{name}_s": b - a for name, a, b in zip((*clock.seconds, "actions"), first, last)})
        choice = trainer.pipeline.choice
        out.update(actions=int(out.pop("actions_s")), chosen=choice.schedule, microbatches=choice.microbatches,
                   estimated_ms=choice.estimates[0] * 1e3 if choice.estimates else None)
    return out


SPLIT = {"compute": ("compute",), "transfer": ("post", "send_wait")}
"""The timed phases of each part of a rank's schedule time; idle is the rest."""


def run_rows(rows: list[tuple[str, str | None, int | None]], opts: dict[str, Any], root: str) -> list[dict]:
    """--smoke: one rank of several rows, one after the other in the same processes (one start of
    the 2 processes instead of one per row)."""
    out = []
    for i, row in enumerate(rows):
        out.append(run_rank(*row, opts, root))
        gc.collect()  # the finished trainer (reference cycles) and rank 0's rendezvous store: its port is free again
        _both_done(Path(root) / f"row-{i}")  # no rank meets the next run's rendezvous at the last run's store
    return out


def _both_done(mark: Path, timeout: float = 120.0) -> None:
    """A barrier of the 2 ranks through files (their process group is gone with the run)."""
    Path(f"{mark}.rank{os.environ['RANK']}").touch()
    deadline = time.monotonic() + timeout
    while not all(Path(f"{mark}.rank{r}").exists() for r in range(2)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the other rank did not finish {mark.name} within {timeout:g} s")
        time.sleep(0.01)


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
        for part, phases in SPLIT.items():  # fractions of each rank's schedule time
            run[f"{part}_per_rank"] = [sum(r[f"{p}_s"] for p in phases) / r["schedule_s"] for r in ranks]
            run[part] = statistics.mean(run[f"{part}_per_rank"])
        run["idle_per_rank"] = [1 - sum(run[f"{part}_per_rank"][i] for part in SPLIT) for i in range(len(ranks))]
        run["idle"] = statistics.mean(run["idle_per_rank"])
        run["recv_wait"] = statistics.mean(r["recv_wait_s"] / r["schedule_s"] for r in ranks)  # part of idle
        run["not_compute"] = 1 - run["compute"]
        run["actions_per_step"] = [r["actions"] / opts["steps"] for r in ranks]
        run["schedule_ms_per_step"] = statistics.mean(r["schedule_s"] for r in ranks) / opts["steps"] * 1e3
        run["estimated_ms"] = ranks[0]["estimated_ms"]  # the cost model's step (dream_trainer.pipeline.cost)
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
                bubble = f", idle {run['idle']:.1%}, transfer {run['transfer']:.1%}" if "idle" in run else ""
                print(f"  round {r + 1}/{args.repeats} {name:<28} {run['tokens_per_s']:>8,.0f} tokens/s{bubble}",
                      flush=True)
    wall = time.perf_counter() - start

    ddp = statistics.median(x["tokens_per_s"] for x in runs["ddp"])
    print(f"\nGPT {args.n_layer} layers, d_model {args.d_model}; global batch {args.batch_size} x {args.block_size} = "
          f"{tokens_per_step} tokens/step; 2 ranks x 1 thread; {args.warmup} warm-up + {args.steps} timed steps, "
          f"{args.repeats} round(s); torch {torch.__version__}\n")
    head = (f"{'layout':<28}{'stages':>7}{'compute':>9}{'transfer':>10}{'idle':>7}{'expected':>10}{'tokens/s':>10}"
            f"{'vs ddp':>8}{'ms/step':>9}{'est. ms':>9}")
    print(head)
    print("-" * len(head))
    result: dict[str, Any] = {"rows": {}}
    for name, (layout, schedule, m) in rows.items():
        tps = statistics.median(x["tokens_per_s"] for x in runs[name])
        ms = statistics.median(x["ms_per_step"] for x in runs[name])
        row: dict[str, Any] = {"layout": layout, "schedule": schedule, "microbatches": m, "tokens_per_s_median": tps,
                               "vs_ddp": tps / ddp, "ms_per_step_median": ms, "runs": runs[name]}
        if schedule is None:
            print(f"{name:<28}{'-':>7}{'-':>9}{'-':>10}{'-':>7}{'-':>10}{tps:>10,.0f}{1.0:>8.2f}{ms:>9.1f}{'-':>9}")
        else:
            v = SCHEDULES[schedule]
            for part in ("compute", "transfer", "idle", "recv_wait"):
                row[f"{part}_median"] = statistics.median(x[part] for x in runs[name])
            row["expected_bubble"] = expected_bubble(schedule, pp=2, stages_per_rank=v, microbatches=m)
            row["estimated_ms"] = runs[name][0]["estimated_ms"]
            est = f"{row['estimated_ms']:>9.1f}" if row["estimated_ms"] is not None else f"{'-':>9}"
            print(f"{name:<28}{f'2x{v}':>7}{row['compute_median']:>9.1%}{row['transfer_median']:>10.1%}"
                  f"{row['idle_median']:>7.1%}{row['expected_bubble']:>10.1%}{tps:>10,.0f}{tps / ddp:>8.2f}{ms:>9.1f}"
                  f"{est}")
        result["rows"][name] = row
    print("""
  compute / transfer / idle: fractions of each rank's schedule time (median over rounds, mean of
  the 2 ranks): stage forward, backward and loss / posting P2P ops and waiting for sends /
  the rest: waiting for receives (the other stage's activations or gradients) and the
  schedule's own bookkeeping. expected = the schedule's analytic bubble (forward =
  input-backward = weight-backward, free communication), to compare with idle; vs ddp =
  tokens/s over DDP's on the same 2 ranks with the same global batch; est. ms = the
  automatic choice's cost model (dream_trainer.pipeline.cost), to compare with ms/step.""")
    result.update(settings=vars(args), tokens_per_step=tokens_per_step, wall_s=wall, machine=machine())
    write_json(result, args.out)
    print(f"({wall:.0f} s)")
    return result


if __name__ == "__main__":
    main()

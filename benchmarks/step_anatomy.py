"""Where the trainer's per-step cost goes on `overhead.py`'s model: the shipped step beside
stand-ins that leave parts of it out, in one run.

`overhead.py` pairs each trainer step with a raw one and finds the trainer ~2-3 % over the
hand-written loop (~17-30 µs a step on a ~850-950 µs step, depending on how busy the machine
is). This script asks which part of the step path that is. Each epoch runs one variant
(swapped in at the epoch boundary, rotating every round), each step paired with a raw step
(`common.RawBeside`), on the same model, optimizer and batches:

    trainer              the step path as shipped
    trainer (A/A)        the same again: the measurement's noise
    counted              the batch's samples/tokens counted (what ``request_batch_counts``
                         turns on: a throughput monitor asks; the shipped step counts nothing
                         until asked)
    lean open            `_open_batch` cut to the counters and the step's telemetry reset
    flat loop            the loop's side of a step (open, arrival, result, end of step, log
                         step, control point) in one function, for this run's plain case only
                         (one process, no accumulation, no batch hooks)
    flat + bare API      the flat loop, and ``self.backward``/``self.step`` reduced to the
                         torch calls (``loss.backward()``, ``optimizer.step()``, ``zero_grad``)
    floor                ``training_step``, the loss's detach and the step counter: what any
                         loop must do

The stand-ins are measurement probes, not alternatives that keep every guarantee (the flat
loop skips checks this run does not need; the floor keeps no telemetry). `vs trainer` is the
median over rounds of (variant / trainer in the same round); `µs over raw` is the median over
epochs of (the variant's time - its raw steps' time) per step, this thread's CPU time.

    python benchmarks/step_anatomy.py            # ~3 minutes
    python benchmarks/step_anatomy.py --smoke    # seconds (what CI runs)
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from dream_trainer import Callback, DeviceParameters, LoggingParameters, TrainerConfig, TrainingParameters
from dream_trainer.trainer.abstract import AbstractTrainer
from dream_trainer.trainer.base import BaseTrainer
from dream_trainer.trainer.stepping import Stepper

from common import RawBeside, machine, write_json  # noqa: E402  (benchmarks/common.py)
from overhead import BenchTrainer, build_model, make_batches, raw_step  # noqa: E402  (the same model and trainer)


def _arrived_counted(self: Stepper, batch: Any, step: int, now: float) -> None:
    trainer, path = self.trainer, self.path
    opened = path.arrive(now)
    path.count(*trainer.count_batch(batch))
    if opened and "on_step_begin" in trainer.callbacks.overridden:
        trainer.callbacks.on_step_begin(step)


def _open_lean(self: BaseTrainer, batch: Any, batch_idx: int, is_last: bool) -> tuple[bool, int]:
    self.local_batches = batch_idx + 1
    step, path = self.global_step + 1, self.stepper.path
    if not path.open:
        path.stats.begin(False)
        path.open, path.stepped = True, False
    kind = 2 if step % self.config.logging_parameters.log_every_n_steps == 0 else 0
    self.metric_log.gate = kind > 0
    return False, kind


def _train_on_flat(self: BaseTrainer, batch: Any, batch_idx: int, is_last: bool) -> tuple[Any, bool]:
    step, log_ = self.global_step + 1, self.metric_log
    self.local_batches, self.is_last_batch = batch_idx + 1, is_last
    log_kind = 2 if step % self.config.logging_parameters.log_every_n_steps == 0 else 0
    log_.gate = log_kind > 0
    path = self.stepper.path
    stats, now = path.stats, time.perf_counter()
    if not path.open:
        stats.micro_batches = stats.backward_count = 0
        stats.loss_sum = stats.samples = stats.tokens = stats.skipped = stats.backward_sum = None
        stats.grad_norm, stats.clip_limit, stats.lr = {}, {}, {}
        stats.data_wait_s, stats.compute_s, stats.optimizer_s = 0.0, math.nan, math.nan
        path.open, path.stepped = True, False
    wait = now - path.fetch_start
    stats.data_wait_s += wait
    path.data_total += wait
    path.arrived_at = now
    result = self.training_step(batch, batch_idx)
    for key, value in result.items():
        if isinstance(value, torch.Tensor) and value.requires_grad:
            result[key] = value.detach()
    loss = result.get("loss")
    stats.micro_batches += 1
    stats.loss_sum = loss
    now = time.perf_counter()
    own = log_.own_step_metrics(result, stats, self.world, self.current_epoch, True, False) if log_kind else None
    stats.step, stats.step_time_s, path.step_end = step, now - path.step_end, now
    path.ended_at, path.data_at_end, path.open = now, path.data_total, False
    self.global_step = step
    if own is not None:
        log_.send_step(own)
    log_.gate = None
    self.control.decide(self.world, self.callbacks, blocking=False)
    return loss, False


def _train_on_floor(self: BaseTrainer, batch: Any, batch_idx: int, is_last: bool) -> tuple[Any, bool]:
    self.local_batches = batch_idx + 1
    loss = self.training_step(batch, batch_idx)["loss"].detach()
    self.global_step += 1
    return loss, False


def _bare_backward(self: AbstractTrainer, loss: torch.Tensor, **kwargs: Any) -> None:
    loss.backward(**kwargs)


def _bare_step(self: AbstractTrainer, optimizer: torch.optim.Optimizer, model: Any = None) -> None:
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    self.stepper.path.stepped = True


_BARE = [(AbstractTrainer, "backward", _bare_backward), (AbstractTrainer, "step", _bare_step)]
VARIANTS: dict[str, list[tuple[type, str, Any]]] = {
    "trainer": [],
    "trainer (A/A)": [],
    "counted": [(Stepper, "batch_arrived", _arrived_counted)],
    "lean open": [(BaseTrainer, "_open_batch", _open_lean)],
    "flat loop": [(BaseTrainer, "_train_on", _train_on_flat)],
    "flat + bare API": [(BaseTrainer, "_train_on", _train_on_flat), *_BARE],
    "floor": [(BaseTrainer, "_train_on", _train_on_floor), *_BARE],
}
_ORIGINALS = {(owner, name): owner.__dict__[name] for patches in VARIANTS.values() for owner, name, _ in patches}


def _use(variant: str) -> None:
    for (owner, name), original in _ORIGINALS.items():
        setattr(owner, name, original)
    for owner, name, value in VARIANTS[variant]:
        setattr(owner, name, value)


class Rotate(Callback[Any]):
    """Swaps the variant in at each epoch's start and times the epoch (to `post_epoch`)
    against its raw steps."""

    def __init__(self, schedule: list[str], raw: RawBeside, warmup: int):
        self.schedule, self.raw, self.warmup = schedule, raw, warmup
        self.epochs: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}  # (raw, framework) s/step

    def pre_train_epoch(self) -> None:
        self._variant = self.schedule[self.trainer.current_epoch]
        _use(self._variant)
        self._start = self.raw.mark()

    def post_epoch(self) -> None:  # not post_train_epoch: its reader costs the trainer a step's work (the epoch loss)
        window = self.raw.window(self._start, self.trainer.local_batches)
        if self.trainer.current_epoch >= self.warmup:
            self.epochs[self._variant].append((window["raw"], window["framework"]))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=100, help="rounds; each runs every variant for one epoch")
    p.add_argument("--steps", type=int, default=100, help="steps per epoch")
    p.add_argument("--warmup", type=int, default=4, help="discarded leading epochs (the shipped trainer)")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--smoke", action="store_true", help="seconds: 1 round of 4-step epochs, a 2-layer MLP 64 wide")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "step_anatomy.json"))
    args = p.parse_args(argv)
    if args.smoke:
        args.rounds, args.warmup, args.steps, args.width, args.depth = 1, 1, 4, 64, 2
    torch.set_num_threads(1)
    torch.manual_seed(0)
    init = {k: v.clone() for k, v in build_model(args.width, args.depth).state_dict().items()}
    names = list(VARIANTS)
    schedule = [names[0]] * args.warmup
    for r in range(args.rounds):
        schedule += names[r % len(names):] + names[:r % len(names)]
    raw = RawBeside(lambda batch: raw_step(trainer.model, trainer.optimizer, batch))
    rotate = Rotate(schedule, raw, args.warmup)
    with tempfile.TemporaryDirectory(prefix="step_anatomy_") as root:
        config = TrainerConfig(
            root_dir=root, device_parameters=DeviceParameters.SINGLE_DEVICE(), callbacks=[rotate],
            training_parameters=TrainingParameters(n_epochs=len(schedule), num_sanity_val_steps=0,
                                                   validate_at_epoch_end=False),
            logging_parameters=LoggingParameters(log_every_n_steps=10),  # overhead.py's
        )
        trainer = BenchTrainer(config, init, raw.loader(make_batches(args.steps, 32, args.width)), args)
        try:
            trainer.fit()
        finally:
            _use("trainer")
    rows: dict[str, dict[str, Any]] = {}
    base = rotate.epochs["trainer"]
    for name in names:
        epochs = rotate.epochs[name]
        rows[name] = {
            "paired_ratio": statistics.median(f / r for r, f in epochs),
            "us_over_raw": statistics.median((f - r) * 1e6 for r, f in epochs),
            "raw_step_us": statistics.median(r * 1e6 for r, _ in epochs),
            "vs_trainer": statistics.median(f / r / (fb / rb) for (r, f), (rb, fb) in zip(epochs, base)),
            "epochs": len(epochs),
        }
    print(f"\nthe trainer's step, part by part: {args.depth}-layer MLP {args.width} wide, batch 32, AdamW, 1 thread, "
          f"{args.rounds} rounds x {args.steps} steps, torch {torch.__version__}\n")
    print(f"{'variant':<17}{'raw µs':>9}{'paired':>9}{'µs over raw':>13}{'vs trainer':>12}")
    for name, row in rows.items():
        print(f"{name:<17}{row['raw_step_us']:>9.1f}{row['paired_ratio']:>9.4f}{row['us_over_raw']:>13.1f}"
              f"{row['vs_trainer']:>12.4f}")
    print("\n  paired = median over epochs of (variant time / its raw steps' time); vs trainer = median over rounds of\n"
          "  (variant / trainer, each paired); (A/A) is the noise. The stand-ins are probes (see the docstring).")
    result = {"rows": rows, "settings": vars(args), "machine": machine()}
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()

"""The cost of the training-health suite on the demo GPT: all six health callbacks at their
default intervals (`health_callbacks()`; the dashboard is off: not a terminal) against none.

One process, one trainer, epochs interleaved: a switching callback attaches the six monitors
for one epoch of each pair and removes them for the other (the order alternating from pair
to pair), so drift on a shared machine hits both alike. Each epoch is timed on the wall clock and on this thread's CPU time; the
overhead is the median over pairs of adjacent epochs of (with / without) - 1. Target: <= 3 %.

    python benchmarks/health.py            # ~3 minutes on 2 CPU cores
    python benchmarks/health.py --quick    # ~40 s
    python benchmarks/health.py --smoke    # seconds: 1 pair of 3-step epochs (what CI runs)
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

from train import PARALLEL, GPTTrainer, demo_config, parse_args  # noqa: E402

from dream_trainer import Callback, LoggingParameters, TrainerConfig, TrainingParameters  # noqa: E402
from dream_trainer.callbacks import health_callbacks  # noqa: E402

from common import machine, write_json  # noqa: E402  (benchmarks/common.py)

TARGET = 0.03


class Switch(Callback[Any]):
    """Times every epoch and attaches the health callbacks on every other one."""

    def __init__(self, warmup: int):
        self.warmup = warmup
        self.health = health_callbacks()
        self.epochs: list[tuple[bool, float, float]] = []  # (with health, wall s, cpu s)
        self._on = False

    def pre_train_epoch(self) -> None:
        trainer = self.trainer
        index = trainer.current_epoch - self.warmup
        # ABBA: pairs alternate which half has the monitors, so slow drifts cancel out
        want = index >= 0 and (index % 2 == 0) == ((index // 2) % 2 == 0)
        if want != self._on:
            for cb in self.health:
                if want:
                    trainer.callbacks.add(cb)
                    cb.post_setup()  # attached mid-run: what it asks of the trainer at setup
                else:
                    trainer.callbacks.remove(cb)
            if not want:  # withdraw what the monitors asked the trainer to compute
                trainer.request_grad_norm(False)
                trainer.request_backward_loss(False)
            self._on = want
        self._t0, self._c0 = time.perf_counter(), time.thread_time()

    def post_train_epoch(self, result: dict[str, Any]) -> None:
        self.epochs.append((self._on, time.perf_counter() - self._t0, time.thread_time() - self._c0))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=12, help="pairs of epochs (with and without)")
    p.add_argument("--steps", type=int, default=25, help="optimizer steps per epoch")
    p.add_argument("--warmup", type=int, default=2, help="untimed leading epochs")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="2 pairs of 10-step epochs")
    p.add_argument("--smoke", action="store_true", help="seconds: 1 pair of 3-step epochs after 1 warm-up epoch")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "health.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.pairs, args.steps = 2, 10
    if args.smoke:
        args.pairs, args.steps, args.warmup = 1, 3, 1
    torch.set_num_threads(args.threads)
    epochs = args.warmup + 2 * args.pairs
    batch, block = 16, 64
    demo = parse_args(["--batch-size", str(batch), "--block-size", str(block), "--steps", str(epochs * args.steps),
                       "--n-chars", str(int((args.steps + 2) * (batch * block + batch) / 0.9))])
    switch = Switch(args.warmup)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dream_health_") as root:
        config = TrainerConfig(
            experiment="health", root_dir=root, seed=0, device_parameters=PARALLEL["single"](),
            training_parameters=TrainingParameters(n_epochs=epochs, train_steps_per_epoch=args.steps,
                                                   global_batch_size=batch, val_every_n_steps=None,
                                                   validate_at_epoch_end=False, num_sanity_val_steps=0),
            logging_parameters=LoggingParameters(log_every_n_steps=50), callbacks=[switch],
        )
        GPTTrainer(demo_config(config, demo)).fit()
    wall = time.perf_counter() - start
    timed = switch.epochs[args.warmup:]
    pairs = [(timed[i], timed[i + 1]) for i in range(0, len(timed) - 1, 2)]
    over_wall = [a[1] / b[1] - 1 if a[0] else b[1] / a[1] - 1 for a, b in pairs]
    over_cpu = [a[2] / b[2] - 1 if a[0] else b[2] / a[2] - 1 for a, b in pairs]
    off = [w for on, w, _ in timed if not on]
    on = [w for on_, w, _ in timed if on_]
    result = {
        "ms_per_step_without": statistics.median(off) / args.steps * 1e3,
        "ms_per_step_with": statistics.median(on) / args.steps * 1e3,
        "overhead_wall_median": statistics.median(over_wall), "overhead_cpu_median": statistics.median(over_cpu),
        "overhead_wall_pairs": over_wall, "overhead_cpu_pairs": over_cpu, "target": TARGET,
        "target_met": statistics.median(over_cpu) <= TARGET,
        "settings": vars(args), "wall_s": wall, "machine": machine(),
    }
    print(f"\nhealth suite on the demo GPT (4 blocks, d_model 128, batch {batch} x {block}), {args.threads} thread(s), "
          f"{args.pairs} pairs of {args.steps}-step epochs; torch {torch.__version__}\n")
    print(f"{'':<22}{'without':>10}{'with six':>10}{'overhead':>10}")
    print(f"{'ms/step (median)':<22}{result['ms_per_step_without']:>10.1f}{result['ms_per_step_with']:>10.1f}"
          f"{100 * result['overhead_wall_median']:>9.1f}%")
    print(f"{'cpu overhead (paired)':<22}{'':>20}{100 * result['overhead_cpu_median']:>9.1f}%   target <= "
          f"{100 * TARGET:.0f}%: {'met' if result['target_met'] else 'NOT met'}")
    print(f"  pairs (wall): {', '.join(f'{100 * x:+.1f}%' for x in over_wall)}")
    write_json(result, args.out)
    print(f"({wall:.0f} s)")
    return result


if __name__ == "__main__":
    main()

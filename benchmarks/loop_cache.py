"""Why the trainer's cost per step depends on the model: Python code right after a torch step.

The trainer's own work per step is Python (its loop, counters, telemetry, hooks). This script
measures what that Python costs **hot** (run again and again with nothing in between) and
**right after a training step of a model** (a 4-layer MLP `W` wide, AdamW, on a model of its
own, timed apart and left out), the way it runs in a real loop, for two widths:

    python (N methods)  a fixed piece of plain Python: N calls to methods of N small objects
                        (the control: any Python, not the trainer's)
    trainer loop        the trainer's whole loop per step with a ``training_step`` that only
                        returns ``{"loss": <a constant tensor>}`` (no forward, backward or
                        update of its own): fetch, counters, telemetry, hooks, the loss's
                        bookkeeping, logging every 10 steps
    step API            what ``self.backward(loss)`` and ``self.step(optimizer)`` add to the
                        same calls made by hand (``loss.backward()``, ``optimizer.step()``,
                        ``optimizer.zero_grad()``): two trainer epochs whose ``training_step``
                        does one or the other on a 2-parameter model, the difference

Everything runs in one process, one thread, the variants in rotating order every round; times
are this thread's CPU time (`time.thread_time`), medians over rounds of 100 steps.
`benchmarks/overhead.py` (256 wide) and `benchmarks/step_cost.py` (16 wide) measure the
trainer's step beside a hand-written one; this script says how much of the difference between
their µs figures is the model's step evicting what the Python work needs (caches, branch
history) rather than more work.

    python benchmarks/loop_cache.py            # ~1 minute
    python benchmarks/loop_cache.py --smoke    # seconds (what CI runs)
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from dream_trainer import Callback, DeviceParameters, DreamTrainer, LoggingParameters, TrainerConfig, TrainingParameters

from common import machine, write_json  # noqa: E402  (benchmarks/common.py)
from overhead import build_model, make_batches, raw_step  # noqa: E402  (the same model and step)


def python_workload(n: int) -> Any:
    """A function making `n` calls to a method of `n` distinct small objects."""
    source = [f"class C{i}:\n    def __init__(self): self.a, self.b = 0, {i}\n"
              f"    def f(self, x):\n        self.a += x\n        return self.b\n" for i in range(n)]
    source.append("OBJS = [" + ", ".join(f"C{i}()" for i in range(n)) + "]")
    source.append("def run():\n    s = 0\n" + "".join(f"    s += OBJS[{i}].f(1)\n" for i in range(n)) + "    return s")
    namespace: dict[str, Any] = {}
    exec("\n".join(source), namespace)  # noqa: S102 - generated here, from constants
    return namespace["run"]


class EmptyStep(DreamTrainer):
    """A trainer whose step does no model work (`kind` "empty": only its loop runs), or a
    tiny model's step by hand ("by hand") or through the step API ("step API")."""

    kind = "empty"

    def __init__(self, config: TrainerConfig, batches: Any) -> None:
        super().__init__(config)
        self.batches, self.constant = batches, torch.tensor(1.0)
        self.x, self.y = torch.ones(2, 2), torch.ones(2, 1)

    def configure_models(self) -> None:
        self.model = torch.nn.Linear(2, 1)

    def init_weights(self) -> None: ...

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.0)

    def configure_dataloaders(self) -> tuple[Any, None]:
        return self.batches, None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        if self.kind == "empty":
            return {"loss": self.constant}
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        if self.kind == "step API":
            self.backward(loss)
            self.step(self.optimizer)
        else:
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return {"loss": loss}


KINDS = ("empty", "by hand", "step API")


class Between:
    """What runs before each measured step: nothing (hot) or a step of a `width`-wide model."""

    def __init__(self, widths: list[int], steps: int) -> None:
        self.models = {}
        for width in widths:
            model = build_model(width, 4)
            self.models[width] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3), make_batches(1, 32, width)[0])
        self.width: int | None = None
        self.steps = steps

    def __call__(self) -> float:
        """Run it; its CPU seconds (left out of the measured time)."""
        if self.width is None:
            return 0.0
        start = time.thread_time()
        model, opt, batch = self.models[self.width]
        raw_step(model, opt, batch)
        return time.thread_time() - start


class Loader:
    """The trainer's batches, each fetch preceded by `between` (its time kept apart)."""

    def __init__(self, between: Between, steps: int) -> None:
        self.between, self.steps, self.left_out = between, steps, 0.0

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Any:
        for i in range(self.steps):
            self.left_out += self.between()
            yield i


class Rounds(Callback[Any]):
    """Sets each epoch's variant (condition, step kind); times its epoch less what ran between
    its steps; after an "empty" epoch, runs the plain-Python control under the same condition."""

    def __init__(self, schedule: list[tuple[int | None, str]], between: Between, loader: Loader, control: Any) -> None:
        self.schedule, self.between, self.loader, self.control = schedule, between, loader, control
        self.trainer_us: dict[tuple[str, str], list[float]] = {}
        self.python_us: dict[str, list[float]] = {}
        self._start = 0.0

    def pre_train_epoch(self) -> None:
        self.between.width, self.trainer.kind = self.schedule[self.trainer.current_epoch]
        self.loader.left_out = 0.0
        self._start = time.thread_time()

    def post_train_epoch(self, result: dict[str, Any]) -> None:
        spent = time.thread_time() - self._start - self.loader.left_out
        name = label(self.between.width)
        self.trainer_us.setdefault((name, self.trainer.kind), []).append(spent / result["batches"] * 1e6)
        if self.trainer.kind != "empty":
            return
        total = 0.0
        for _ in range(self.between.steps):  # the control, under the same conditions
            self.between()
            start = time.thread_time()
            self.control()
            total += time.thread_time() - start
        self.python_us.setdefault(name, []).append(total / self.between.steps * 1e6)


def label(width: int | None) -> str:
    return "hot" if width is None else f"after a {width}-wide step"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps", type=int, default=100, help="steps per epoch")
    p.add_argument("--widths", type=int, nargs="+", default=[16, 256])
    p.add_argument("--methods", type=int, default=80, help="the plain-Python control's method calls")
    p.add_argument("--smoke", action="store_true", help="seconds: 2 rounds of 10 steps")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "loop_cache.json"))
    args = p.parse_args(argv)
    if args.smoke:
        args.rounds, args.steps = 2, 10
    torch.set_num_threads(1)
    torch.manual_seed(0)
    variants = [(width, kind) for width in (None, *args.widths) for kind in KINDS]
    schedule = list(variants)  # a warm-up round, left out
    for r in range(args.rounds):
        schedule += variants[r % len(variants):] + variants[: r % len(variants)]
    between = Between(args.widths, args.steps)
    loader = Loader(between, args.steps)
    rounds = Rounds(schedule, between, loader, python_workload(args.methods))
    config = TrainerConfig(
        root_dir=str(Path(args.out).parent / "runs"), device_parameters=DeviceParameters.SINGLE_DEVICE(),
        training_parameters=TrainingParameters(n_epochs=len(schedule), num_sanity_val_steps=0,
                                               validate_at_epoch_end=False),
        logging_parameters=LoggingParameters(log_every_n_steps=10), callbacks=[rounds],
    )
    EmptyStep(config, loader).fit()

    hot = label(None)
    rows: dict[str, dict[str, float]] = {}
    for name in [label(width) for width in (None, *args.widths)]:
        kept = {kind: rounds.trainer_us[(name, kind)][1:] for kind in KINDS}  # the warm-up round left out
        rows[name] = {"trainer_loop_us": statistics.median(kept["empty"]),
                      "python_us": statistics.median(rounds.python_us[name][1:]),
                      "step_api_us": statistics.median(a - b for a, b in zip(kept["step API"], kept["by hand"]))}
    print(f"\nPython right after a model's training step, {args.rounds} rounds x {args.steps} steps, 1 thread, "
          f"torch {torch.__version__}\n")
    print(f"{'':<24}{'trainer loop µs':>16}{'x hot':>7}{'step API µs':>13}{f'python ({args.methods} methods) µs':>28}"
          f"{'x hot':>7}")
    for name, row in rows.items():
        row["trainer_loop_x_hot"] = row["trainer_loop_us"] / rows[hot]["trainer_loop_us"]
        row["python_x_hot"] = row["python_us"] / rows[hot]["python_us"]
        print(f"{name:<24}{row['trainer_loop_us']:>16.1f}{row['trainer_loop_x_hot']:>7.2f}{row['step_api_us']:>13.1f}"
              f"{row['python_us']:>28.2f}{row['python_x_hot']:>7.2f}")
    print("\n  trainer loop: the trainer's loop per step with a training_step that does no model work; python:")
    print("  the same plain-Python calls every step. step API: what self.backward/self.step add to the same calls by")
    print("  hand (median over rounds of the difference). 'after a W-wide step': a training step of a 4-layer MLP W wide")
    print("  (AdamW, another model) ran just before, its time left out. Medians over rounds; this thread's CPU time.")
    result = {"rows": rows, "settings": vars(args), "machine": machine()}
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()

"""The framework's own cost per step, in µs, on a model too small to matter.

A 4-layer MLP 16 wide, batch 32 from a `DataLoader` over an in-memory `TensorDataset`, AdamW,
gradient clipping at 1.0, one thread. Framework variants, each a fresh model from the same
initial weights, a fresh optimizer and a loader over the same data:

    dream        a DreamTrainer doing the step in training_step (self.backward, self.step),
                 with its default logging (loss and learning rate every 50 steps)
    dream+20cb   the same with 20 callbacks that each override six per-step hooks with no-ops
    lightning    a LightningModule doing the same under lightning.Trainer (no logger, progress
                 bar, summary or checkpointing), when `lightning` is installed
    raw (A/A)    the hand-written loop against itself: the measurement's noise

Paired steps (`common.RawBeside`): each time a framework asks its loader for a batch, one
step of the hand-written loop (forward, backward, torch's clip_grad_norm_, step, zero_grad)
first runs on the run's own model and optimizer, with a batch from its own iterator over the
same data, timed on its own; the framework's time is the rest. The same tensors in the same
memory, one step right after the other, so drift and a busy machine hit both alike; times
are this thread's CPU time (`time.thread_time`). The cost of a variant is the median over
its epochs (the first of each run left out: warm-up) of (framework time / steps - raw time /
raw steps). Runs rotate their order over `--rounds` rounds; `--chunk 100` pairs whole epochs
instead (the framework's code and the raw loop's then each run 100 steps in a row: no
sharing of caches between them, a wider spread).

    python benchmarks/step_cost.py            # ~2 minutes
    python benchmarks/step_cost.py --smoke    # seconds (what CI runs)
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import Callback, DeviceParameters, TrainerConfig, TrainingParameters

from common import RawBeside, machine, write_json  # noqa: E402  (benchmarks/common.py)
from overhead import BenchTrainer, NoOp, build_model  # noqa: E402  (the same model, trainer and no-op callback)

TARGETS_US = {"dream": 20.0, "dream+20cb": 25.0}


CLIP: float | None = 1.0  # --no-clip: None, in the loop and in the trainers alike
CHUNK = 1


def raw_step(model: nn.Module, opt: torch.optim.Optimizer, params: list[torch.Tensor], batch: Any) -> None:
    """One step of the hand-written loop."""
    x, y = batch
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    if CLIP is not None:
        torch.nn.utils.clip_grad_norm_(params, CLIP)
    opt.step()
    opt.zero_grad(set_to_none=True)


class Paired:
    """A run's data: a `DataLoader` whose every fetch has a raw step beside it (`RawBeside`),
    on the model and optimizer `target()` returns (resolved at the first step); per epoch,
    (raw seconds per step, framework seconds per step)."""

    def __init__(self, data: tuple[torch.Tensor, torch.Tensor], batch: int, steps: int) -> None:
        self.target: Any = None
        self._step: Any = None
        self.raw = RawBeside(self._raw_step, CHUNK)
        self.loader = self.raw.loader(DataLoader(TensorDataset(*data), batch_size=batch, shuffle=False))
        self.steps, self.pairs = steps, []
        self._start = self.raw.mark()

    def _raw_step(self, batch: Any) -> None:
        if self._step is None:
            model, opt = self.target()
            params = list(model.parameters())
            self._step = lambda b: raw_step(model, opt, params, b)
        self._step(batch)

    def start(self) -> None:
        self._start = self.raw.mark()

    def end(self) -> None:
        w = self.raw.window(self._start, self.steps)
        self.pairs.append((w["raw"], w["framework"]))


class EpochPairs(Callback[Any]):
    """Marks the trainer's epochs (overrides only pre_train_epoch and post_epoch: no per-step
    cost; a post_train_epoch reader would make the trainer keep the epoch's mean loss)."""

    def __init__(self, paired: Paired) -> None:
        self.paired = paired

    def pre_train_epoch(self) -> None:
        self.paired.start()

    def post_epoch(self) -> None:
        self.paired.end()


def dream_run(init: dict[str, torch.Tensor], data: Any, args: argparse.Namespace, callbacks: int,
              root: str) -> list[tuple[float, float]]:
    paired = Paired(data, args.batch_size, args.steps)
    config = TrainerConfig(
        root_dir=root, device_parameters=DeviceParameters.SINGLE_DEVICE(),
        training_parameters=TrainingParameters(n_epochs=args.epochs, num_sanity_val_steps=0,
                                               validate_at_epoch_end=False, gradient_clip_val=CLIP),
        callbacks=[EpochPairs(paired), *(NoOp() for _ in range(callbacks))],
    )
    trainer = BenchTrainer(config, init, paired.loader, args)  # overhead.py's trainer
    paired.target = lambda: (trainer.model, trainer.optimizer)
    trainer.fit()
    return paired.pairs


def raw_run(init: dict[str, torch.Tensor], data: Any, args: argparse.Namespace) -> list[tuple[float, float]]:
    """The A/A control: the hand-written loop, iterating the same paired loader."""
    model = build_model(args.width, args.depth)
    model.load_state_dict(init)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    paired = Paired(data, args.batch_size, args.steps)
    paired.target = lambda: (model, opt)
    params = list(model.parameters())
    for _ in range(args.epochs):
        paired.start()
        for batch in paired.loader:
            raw_step(model, opt, params, batch)
        paired.end()
    return paired.pairs


def lightning_run(init: dict[str, torch.Tensor], data: Any, args: argparse.Namespace,
                  root: str) -> list[tuple[float, float]]:
    import lightning as L

    paired = Paired(data, args.batch_size, args.steps)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_model(args.width, args.depth)
            self.model.load_state_dict(init)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.model(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
            paired.target = lambda: (self.model, opt)
            return opt

    class Pairs(L.Callback):
        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            paired.start()

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            paired.end()

    trainer = L.Trainer(max_epochs=args.epochs, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, gradient_clip_val=CLIP,
                        num_sanity_val_steps=0, callbacks=[Pairs()], default_root_dir=root)
    trainer.fit(Module(), paired.loader)
    return paired.pairs


def lightning_available() -> bool:
    try:
        import lightning  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=100, help="steps per epoch")
    p.add_argument("--epochs", type=int, default=21, help="epochs per run (the first is warm-up)")
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--depth", type=int, default=4, help="Linear layers")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--no-lightning", action="store_true", help="leave Lightning out even when it is installed")
    p.add_argument("--chunk", type=int, default=1, help="raw steps run together, then as many framework steps")
    p.add_argument("--no-clip", action="store_true", help="no gradient clipping, in the loop and the trainers")
    p.add_argument("--smoke", action="store_true", help="seconds: 1 round of 3 epochs of 10 steps")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "step_cost.json"))
    args = p.parse_args(argv)
    if args.smoke:
        args.rounds, args.steps, args.epochs = 1, 10, 3
    global CLIP, CHUNK
    CLIP = None if args.no_clip else 1.0
    CHUNK = args.chunk
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "dream_trainer"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    init = {k: v.clone() for k, v in build_model(args.width, args.depth).state_dict().items()}
    g = torch.Generator().manual_seed(1)
    n = args.steps * args.batch_size
    data = (torch.randn(n, args.width, generator=g), torch.randn(n, 1, generator=g))
    variants = ["raw (A/A)", "dream", "dream+20cb"]
    with_lightning = lightning_available() and not args.no_lightning
    if with_lightning:
        variants.append("lightning")
    pairs: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="step_cost_") as root:
        for r in range(args.rounds):
            for v in variants[r % len(variants):] + variants[: r % len(variants)]:
                if v == "raw (A/A)":
                    run = raw_run(init, data, args)
                elif v == "lightning":
                    run = lightning_run(init, data, args, root)
                else:
                    run = dream_run(init, data, args, 20 if v == "dream+20cb" else 0, root)
                pairs[v] += run[1:]  # the first epoch of a run: warm-up
    wall = time.perf_counter() - start
    rows = _table(variants, pairs, args)
    if not with_lightning:
        why = "--no-lightning" if args.no_lightning else "not installed here; pip install lightning to add it"
        print(f"\n  lightning: not measured ({why})")
    result = {"variants": rows, "settings": vars(args), "machine": machine(), "wall_s": wall,
              "lightning": _lightning_version() if with_lightning else None}
    write_json(result, args.out)
    return result


def _table(variants: list[str], pairs: dict[str, list[tuple[float, float]]], args: argparse.Namespace) -> dict[str, Any]:
    print(f"\nthe framework's cost per step: {args.depth}-layer MLP {args.width} wide, batch {args.batch_size} from a "
          f"DataLoader, AdamW, {'no clipping' if CLIP is None else f'clipping {CLIP}'}, 1 thread; {args.rounds} round(s) of {args.epochs} epochs x {args.steps} "
          f"steps, each step paired with a raw one; torch {torch.__version__}\n")
    head = f"{'variant':<12}{'raw µs':>9}{'µs/step':>10}{'cost µs':>10}{'IQR µs':>9}{'ratio':>8}{'target':>10}  met"
    print(head)
    print("-" * len(head))
    rows = {}
    for v in variants:
        costs = sorted((framework - raw) * 1e6 for raw, framework in pairs[v])
        cost = statistics.median(costs)
        q = statistics.quantiles(costs, n=4) if len(costs) >= 2 else [cost, cost, cost]
        target = TARGETS_US.get(v)
        met = None if target is None else cost <= target
        rows[v] = {"raw_step_us": statistics.median(raw for raw, _ in pairs[v]) * 1e6,
                   "step_us": statistics.median(f for _, f in pairs[v]) * 1e6, "cost_us": cost,
                   "cost_iqr_us": q[2] - q[0], "ratio": statistics.median(f / raw for raw, f in pairs[v]),
                   "target_us": target, "met": met, "epochs": len(costs), "costs_us": costs}
        r = rows[v]
        print(f"{v:<12}{r['raw_step_us']:>9.1f}{r['step_us']:>10.1f}{cost:>10.1f}{r['cost_iqr_us']:>9.1f}"
              f"{r['ratio']:>8.3f}{'' if target is None else f'<= {target:.0f}':>10}  "
              f"{'' if met is None else ('yes' if met else 'NO')}")
    print(f"\n  cost = median over epochs of (framework µs/step - raw µs/step), each framework step paired with a raw\n"
          f"  step run just before it on the same model and optimizer ({args.chunk} at a time); IQR: its interquartile\n"
          "  range; ratio = median of (framework / raw). raw (A/A): the raw loop against itself (the noise floor).\n"
          "  This thread's CPU time.")
    return rows


def _lightning_version() -> str:
    import lightning

    return str(lightning.__version__)


if __name__ == "__main__":
    main()

"""Eager vs torch.compile on the demo GPT (examples/gpt): tokens/s and compile time, by how the
model is compiled.

For each model size, the demo's `GPTTrainer` trains one rank, one process per size, the
strategies one after the other in that process (dynamo reset between them) and in an order
that rotates every round:

    eager               no compile
    demo                the demo's own ``apply_compile`` (the whole model as one region on one
                        device, its embeddings eager, as CUDA graphs on a GPU; each block on
                        its own when the model is sharded or split)
    demo-nographs       the same without CUDA graphs (what the demo did before)
    blocks              each transformer block compiled on its own (torchtitan's way; what the
                        demo did before)
    model               the whole GPT as one compiled region, embeddings included
    model-cudagraphs    the same with mode="reduce-overhead" (CUDA graphs; CUDA only)

Sizes (n_layer, n_head, d_model; precision): on CUDA ``demo`` (the demo's shape, float32 as
the demo runs by default), ``demo-bf16``, ``wide-bf16`` (4, 8, 256) and ``large-bf16``
(12, 12, 768, GPT-2 small's blocks) with bf16 autocast, batch 64 x 256 tokens; on a CPU
``small``, ``demo`` and ``wide`` in float32, batch 16 x 64.

The step time is a window of steps after warm-up, cut in `--parts` windows, the device
synchronized only at their edges; compile s is the first step (synchronized) minus a steady step, from the first round
(a cold inductor cache; later rounds reuse it). The table gives medians over rounds, the
speedup over eager of the same size, round and window, and the spread of that speedup.

    python benchmarks/compile.py             # every size, eager/demo/blocks/model, 2 rounds
    python benchmarks/compile.py --sizes large-bf16 --strategies eager,demo --profile   # and where the time goes
    python benchmarks/compile.py --smoke     # seconds: small size, eager and demo, few steps (what CI runs)
"""

from __future__ import annotations

import argparse
import dataclasses
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

from dream_trainer import LoggingParameters, TrainerConfig, TrainingParameters  # noqa: E402
from dream_trainer.callbacks.step_window import StepWindowCallback  # noqa: E402
from dream_trainer.testing import spawn_world  # noqa: E402

from common import PROFILED_STEPS, device_name, machine, profile_table, spread, step_profiler, verdict, write_json  # noqa: E402,E501

SIZES = {  # name -> (n_layer, n_head, d_model, autocast dtype or None)
    "small": (2, 2, 64, None), "demo": (4, 4, 128, None), "wide": (4, 8, 256, None),
    "demo-bf16": (4, 4, 128, "bfloat16"), "wide-bf16": (4, 8, 256, "bfloat16"), "large-bf16": (12, 12, 768, "bfloat16"),
}
DEFAULT_SIZES = {"cuda": "demo,demo-bf16,wide-bf16,large-bf16", "cpu": "small,demo,wide"}
STRATEGIES = ("eager", "demo", "demo-nographs", "blocks", "model", "model-cudagraphs")
DEFAULT_STRATEGIES = "eager,demo,blocks,model"


class StrategyTrainer(GPTTrainer):
    """The demo trainer, compiled the benchmark's way."""

    strategy = "demo"

    def apply_compile(self) -> None:
        if self.strategy in ("demo", "demo-nographs"):  # the config's cuda_graphs tells them apart
            super().apply_compile()
        elif self.strategy == "blocks":
            for block in self.model.blocks:
                self.compile_module(block)
        elif self.strategy == "model":
            self.compile_module(self.model)
        elif self.strategy == "model-cudagraphs":
            self.compile_module(self.model, mode="reduce-overhead")


def _one(size: str, strategy: str, opts: dict[str, Any]) -> dict[str, Any]:
    n_layer, n_head, d_model, dtype = SIZES[size]
    batch, block, steps, warmup = opts["batch_size"], opts["block_size"], opts["steps"], opts["warmup"]
    total = warmup + steps
    profiled = PROFILED_STEPS if opts.get("profile") else 0
    with tempfile.TemporaryDirectory(prefix="compile_run_") as root:
        args = parse_args(["--steps", str(total), "--batch-size", str(batch), "--block-size", str(block),
                           "--n-layer", str(n_layer), "--n-head", str(n_head), "--d-model", str(d_model),
                           "--n-chars", str(int((total + 2) * (batch * block + batch) / 0.9)),
                           "--data-dir", os.path.join(opts["cache"], f"data_{size}")])
        timer = StepWindowCallback(warmup, parts=opts["parts"], last=total)
        callbacks: list[Any] = [timer]
        profiler = step_profiler(total, root) if profiled else None  # after the timed window
        if profiler:
            callbacks.append(profiler)
        StrategyTrainer.strategy = strategy
        config = TrainerConfig(
            experiment="compile", root_dir=root, seed=0,
            device_parameters=PARALLEL["single"](device=opts["device"], compile_model=strategy != "eager",
                                                 autocast_dtype=getattr(torch, dtype) if dtype else None),
            training_parameters=TrainingParameters(n_epochs=None, max_steps=total + profiled, val_every_n_steps=None,
                                                   validate_at_epoch_end=False, num_sanity_val_steps=0,
                                                   global_batch_size=batch, gradient_clip_val=1.0),  # the demo's
            logging_parameters=LoggingParameters(log_every_n_steps=10**9, log_lr=False),
            callbacks=callbacks,
        )
        trainer = StrategyTrainer(dataclasses.replace(demo_config(config, args), cuda_graphs=strategy != "demo-nographs"))
        start = time.perf_counter()
        try:
            trainer.fit()
        except Exception as exc:  # noqa: BLE001 - a strategy that does not work here is a result
            return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
        assert timer.step_s is not None and timer.first_step_s is not None
        return {"profile": profile_table(profiler), "step_s": timer.step_s, "part_step_s": timer.part_step_s,
                "first_step_s": timer.first_step_s,
                "compile_s": max(0.0, timer.first_step_s - timer.step_s), "tokens_per_s": batch * block / timer.step_s,
                "wall_s": time.perf_counter() - start, "params": sum(p.numel() for p in trainer.model.parameters()),
                "regions": list(trainer.compiled_modules)}


def run_size(size: str, order: list[str], opts: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every strategy of one size, in `order`, in this (fresh) process."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(opts["cache"], "inductor")
    torch.set_num_threads(os.cpu_count() or 1)
    out = {}
    for strategy in order:
        torch._dynamo.reset()  # no strategy reuses another's compiled code
        out[strategy] = _one(size, strategy, opts)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5, help="steps before the timed window (the first compiles)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--parts", type=int, default=3, help="the timed steps as this many windows (the spread within a run)")
    p.add_argument("--batch-size", type=int, default=None, help="default: 64 on CUDA, 16 on CPU")
    p.add_argument("--block-size", type=int, default=None, help="default: 256 on CUDA, 64 on CPU")
    p.add_argument("--sizes", default=None, help=f"comma-separated, from {list(SIZES)} (default: {DEFAULT_SIZES})")
    p.add_argument("--strategies", default=DEFAULT_STRATEGIES, help=f"comma-separated, from {list(STRATEGIES)}")
    p.add_argument("--profile", action="store_true", help="after each run's timed window, profile 3 steps: the ops "
                   "table (by device time on CUDA) goes into the JSON and <out>.profile.txt")
    p.add_argument("--smoke", action="store_true", help="seconds: small size, eager and demo, 1 round, 3 steps")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "compile.json"))
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args.sizes = args.sizes or DEFAULT_SIZES[device]
    args.batch_size = args.batch_size or (64 if device == "cuda" else 16)
    args.block_size = args.block_size or (256 if device == "cuda" else 64)
    if args.smoke:
        args.sizes, args.strategies, args.rounds, args.steps, args.warmup, args.parts = "small", "eager,demo", 1, 3, 1, 1
        args.batch_size, args.block_size = 4, 32
    sizes, strategies = args.sizes.split(","), args.strategies.split(",")
    for name, given, allowed in (("--sizes", sizes, list(SIZES)), ("--strategies", strategies, list(STRATEGIES))):
        bad = [x for x in given if x not in allowed]
        if bad:
            p.error(f"{name}: {bad} not in {allowed}")
    if "eager" not in strategies:
        p.error("--strategies: the speedups are against 'eager', which must be one of them")
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {(s, m): [] for s in sizes for m in strategies}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="compile_bench_") as cache:
        opts = {"device": device, "batch_size": args.batch_size, "block_size": args.block_size, "steps": args.steps,
                "warmup": args.warmup, "parts": args.parts, "profile": args.profile, "cache": cache}
        for r in range(args.rounds):
            order = strategies[r % len(strategies):] + strategies[: r % len(strategies)]
            for size in sizes:
                (out,) = spawn_world(1, run_size, size, order, opts, timeout=1800)
                for strategy in order:
                    runs[(size, strategy)].append(out[strategy])
                    x = out[strategy]
                    shown = x.get("error") or f"{x['tokens_per_s']:,.0f} tokens/s, first step {x['first_step_s']:.1f} s"
                    print(f"  round {r + 1}/{args.rounds} {size:<11} {strategy:<17} {shown}", flush=True)
    wall = time.perf_counter() - start
    rows = _table(sizes, strategies, runs, device, args)
    result = {"rows": rows, "settings": vars(args), "device": device, "device_name": device_name(device),
              "wall_s": wall, "machine": machine()}
    write_json(result, args.out)
    if args.profile:  # the ops tables side by side, for reading
        text = "\n\n".join(f"=== {row['size']} {row['strategy']} (round 1)\n{row['runs'][0].get('profile')}"
                           for row in rows if "runs" in row)
        Path(args.out).with_suffix(".profile.txt").write_text(text)
    print(f"({wall:.0f} s)")
    return result


def _table(sizes: list[str], strategies: list[str], runs: dict[tuple[str, str], list[dict[str, Any]]], device: str,
           args: argparse.Namespace) -> list[dict[str, Any]]:
    print(f"\ndemo GPT on {device_name(device)}, batch {args.batch_size} x {args.block_size} tokens, {args.steps} timed "
          f"steps after {args.warmup}, {args.rounds} round(s); torch {torch.__version__}\n")
    head = (f"{'size':<12}{'params':>12}{'strategy':>18}{'tokens/s':>12}{'vs eager':>10}{'spread':>8}{'ms/step':>9}"
            f"{'compile s':>11}  verdict")
    print(head)
    print("-" * len(head))
    rows = []
    for size in sizes:
        eager = runs[(size, "eager")]
        for strategy in strategies:
            xs = runs[(size, strategy)]
            ok = [x for x in xs if "error" not in x]
            if not ok:
                rows.append({"size": size, "strategy": strategy, "error": xs[0]["error"]})
                print(f"{size:<12}{'':>12}{strategy:>18}   failed: {xs[0]['error']}")
                continue
            ratios = [pe / px for x, e in zip(xs, eager) if "error" not in x and "error" not in e
                      for px, pe in zip(x["part_step_s"], e["part_step_s"])]
            row = {"size": size, "shape": SIZES[size], "strategy": strategy, "params": ok[0]["params"],
                   "regions": ok[0]["regions"], "tokens_per_s": statistics.median(x["tokens_per_s"] for x in ok),
                   "vs_eager": statistics.median(ratios) if ratios else None, "vs_eager_rounds": ratios,
                   "vs_eager_spread": spread(ratios), "verdict": verdict(ratios) if strategy != "eager" else None,
                   "step_ms": statistics.median(x["step_s"] for x in ok) * 1e3,
                   "compile_s": ok[0]["compile_s"], "runs": xs}
            rows.append(row)
            vs = f"{row['vs_eager']:.2f}x" if row["vs_eager"] is not None else "-"
            compile_s = f"{row['compile_s']:.1f}" if strategy != "eager" else "-"
            print(f"{size:<12}{row['params']:>12,}{strategy:>18}{row['tokens_per_s']:>12,.0f}{vs:>10}"
                  f"{100 * row['vs_eager_spread']:>7.0f}%{row['step_ms']:>9.2f}{compile_s:>11}  {row['verdict'] or ''}")
    print("\n  vs eager: median over rounds and windows of (strategy / eager, the same size, round and window);\n"
          "  spread: (max - min) / median of those ratios. compile s: the first round's first step minus a steady\n"
          "  step (cold cache).")
    return rows


if __name__ == "__main__":
    main()

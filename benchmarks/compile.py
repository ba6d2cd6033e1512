"""Eager vs torch.compile on the demo GPT (examples/gpt): tokens/s and compile time.

For each model size, the demo's `GPTTrainer` trains in a fresh process, one rank, with:

    eager                       no compile
    compile                     each block ``torch.compile``d with the default mode (inductor)
    max-autotune-no-cudagraphs  the same with mode="max-autotune-no-cudagraphs" (autotuned
                                kernels, no CUDA graphs); where it fails, the row says why

Each run has a fresh inductor cache directory, so compile time is a cold compile. A timing
callback reads ``trainer.step_stats.step_time_s``: compile time = the first step's time
minus the median of the timed steps (the first step compiles forward and backward);
tokens/s = tokens per step / that median. Rounds interleave the modes (the machine is
noisy); the table gives medians over rounds and the speedup over eager of the same size.

    python benchmarks/compile.py            # 3 sizes x 3 modes x 2 rounds: ~10 minutes on 2 CPU cores
    python benchmarks/compile.py --quick    # demo size, eager and compile, 1 round: ~1.5 minutes
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

from dream_trainer import LoggingParameters, TrainerConfig, TrainingParameters  # noqa: E402
from dream_trainer.testing import spawn_world  # noqa: E402

from common import StepTimes, machine, write_json  # noqa: E402  (benchmarks/common.py)

SIZES = {"small": (2, 2, 64), "demo": (4, 4, 128), "wide": (4, 8, 256)}  # n_layer, n_head, d_model
MODES = ("eager", "compile", "max-autotune-no-cudagraphs")


class ModeTrainer(GPTTrainer):
    """The demo trainer, compiling each block with the benchmark's mode."""

    mode: str | None = None

    def apply_compile(self) -> None:
        for block in self.model.blocks:
            self.compile_module(block, **({} if self.mode in (None, "compile") else {"mode": self.mode}))


def run(size: str, mode: str, steps: int, batch_size: int, block_size: int, device: str) -> dict[str, Any]:
    """One run in its own process (spawn_world(1, ...)) with a cold inductor cache."""
    n_layer, n_head, d_model = SIZES[size]
    with tempfile.TemporaryDirectory(prefix="inductor_") as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        torch.set_num_threads(os.cpu_count() or 1)
        args = parse_args(["--steps", str(steps), "--batch-size", str(batch_size), "--block-size", str(block_size),
                           "--n-layer", str(n_layer), "--n-head", str(n_head), "--d-model", str(d_model),
                           "--n-chars", str(int((steps + 2) * (batch_size * block_size + batch_size) / 0.9))])
        timer = StepTimes()
        ModeTrainer.mode = None if mode == "eager" else mode
        config = TrainerConfig(
            experiment="compile", root_dir=cache, seed=0,
            device_parameters=PARALLEL["single"](device=device, compile_model=mode != "eager"),
            training_parameters=TrainingParameters(n_epochs=None, max_steps=steps, val_every_n_steps=None,
                                                   validate_at_epoch_end=False, num_sanity_val_steps=0),
            logging_parameters=LoggingParameters(log_every_n_steps=10**9, log_lr=False),
            callbacks=[timer],
        )
        trainer = ModeTrainer(demo_config(config, args))
        start = time.perf_counter()
        try:
            trainer.fit()
        except Exception as exc:  # noqa: BLE001 - a mode that does not work here is a result
            return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
        timed = sorted(timer.times[2:])
        median = statistics.median(timed)
        return {"median_step_s": median, "first_step_s": timer.times[0], "compile_s": max(0.0, timer.times[0] - median),
                "tokens_per_s": batch_size * block_size / median, "wall_s": time.perf_counter() - start,
                "params": sum(p.numel() for p in trainer.model.parameters()), "regions": len(trainer.compiled_modules)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run (the first 2 are not timed)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, from {list(SIZES)}")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {list(MODES)}")
    p.add_argument("--quick", action="store_true", help="demo size, eager and compile, 1 round, 10 steps")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "compile.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.modes, args.rounds, args.steps = "demo", "eager,compile", 1, 10
    sizes, modes = args.sizes.split(","), args.modes.split(",")
    for name in sizes:
        if name not in SIZES:
            p.error(f"--sizes: {name!r} is not one of {list(SIZES)}")
    for name in modes:
        if name not in MODES:
            p.error(f"--modes: {name!r} is not one of {list(MODES)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {(s, m): [] for s in sizes for m in modes}
    start = time.perf_counter()
    for r in range(args.rounds):
        for size in sizes:
            order = modes[r % len(modes):] + modes[: r % len(modes)]
            for mode in order:
                (out,) = spawn_world(1, run, size, mode, args.steps, args.batch_size, args.block_size, device, timeout=1200)
                runs[(size, mode)].append(out)
                shown = out.get("error") or f"{out['tokens_per_s']:,.0f} tokens/s, compile {out['compile_s']:.1f} s"
                print(f"  round {r + 1}/{args.rounds} {size:<6} {mode:<27} {shown}", flush=True)
    wall = time.perf_counter() - start

    print(f"\ndemo GPT on {device}, batch {args.batch_size} x {args.block_size} tokens, {args.steps} steps per run "
          f"(first 2 untimed), {args.rounds} round(s); torch {torch.__version__}, {os.cpu_count()} CPU cores\n")
    head = f"{'size':<7}{'params':>10}{'mode':>29}{'tokens/s':>11}{'vs eager':>10}{'ms/step':>9}{'compile s':>11}"
    print(head)
    print("-" * len(head))
    rows = []
    for size in sizes:
        eager = [x for x in runs[(size, "eager")] if "error" not in x] if "eager" in modes else []
        eager_tps = statistics.median(x["tokens_per_s"] for x in eager) if eager else None
        for mode in modes:
            ok = [x for x in runs[(size, mode)] if "error" not in x]
            if not ok:
                error = runs[(size, mode)][0]["error"]
                rows.append({"size": size, "mode": mode, "error": error})
                print(f"{size:<7}{'':>10}{mode:>29}   failed: {error}")
                continue
            tps = statistics.median(x["tokens_per_s"] for x in ok)
            row = {"size": size, "mode": mode, "params": ok[0]["params"], "tokens_per_s": tps,
                   "speedup_vs_eager": tps / eager_tps if eager_tps else None,
                   "median_step_ms": statistics.median(x["median_step_s"] for x in ok) * 1e3,
                   "compile_s": statistics.median(x["compile_s"] for x in ok), "runs": ok}
            rows.append(row)
            speed = f"{row['speedup_vs_eager']:.2f}x" if row["speedup_vs_eager"] else "-"
            compile_s = f"{row['compile_s']:.1f}" if mode != "eager" else "-"
            print(f"{size:<7}{row['params']:>10,}{mode:>29}{tps:>11,.0f}{speed:>10}{row['median_step_ms']:>9.1f}{compile_s:>11}")
    print("\n  compile s = first step - median step (cold inductor cache); tokens/s and ms/step from the median\n"
          "  timed step. On CPU, inductor generates C++ (OpenMP) kernels; on a GPU, Triton kernels.")
    result = {"rows": rows, "settings": vars(args), "device": device, "wall_s": wall, "machine": machine()}
    write_json(result, args.out)
    print(f"({wall:.0f} s)")
    return result


if __name__ == "__main__":
    main()

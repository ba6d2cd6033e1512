"""Float8 training (torchao, `Fp8QuantizationCallback`) against bfloat16: tokens/s and peak memory.

Two models, each trained one rank on the whole machine, in a fresh process per run:

    gpt   the demo GPT (examples/gpt): 4 blocks, d_model 128 (linears 128x128 .. 128x512)
    mlp   a linear-heavy model: 4 x Linear(width, width) on token rows (a transformer's MLP share);
          width = tokens = 1024 on CUDA, 512 on CPU

Variants: ``fp32``; ``bf16`` (autocast bfloat16); ``fp8-tensorwise`` and ``fp8-rowwise``
(bf16 autocast with the linears in float8), each eager and, with ``--compile``, compiled.
tokens/s from the median timed step; peak memory from the device (CUDA) or the process's
peak resident set (CPU). The ratio column is against bf16 of the same model and mode.

On a CPU (or a GPU before SM89) there is no float8 matmul: `Fp8QuantizationCallback` has torchao
emulate it (``emulate=True``: casts, scales and a float32 matmul), so float8 is SLOWER there;
the script says so. The speedup is a property of H100/H200-class GPUs (torchtitan reports
~1.28x over bf16 + compile on Llama-3 8B).

    python benchmarks/fp8.py                # both models, eager and compiled, 2 rounds: ~10 minutes on 2 CPU cores
    python benchmarks/fp8.py --quick        # both models, eager only, 1 round: ~1.5 minutes
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))

from train import PARALLEL, GPTTrainer, demo_config, parse_args  # noqa: E402

from dream_trainer import DreamTrainer, LoggingParameters, TrainerConfig, TrainingParameters  # noqa: E402
from dream_trainer.callbacks.fp8 import float8_hardware  # noqa: E402
from dream_trainer.testing import spawn_world  # noqa: E402

from common import StepTimes, machine, write_json  # noqa: E402  (benchmarks/common.py)

VARIANTS = ("fp32", "bf16", "fp8-tensorwise", "fp8-rowwise")


class LinearHeavy(DreamTrainer):
    """4 x Linear(width, width) with GELU on rows of `tokens` tokens: the shape of a
    transformer's MLP work, nothing else."""

    def __init__(self, config: TrainerConfig, width: int, tokens: int, steps: int):
        super().__init__(config)
        self.width, self.tokens, self.steps = width, tokens, steps

    def configure_models(self) -> None:
        layers: list[nn.Module] = []
        for _ in range(4):
            layers += [nn.Linear(self.width, self.width), nn.GELU()]
        self.model = nn.Sequential(*layers)

    def apply_compile(self) -> None:
        self.compile_module(self.model)

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def configure_dataloaders(self) -> tuple[Any, None]:
        g = torch.Generator().manual_seed(0)
        return [torch.randn(self.tokens, self.width, generator=g) for _ in range(self.steps)], None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        loss = self.model(batch).float().pow(2).mean()
        self.backward(loss)
        self.step(self.optimizer)
        return {"loss": loss}

    def count_batch(self, batch: Any) -> tuple[int, int | None]:
        return 1, int(batch.shape[0])  # one sample of `tokens` token rows


def run(model: str, variant: str, compiled: bool, opts: dict[str, Any]) -> dict[str, Any]:
    """One run, in its own process."""
    from dream_trainer.callbacks import Fp8QuantizationCallback

    device = opts["device"]
    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(prefix="fp8_") as root:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = root
        params = PARALLEL["single"](device=device, compile_model=compiled,
                                    autocast_dtype=None if variant == "fp32" else torch.bfloat16)
        timer = StepTimes()
        callbacks: list[Any] = [timer]
        if variant.startswith("fp8"):
            logging.getLogger("dream_trainer.callbacks.fp8").setLevel(logging.ERROR)  # the table says "EMULATED" once
            callbacks.append(Fp8QuantizationCallback(variant.split("-")[1], display=False))
        steps = opts["warmup"] + opts["steps"]
        config = TrainerConfig(
            experiment="fp8", root_dir=root, seed=0, device_parameters=params,
            training_parameters=TrainingParameters(n_epochs=None, max_steps=steps, val_every_n_steps=None,
                                                   validate_at_epoch_end=False, num_sanity_val_steps=0),
            logging_parameters=LoggingParameters(log_every_n_steps=10**9, log_lr=False), callbacks=callbacks,
        )
        if model == "gpt":
            args = parse_args(["--steps", str(steps), "--batch-size", "16",
                               "--n-chars", str(int((steps + 2) * (16 * 64 + 16) / 0.9))])
            trainer: Any = GPTTrainer(demo_config(config, args))
            tokens = 16 * 64
        else:
            trainer = LinearHeavy(config, width=opts["width"], tokens=opts["tokens"], steps=steps)
            tokens = opts["tokens"]
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        trainer.fit()
        median = statistics.median(timer.times[opts["warmup"]:])
        if device == "cuda":
            peak = torch.cuda.max_memory_allocated() / 2**20
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
        converted = len(callbacks[1].converted.get("model", [])) if len(callbacks) > 1 else 0
        return {"tokens_per_s": tokens / median, "median_step_ms": median * 1e3, "peak_mb": peak,
                "converted_linears": converted, "first_step_s": timer.times[0]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--width", type=int, default=None, help="the mlp model's width (default: 1024 on CUDA, 512 on CPU)")
    p.add_argument("--tokens", type=int, default=None, help="the mlp model's token rows per step (as --width)")
    p.add_argument("--no-compile", action="store_true", help="eager only")
    p.add_argument("--quick", action="store_true", help="eager only, 1 round, 6 timed steps")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "fp8.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.no_compile = 1, 6, True
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hardware = float8_hardware(device)  # the callback's own decision: native float8 matmuls, or emulated
    native = hardware.native
    default = 1024 if device == "cuda" else 512  # bf16 matmuls are slow on CPUs without bf16 units
    args.width, args.tokens = args.width or default, args.tokens or default
    opts = {"device": device, "steps": args.steps, "warmup": args.warmup, "width": args.width, "tokens": args.tokens}
    modes = [False] if args.no_compile else [False, True]
    keys = [(m, v, c) for m in ("gpt", "mlp") for c in modes for v in VARIANTS]
    runs: dict[tuple[str, str, bool], list[dict[str, Any]]] = {k: [] for k in keys}
    start = time.perf_counter()
    for r in range(args.rounds):
        for key in keys[r % len(keys):] + keys[: r % len(keys)]:
            model, variant, compiled = key
            (out,) = spawn_world(1, run, model, variant, compiled, opts, timeout=1200)
            runs[key].append(out)
            print(f"  round {r + 1}/{args.rounds} {model} {variant:<15} {'compiled' if compiled else 'eager':<9}"
                  f"{out['tokens_per_s']:>11,.0f} tokens/s {out['peak_mb']:>8,.0f} MiB", flush=True)
    wall = time.perf_counter() - start
    print(f"\nfloat8 vs bf16 on {hardware.name} ({'native float8' if native else 'float8 EMULATED: no float8 matmul here'}), "
          f"{args.steps} timed steps, {args.rounds} round(s); torch {torch.__version__}\n")
    head = (f"{'model':<6}{'mode':<10}{'variant':<16}{'linears':>8}{'tokens/s':>11}{'vs bf16':>9}{'vs fp32':>9}"
            f"{'ms/step':>9}{'peak MiB':>10}")
    print(head)
    print("-" * len(head))
    rows = []
    for model, variant, compiled in keys:
        xs = runs[(model, variant, compiled)]
        bf16 = statistics.median(x["tokens_per_s"] for x in runs[(model, "bf16", compiled)])
        fp32 = statistics.median(x["tokens_per_s"] for x in runs[(model, "fp32", compiled)])
        tps = statistics.median(x["tokens_per_s"] for x in xs)
        row = {"model": model, "variant": variant, "compiled": compiled, "tokens_per_s": tps, "vs_bf16": tps / bf16,
               "vs_fp32": tps / fp32,
               "median_step_ms": statistics.median(x["median_step_ms"] for x in xs),
               "peak_mb": statistics.median(x["peak_mb"] for x in xs), "converted_linears": xs[0]["converted_linears"],
               "runs": xs}
        rows.append(row)
        print(f"{model:<6}{'compiled' if compiled else 'eager':<10}{variant:<16}{row['converted_linears']:>8}{tps:>11,.0f}"
              f"{row['vs_bf16']:>9.2f}{row['vs_fp32']:>9.2f}{row['median_step_ms']:>9.1f}{row['peak_mb']:>10,.0f}")
    if not native:
        print("\n  No native float8 here: torchao emulates the float8 matmuls, so float8 costs time instead of\n"
              "  saving it. This table measures the emulation's cost and checks that float8 training runs;\n"
              "  the speedup needs an SM89+ GPU (H100/H200/Ada).")
    print("  peak MiB: device memory on CUDA; the process's peak resident set on CPU (includes torch itself).")
    result = {"rows": rows, "settings": vars(args), "device": device, "device_name": hardware.name,
              "native_float8": native, "wall_s": wall,
              "machine": machine()}
    write_json(result, args.out)
    print(f"({wall:.0f} s)")
    return result


if __name__ == "__main__":
    main()

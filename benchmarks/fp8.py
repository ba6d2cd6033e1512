"""Float8 training (torchao, `Fp8QuantizationCallback`) against bfloat16: what the matmuls gain
once the data is not the bottleneck.

Every batch is made on the device before training (a few random batches, reused): the step
is the model's forward, backward and fused AdamW update, nothing else. Two models, each
trained one rank in a fresh process per run:

    mlp     4 x Linear(width, width) with GELU on `tokens` token rows (a transformer's MLP
            share), then a Linear(width, 16) head: width 4096, 8192 tokens on CUDA (512 and
            512 on CPU)
    llama   Llama-3-8B-shaped decoder blocks (hidden 4096, SwiGLU 14336, 32 heads, 8 KV heads,
            RoPE, RMSNorm) on 4 x 2048 tokens, 2 blocks, each compiled on its own, then a
            Linear(hidden, 16) head (on CPU: a 256-wide miniature)

Variants: ``bf16`` (autocast), ``fp8-tensorwise`` and ``fp8-rowwise`` (bf16 autocast with the
linears in float8), ``fp8-tensorwise-fastacc`` (tensorwise with the fast accumulation in the
backward's matmuls too: the callback's ``fast_accum=True``; not run unless named), compiled (``--eager`` adds the eager runs; ``--variants`` picks). The
step time is a window of steps after warm-up, cut in `--parts` windows, the device synchronized
only at their edges; rounds interleave the variants and the table gives the median over rounds, the ratio to bf16
and its spread.

``--sweep`` (CUDA) times the matmul alone, ``x @ w.T`` in bf16 against ``torch._scaled_mm``
in float8 with tensorwise and rowwise scales, over square weights of several widths on 8192
rows: where float8 can win before any cast is paid.

On a CPU (or a GPU before SM89) there is no float8 matmul: the callback has torchao emulate
it, so float8 is slower there and the script says so.

    python benchmarks/fp8.py                # CUDA: both models, 2 rounds, and the sweep
    python benchmarks/fp8.py --smoke        # seconds: the mlp, eager, tiny, one round (what CI runs)
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "llama"))

from modeling_llama import LlamaConfig, LlamaDecoderLayer, LlamaRotaryEmbedding  # noqa: E402

from dream_trainer import DeviceParameters, DreamTrainer, LoggingParameters, TrainerConfig, TrainingParameters  # noqa: E402
from dream_trainer.callbacks.fp8 import float8_hardware  # noqa: E402
from dream_trainer.callbacks.step_window import StepWindowCallback  # noqa: E402
from dream_trainer.testing import spawn_world  # noqa: E402

from common import PROFILED_STEPS, device_name, machine, profile_table, spread, step_profiler, verdict, write_json  # noqa: E402,E501

VARIANTS = ("bf16", "fp8-tensorwise", "fp8-rowwise", "fp8-tensorwise-fastacc")
DEFAULT_VARIANTS = "bf16,fp8-tensorwise,fp8-rowwise"
SHAPES = {  # model -> CUDA shape, CPU shape
    "mlp": ({"width": 4096, "tokens": 8192}, {"width": 512, "tokens": 512}),
    "mlp-nobias": ({"width": 4096, "tokens": 8192}, {"width": 512, "tokens": 512}),
    "llama": ({"hidden": 4096, "ffn": 14336, "heads": 32, "kv_heads": 8, "seq": 2048, "batch": 4, "layers": 2},
              {"hidden": 256, "ffn": 768, "heads": 4, "kv_heads": 2, "seq": 128, "batch": 4, "layers": 2}),
}


HEAD = 16
"""Both models end in a small ``Linear(width, 16)``: the output head, which the callback keeps in
high precision (as it would a language model's), so every large linear before it converts."""


class LlamaBlocks(nn.Module):
    """Decoder blocks on hidden states and a small head (no embedding, no vocabulary)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.rotary = LlamaRotaryEmbedding(config)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.head = nn.Linear(config.hidden_size, HEAD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary(x, torch.arange(x.shape[1], device=x.device))
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(x)


class Bench(DreamTrainer):
    """One of the two models on batches made on the device; loss = mean square output."""

    def __init__(self, config: TrainerConfig, model: str, shape: dict[str, int], steps: int):
        super().__init__(config)
        self.kind, self.shape, self.steps = model, shape, steps

    def configure_models(self) -> None:
        s = self.shape
        if self.kind.startswith("mlp"):
            layers: list[nn.Module] = []
            for _ in range(4):
                layers += [nn.Linear(s["width"], s["width"], bias=self.kind == "mlp"), nn.GELU()]
            self.model: nn.Module = nn.Sequential(*layers, nn.Linear(s["width"], HEAD))
        else:
            self.model = LlamaBlocks(LlamaConfig(
                vocab_size=1, hidden_size=s["hidden"], intermediate_size=s["ffn"], num_hidden_layers=s["layers"],
                num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], max_position_embeddings=s["seq"]))

    def init_weights(self) -> None:
        for module in self.model.modules():
            if hasattr(module, "reset_parameters") and module is not self.model:
                module.reset_parameters()
        for module in self.model.modules():  # nn.Linear's own init, scaled down: stable squares
            if isinstance(module, nn.Linear):
                module.weight.mul_(0.5)

    def apply_compile(self) -> None:
        for module in (self.model.layers if self.kind == "llama" else [self.model]):
            self.compile_module(module)

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-5)  # fused on CUDA (the trainer's choice)

    def configure_dataloaders(self) -> tuple[Any, None]:
        s, device = self.shape, self.world.device
        g = torch.Generator(device=device).manual_seed(0)
        shape = (s["tokens"], s["width"]) if self.kind.startswith("mlp") else (s["batch"], s["seq"], s["hidden"])
        batches = [torch.randn(shape, generator=g, device=device) for _ in range(4)]  # on the device: no copy
        return [batches[i % 4] for i in range(self.steps)], None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        loss = self.model(batch).float().pow(2).mean()
        self.backward(loss)
        self.step(self.optimizer)
        return {"loss": loss}

    def count_batch(self, batch: Any) -> tuple[int, int | None]:
        return 1, int(batch.shape[0] if self.kind == "mlp" else batch.shape[0] * batch.shape[1])


def tokens_of(model: str, shape: dict[str, int]) -> int:
    return shape["tokens"] if model.startswith("mlp") else shape["batch"] * shape["seq"]


def run(model: str, variant: str, compiled: bool, opts: dict[str, Any]) -> dict[str, Any]:
    """One run, in its own process."""
    from dream_trainer.callbacks import Fp8QuantizationCallback

    device = opts["device"]
    torch.set_num_threads(os.cpu_count() or 1)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = opts["cache"]
    shape = opts["shapes"][model]
    with tempfile.TemporaryDirectory(prefix="fp8_") as root:
        timer = StepWindowCallback(opts["warmup"], parts=opts["parts"])
        callbacks: list[Any] = [timer]
        if variant.startswith("fp8"):
            logging.getLogger("dream_trainer.callbacks.fp8").setLevel(logging.ERROR)  # the table says "EMULATED" once
            callbacks.append(Fp8QuantizationCallback(variant.split("-")[1], display=False,
                                                     fast_accum=variant.endswith("-fastacc")))
        steps = opts["warmup"] + opts["steps"]
        profiler = step_profiler(steps, root) if opts.get("profile") else None  # after the timed window
        if profiler:
            callbacks.append(profiler)
        config = TrainerConfig(
            experiment="fp8", root_dir=root, seed=0,
            device_parameters=DeviceParameters.SINGLE_DEVICE(device=device, compile_model=compiled,
                                                             autocast_dtype=torch.bfloat16),
            training_parameters=TrainingParameters(n_epochs=None, max_steps=steps + (PROFILED_STEPS if profiler else 0),
                                                   val_every_n_steps=None,
                                                   validate_at_epoch_end=False, num_sanity_val_steps=0),
            logging_parameters=LoggingParameters(log_every_n_steps=10**9, log_lr=False), callbacks=callbacks,
        )
        trainer = Bench(config, model, shape, steps)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        trainer.fit()
        if device == "cuda":
            peak = torch.cuda.max_memory_allocated() / 2**20
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
        fp8 = [c for c in callbacks if isinstance(c, Fp8QuantizationCallback)]
        converted = len(fp8[0].converted.get("model", [])) if fp8 else 0
        assert timer.step_s is not None
        return {"profile": profile_table(profiler), "tokens_per_s": tokens_of(model, shape) / timer.step_s, "step_ms": timer.step_s * 1e3,
                "part_step_s": timer.part_step_s, "peak_mb": peak,
                "converted_linears": converted, "first_step_s": timer.first_step_s,
                "fused_adamw": bool(trainer.optimizer.param_groups[0]["fused"])}


def run_many(keys: list[tuple[str, str, bool]], opts: dict[str, Any]) -> list[dict[str, Any]]:
    """--smoke: `run` for each (model, variant, compiled) in turn, in this one process."""
    return [run(*key, opts) for key in keys]


def sweep(widths: list[int], rows: int, repeat: int = 20) -> list[dict[str, Any]]:
    """bf16 ``x @ w.T`` against float8 ``torch._scaled_mm`` (tensorwise and rowwise scales;
    tensorwise with fast accumulation), the matmul alone (inputs already in float8), timed with CUDA events."""
    out = []
    for width in widths:
        x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(width, width, device="cuda", dtype=torch.bfloat16)
        x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        row_a, row_b = torch.ones(rows, 1, device="cuda"), torch.ones(1, width, device="cuda")
        fns = {"bf16": lambda: x @ w.t(),
               "fp8-tensorwise": lambda: torch._scaled_mm(x8, w8.t(), one, one, out_dtype=torch.bfloat16),
               "fp8-rowwise": lambda: torch._scaled_mm(x8, w8.t(), row_a, row_b, out_dtype=torch.bfloat16),
               "fp8-tensorwise-fastacc": lambda: torch._scaled_mm(x8, w8.t(), one, one, out_dtype=torch.bfloat16,
                                                                  use_fast_accum=True)}
        row: dict[str, Any] = {"rows": rows, "width": width}
        for name, fn in fns.items():
            try:
                for _ in range(3):
                    fn()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(repeat):
                    fn()
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end) / repeat
                row[name] = {"ms": ms, "tflops": 2 * rows * width * width / ms / 1e9}
            except RuntimeError as exc:  # a recipe this torch/GPU does not have
                row[name] = {"error": str(exc).splitlines()[0][:160]}
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5, help="steps before the window (compile, allocation)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--parts", type=int, default=3, help="the timed steps as this many windows (the spread within a run)")
    p.add_argument("--models", default="mlp,llama", help=f"comma-separated, from {list(SHAPES)}")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma-separated, from {list(VARIANTS)}")
    p.add_argument("--eager", action="store_true", help="also the eager runs")
    p.add_argument("--no-compile", action="store_true", help="eager runs only")
    p.add_argument("--sweep", default=None, help="CUDA: comma-separated widths of the matmul sweep "
                   "(default 512,1024,2048,4096,8192 on CUDA; 'none' to skip)")
    p.add_argument("--profile", action="store_true", help="after each run's timed window, profile 3 steps: the ops "
                   "table (by device time on CUDA) goes into the JSON and <out>.profile.txt")
    p.add_argument("--smoke", action="store_true", help="seconds: the mlp, eager, tiny, one round")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "fp8.json"))
    args = p.parse_args(argv)
    device = args.device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = {m: dict(SHAPES[m][0 if device == "cuda" else 1]) for m in SHAPES}
    if args.smoke:
        args.models, args.rounds, args.steps, args.warmup, args.no_compile, args.sweep = "mlp", 1, 3, 1, True, "none"
        args.parts = 1
        shapes["mlp"] = {"width": 64, "tokens": 64}
    models, variants = args.models.split(","), args.variants.split(",")
    for name, given, allowed in (("--models", models, list(SHAPES)), ("--variants", variants, list(VARIANTS))):
        bad = [x for x in given if x not in allowed]
        if bad:
            p.error(f"{name}: {bad} not in {allowed}")
    hardware = float8_hardware(device)  # the callback's own decision: native float8 matmuls, or emulated
    modes = [False] if args.no_compile else ([False, True] if args.eager else [True])
    start = time.perf_counter()
    widths = [] if args.sweep == "none" or device != "cuda" else [int(w) for w in (args.sweep or "512,1024,2048,4096,8192").split(",")]
    swept = sweep(widths, 8192) if widths else []  # first: seconds, and the ceiling the models can reach
    if swept:
        _print_sweep(swept)
    with tempfile.TemporaryDirectory(prefix="fp8_inductor_") as cache:
        opts = {"device": device, "steps": args.steps, "warmup": args.warmup, "parts": args.parts, "shapes": shapes,
                "cache": cache, "profile": args.profile}
        keys = [(m, v, c) for m in models for c in modes for v in variants]
        runs: dict[tuple[str, str, bool], list[dict[str, Any]]] = {k: [] for k in keys}
        for r in range(args.rounds):
            order = keys[r % len(keys):] + keys[: r % len(keys)]
            # a fresh process per run; --smoke: every run in one (starting one is most of its time)
            outs = iter(spawn_world(1, run_many, order, opts, timeout=1200)[0]) if args.smoke else \
                (spawn_world(1, run, *key, opts, timeout=1200)[0] for key in order)
            for key, out in zip(order, outs):
                model, variant, compiled = key
                runs[key].append(out)
                print(f"  round {r + 1}/{args.rounds} {model} {variant:<15} {'compiled' if compiled else 'eager':<9}"
                      f"{out['tokens_per_s']:>13,.0f} tokens/s {out['peak_mb']:>9,.0f} MiB", flush=True)
    wall = time.perf_counter() - start
    rows = _table(keys, runs, shapes, hardware, args)
    if not hardware.native:
        print("\n  No native float8 here: torchao emulates the float8 matmuls, so float8 costs time instead of\n"
              "  saving it. This table measures the emulation's cost and checks that float8 training runs;\n"
              "  the speedup needs an SM89+ GPU (H100/H200/Ada).")
    result = {"rows": rows, "sweep": swept, "settings": vars(args), "shapes": shapes, "device": device,
              "device_name": device_name(device), "native_float8": hardware.native, "wall_s": wall, "machine": machine()}
    write_json(result, args.out)
    if args.profile:  # the ops tables side by side, for reading
        text = "\n\n".join(f"=== {row['model']} {row['variant']} {'compiled' if row['compiled'] else 'eager'} (round 1)\n"
                            f"{row['runs'][0].get('profile')}" for row in rows)
        Path(args.out).with_suffix(".profile.txt").write_text(text)
    print(f"({wall:.0f} s)")
    return result


def _table(keys: list[tuple[str, str, bool]], runs: dict[Any, list[dict[str, Any]]], shapes: dict[str, Any],
           hardware: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    print(f"\nfloat8 vs bf16 on {hardware.name} ({'native float8' if hardware.native else 'float8 EMULATED'}), "
          f"batches on the device, {'fused' if args.device == 'cuda' else 'foreach'} AdamW, {args.steps} timed steps after {args.warmup}, {args.rounds} round(s); "
          f"torch {torch.__version__}\n")
    head = (f"{'model':<6}{'mode':<10}{'variant':<16}{'linears':>8}{'tokens/s':>13}{'vs bf16':>9}{'spread':>8}"
            f"{'ms/step':>9}{'peak MiB':>10}{'first s':>9}")
    print(head)
    print("-" * len(head))
    rows = []
    for model, variant, compiled in keys:
        xs = runs[(model, variant, compiled)]
        bf16 = runs.get((model, "bf16", compiled))
        ratios = [pb / px for x, b in zip(xs, bf16) for px, pb in zip(x["part_step_s"], b["part_step_s"])] if bf16 else []
        tps = statistics.median(x["tokens_per_s"] for x in xs)
        row = {"model": model, "shape": shapes[model], "variant": variant, "compiled": compiled, "tokens_per_s": tps,
               "vs_bf16": statistics.median(ratios) if ratios else None, "vs_bf16_rounds": ratios,
               "vs_bf16_spread": spread(ratios), "verdict": verdict(ratios) if variant != "bf16" else None,
               "step_ms": statistics.median(x["step_ms"] for x in xs),
               "peak_mb": statistics.median(x["peak_mb"] for x in xs), "converted_linears": xs[0]["converted_linears"],
               "first_step_s": xs[0]["first_step_s"], "runs": xs}
        rows.append(row)
        vs = f"{row['vs_bf16']:.2f}" if row["vs_bf16"] is not None else "-"
        print(f"{model:<6}{'compiled' if compiled else 'eager':<10}{variant:<16}{row['converted_linears']:>8}{tps:>13,.0f}"
              f"{vs:>9}{100 * row['vs_bf16_spread']:>7.0f}%{row['step_ms']:>9.2f}{row['peak_mb']:>10,.0f}"
              f"{row['first_step_s']:>9.1f}")
    print("\n  vs bf16: median over rounds and windows of (variant / bf16, same round and window); spread: (max - min)\n"
          "  / median of those ratios. first s: the first step (compile). peak MiB: device memory on CUDA, the process's peak\n"
          "  resident set on CPU.")
    return rows


def _print_sweep(swept: list[dict[str, Any]]) -> None:
    print(f"\nthe matmul alone, {swept[0]['rows']} rows x width -> width (TFLOP/s; float8 inputs already cast):\n")
    print(f"{'width':>7}{'bf16':>10}{'fp8 tensorwise':>16}{'fp8 rowwise':>13}{'tw fastacc':>12}{'tw/bf16':>9}"
          f"{'rw/bf16':>9}{'twf/bf16':>10}")
    for row in swept:
        cells = [row[k].get("tflops") for k in ("bf16", "fp8-tensorwise", "fp8-rowwise", "fp8-tensorwise-fastacc")]
        text = [f"{c:,.0f}" if c else "failed" for c in cells]
        ratio = [f"{c / cells[0]:.2f}" if c and cells[0] else "-" for c in cells[1:]]
        print(f"{row['width']:>7}{text[0]:>10}{text[1]:>16}{text[2]:>13}{text[3]:>12}{ratio[0]:>9}{ratio[1]:>9}"
              f"{ratio[2]:>10}")


if __name__ == "__main__":
    main()

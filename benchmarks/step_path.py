"""The trainer's step against a hand-written loop, on a GPU: the same model, data and optimizer,
eager and compiled, with tokens/s and MFU.

The model is the demo's GPT at GPT-2-small shape (12 layers, 12 heads, 768 wide, 1024-token
context, byte vocabulary), bf16 autocast, AdamW, gradient clipping at 1.0, batches of token
ids. Both loops train the SAME model and optimizer objects in one process, step by step: each
time the trainer asks its loader for a batch, one hand-written step runs first
(`common.RawBeside`), so only the loop differs:

    loop      for x, y in batches_on_the_gpu: with autocast: loss = lm_loss(model(x), y);
              loss.backward(); clip_grad_norm_(params, 1.0); opt.step(); opt.zero_grad()
              -- its batches were copied to the GPU before training (the best case)
    trainer   a DreamTrainer doing the same in training_step; its loader yields the same
              batches in pinned host memory, copied by the trainer on its side stream while
              the previous step runs; it logs the loss every 50 steps (its default)

The optimizer is built as ``AdamW(params, lr=...)``: the trainer runs it fused on CUDA (what a
hand-tuned loop writes as ``fused=True``), and the loop steps that same optimizer. The device
is synchronized before and after each hand-written step and at the edges of each of the
trainer's epochs; the trainer's time in an epoch is the epoch's wall time less its
hand-written steps'. Both thus start every step from an empty queue: neither hides its host
time behind queued kernels, so the ratio is if anything pessimistic for the trainer, and the
device's drift hits the two step by step (pairing whole epochs, as this script did before,
spread 11-61 % on an H200). ``--chunk N`` runs N hand-written steps together, then N of the
trainer's (``--chunk`` = ``--steps``: epoch pairing). ``ratio`` is the median over epochs of
(the trainer's time / the loop's, per step); the target is <= 1.03 on a GPU.
MFU = model FLOPs per token (6 x non-embedding parameters + 12 x layers x width x context,
the attention) x tokens/s / the GPU's dense bf16 peak (the datasheet's).

    python benchmarks/step_path.py            # CUDA: eager and compiled, 8 rounds of 20 steps each
    python benchmarks/step_path.py --smoke    # seconds, a tiny GPT (what CI runs, on the CPU)
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

from model import GPT, GPTConfig, lm_loss  # noqa: E402

from dream_trainer import Callback, DeviceParameters, DreamTrainer, LoggingParameters, TrainerConfig, TrainingParameters  # noqa: E402
from dream_trainer.callbacks.monitors.throughput import device_peak_flops  # noqa: E402
from dream_trainer.testing import spawn_world  # noqa: E402

from common import RawBeside, device_name, machine, spread, verdict, write_json  # noqa: E402  (benchmarks/common.py)

TARGET = 1.03
SHAPES = {"gpt2": dict(n_layer=12, n_head=12, d_model=768, block_size=1024, batch=8),
          "tiny": dict(n_layer=2, n_head=2, d_model=64, block_size=32, batch=4)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()  # deliberate: an epoch's edges are device time


class Bench(DreamTrainer):
    def __init__(self, config: TrainerConfig, shape: dict[str, int], host: Any, compiled: bool):
        super().__init__(config)
        self.shape, self.host, self.compiled = shape, host, compiled

    def configure_models(self) -> None:
        s = self.shape
        self.model = GPT(GPTConfig(vocab_size=256, block_size=s["block_size"], n_layer=s["n_layer"],
                                   n_head=s["n_head"], d_model=s["d_model"]))

    def apply_compile(self) -> None:
        self.compile_module(self.model)

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-4)  # fused on CUDA: the trainer's choice

    def configure_dataloaders(self) -> tuple[Any, None]:
        return self.host, None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        loss = lm_loss(self.model(x), y)
        self.backward(loss)
        self.step(self.optimizer)
        return {"loss": loss}


def loop_epoch(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list[Any], device: torch.device) -> None:
    """The hand-written loop: one epoch on batches already on the device."""
    params = [p for g in opt.param_groups for p in g["params"]]
    for x, y in batches:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = lm_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)


class Windows(Callback[Any]):
    """Each of the trainer's epochs is a window, the device synchronized at its two edges; the
    raw steps run inside it (`RawBeside`) are taken out of the trainer's time."""

    def __init__(self, raw: RawBeside, steps: int):
        self.raw, self.steps = raw, steps
        self.windows: list[dict[str, float]] = []
        self._start: Any = None

    def pre_train_epoch(self) -> None:
        _sync(self.trainer.world.device)
        self._start = self.raw.mark()

    def post_train_epoch(self, result: dict[str, Any]) -> None:
        _sync(self.trainer.world.device)
        self.windows.append(self.raw.window(self._start, self.steps))


def run(compiled: bool, opts: dict[str, Any]) -> dict[str, Any]:
    """Warm-up epochs, then `rounds` x (a loop epoch, a trainer epoch), in this process."""
    s, steps = opts["shape"], opts["steps"]
    device = torch.device(opts["device"])
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (steps, s["batch"], s["block_size"] + 1), generator=g)
    pin = device.type == "cuda"
    host = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]
    host = [(x.pin_memory(), y.pin_memory()) if pin else (x, y) for x, y in host]
    on_device = {id(x): (x.to(device), y.to(device)) for x, y in host}  # the loop's copies, made before training

    def loop_step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        loop_epoch(trainer.model, trainer.optimizer, [on_device[id(batch[0])]], device)

    raw = RawBeside(loop_step, chunk=opts["chunk"], sync=(lambda: _sync(device)) if device.type == "cuda" else None)
    timer = Windows(raw, steps)
    with tempfile.TemporaryDirectory(prefix="step_path_") as root:
        config = TrainerConfig(
            root_dir=root, seed=0,
            device_parameters=DeviceParameters.SINGLE_DEVICE(device=opts["device"], compile_model=compiled,
                                                             autocast_dtype=torch.bfloat16),
            training_parameters=TrainingParameters(n_epochs=opts["warmup"] + opts["rounds"], num_sanity_val_steps=0,
                                                   validate_at_epoch_end=False, gradient_clip_val=1.0),
            logging_parameters=LoggingParameters(log_every_n_steps=50), callbacks=[timer])
        trainer = Bench(config, s, raw.loader(host), compiled)
        trainer.fit()
        fused = bool(trainer.optimizer.param_groups[0]["fused"])
        n_params = sum(p.numel() for n, p in trainer.model.named_parameters() if "emb" not in n)
    kept = timer.windows[opts["warmup"]:]
    loop, mine = [w["raw_wall"] for w in kept], [w["framework_wall"] for w in kept]  # wall: the device's time too
    ratios = [t / l for t, l in zip(mine, loop)]
    tokens_per_step = s["batch"] * s["block_size"]
    flops_per_token = 6 * n_params + 12 * s["n_layer"] * s["d_model"] * s["block_size"]
    return {"loop_step_ms": statistics.median(loop) * 1e3, "trainer_step_ms": statistics.median(mine) * 1e3,
            "ratios": ratios, "tokens_per_step": tokens_per_step, "flops_per_token": flops_per_token,
            "fused_adamw": fused, "copies": trainer.world.transfer.copies,
            "pageable_bytes": trainer.world.transfer.pageable_bytes}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=8, help="timed epochs per mode (each a window of paired steps)")
    p.add_argument("--chunk", type=int, default=1, help="loop steps run together, then as many trainer steps "
                   "(1: every step paired; --steps: epoch pairing)")
    p.add_argument("--steps", type=int, default=20, help="steps per epoch")
    p.add_argument("--warmup", type=int, default=2, help="epochs left out (the first compiles)")
    p.add_argument("--modes", default="eager,compiled")
    p.add_argument("--shape", default=None, help=f"from {list(SHAPES)} (default: gpt2 on CUDA, tiny on CPU)")
    p.add_argument("--smoke", action="store_true", help="seconds: tiny, eager, 2 rounds of 3 steps")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "step_path.json"))
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args.shape = args.shape or ("gpt2" if device == "cuda" else "tiny")
    if args.smoke:
        args.shape, args.modes, args.rounds, args.steps, args.warmup = "tiny", "eager", 2, 3, 1
    modes = args.modes.split(",")
    if args.shape not in SHAPES or any(m not in ("eager", "compiled") for m in modes):
        p.error(f"--shape from {list(SHAPES)}, --modes from ['eager', 'compiled']")
    if not 1 <= args.chunk <= args.steps:
        p.error(f"--chunk {args.chunk}: from 1 to --steps ({args.steps})")
    opts = {"device": device, "shape": SHAPES[args.shape], "steps": args.steps, "rounds": args.rounds, "warmup": args.warmup,
            "chunk": args.chunk}
    peak = device_peak_flops(torch.device("cuda", 0)) if device == "cuda" else None
    start = time.perf_counter()
    rows = []
    for mode in modes:
        (out,) = spawn_world(1, run, mode == "compiled", opts, timeout=1800)
        ratio = statistics.median(out["ratios"])
        tps = out["tokens_per_step"] / (out["trainer_step_ms"] / 1e3)
        achieved = tps * out["flops_per_token"]
        rows.append({"mode": mode, **out, "ratio": ratio, "spread": spread(out["ratios"]), "verdict": verdict(out["ratios"]),
                     "target_met": ratio <= TARGET, "tokens_per_s": tps, "tflops": achieved / 1e12,
                     "mfu": achieved / peak if peak else None, "peak_tflops": peak / 1e12 if peak else None})
    wall = time.perf_counter() - start
    print(f"\nthe trainer against a hand-written loop on {device_name(device)}: GPT {args.shape} {SHAPES[args.shape]}, "
          f"bf16 autocast, AdamW, clip 1.0; {args.rounds} epochs of {args.steps} steps, paired in chunks of {args.chunk}; "
          f"torch {torch.__version__}\n")
    head = f"{'mode':<10}{'loop ms':>9}{'trainer ms':>12}{'ratio':>8}{'spread':>8}{'target':>8}{'tokens/s':>12}{'TFLOP/s':>9}{'MFU':>7}"
    print(head)
    print("-" * len(head))
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        print(f"{r['mode']:<10}{r['loop_step_ms']:>9.2f}{r['trainer_step_ms']:>12.2f}{r['ratio']:>8.3f}"
              f"{100 * r['spread']:>7.0f}%{'met' if r['target_met'] else 'NOT MET':>8}{r['tokens_per_s']:>12,.0f}"
              f"{r['tflops']:>9.1f}{mfu:>7}  {r['verdict']}")
    print(f"\n  ratio: median over epochs of the trainer's time / the loop's in that epoch (target <= {TARGET}). MFU against "
          f"the GPU's dense bf16 datasheet peak ({rows[0]['peak_tflops'] or '-'} TFLOP/s).")
    result = {"rows": rows, "settings": vars(args), "device": device, "device_name": device_name(device), "wall_s": wall,
              "machine": machine()}
    write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()

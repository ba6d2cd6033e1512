"""`PerformanceReportCallback`: where a run's step time goes, written at the end of fit as Markdown
and JSON, with plain-language findings."""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections import deque
from pathlib import Path
from typing import Any

import torch

from dream_trainer.protocol.base import RankZeroCallback
from dream_trainer.callbacks.monitors.throughput import model_flops
from dream_trainer.callbacks.peak_flops import resolve_peak
from dream_trainer.trainer.base import BaseTrainer
from dream_trainer.world.memory import MB

logger = logging.getLogger(__name__)


class PerformanceReportCallback(RankZeroCallback[BaseTrainer]):
    """Measure every `measure_every`-th optimizer step and write, when `fit()` ends,
    ``performance_report.md`` and ``performance_report.json`` (in `output_dir`, default the
    run directory; rank 0):

    - step time: median and p90 (the first `warmup_steps` steps are left out of them and
      reported on their own: compile and warm-up);
    - where it goes: waiting for the dataloader, inside ``training_step`` (forward and
      backward), in the optimizer step (clip, update, zero_grad, schedulers) and the rest
      (callbacks, logging, checkpointing) — from ``trainer.step_stats``;
    - throughput: samples/s and tokens/s (this rank, and across data-parallel ranks);
    - model FLOP/s per device from ``trainer.model_flops_per_token`` (or
      ``model_flops_per_sample`` for batches without tokens), and MFU when the peak is known
      (`peak_flops` per device, or a known GPU in the training dtype, float8 included); the
      peak used and its source (user or table, device, dtype) are in the report and the log;
    - peak memory since `fit()` started training (``trainer.world.memory_status()``: the
      device's allocated memory on CUDA, the process's resident set on CPU), compile time
      (``trainer.build.total_compile_time_s``: measured when a `CompileMonitorCallback` runs);
    - findings, computed from those numbers: a dataloader-, optimizer- or callback-bound
      run, irregular step times, a long warm-up; or none.

    On CUDA a measured step is synchronized at its boundaries, so host clocks see device
    time; other steps are not touched. On CPU every step is measured at no cost. The report
    covers the last `keep_steps` measured steps (memory stays bounded on long runs).
    Not critical: a failure to write is logged.

    Attributes:
        report: the numbers and findings (also the JSON file), once written.
    """

    critical = False
    order = 10_000  # last: the step's other callbacks are done when it reads the step's stats

    def __init__(self, output_dir: str | Path | None = None, warmup_steps: int = 2, measure_every: int | None = None,
                 data_bound: float = 0.2, optimizer_bound: float = 0.3, callback_bound: float = 0.15,
                 irregular: float = 1.5, keep_steps: int = 10_000, peak_flops: float | None = None):
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"PerformanceReportCallback(warmup_steps={warmup_steps!r}) is invalid: expected an int >= 0")
        if measure_every is not None and (isinstance(measure_every, bool) or not isinstance(measure_every, int) or measure_every < 1):
            raise ValueError(f"PerformanceReportCallback(measure_every={measure_every!r}) is invalid: expected an int >= 1 or None")
        if peak_flops is not None and (isinstance(peak_flops, bool) or not isinstance(peak_flops, (int, float))
                                       or not peak_flops > 0):
            raise ValueError(f"PerformanceReportCallback(peak_flops={peak_flops!r}) is invalid: expected FLOP/s > 0 or None")
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.peak_flops = peak_flops
        self.warmup_steps, self.measure_every = warmup_steps, measure_every
        self.thresholds = {"data": data_bound, "optimizer": optimizer_bound, "callbacks": callback_bound, "irregular": irregular}
        self.rows: deque[dict[str, float]] = deque(maxlen=keep_steps)  # bounded: a long run does not grow
        self.report: dict[str, Any] | None = None
        self._cuda = False

    def pre_fit(self) -> None:
        self.trainer.request_step_times()  # compute and optimizer times: measured for this report
        self.trainer.request_batch_counts()  # and the samples and tokens of each step
        self.trainer.world.reset_peak_memory()  # the peak of the training, not of the setup
        if self._on_cuda():
            # The synchronizing hooks exist only on CUDA: on CPU measuring costs one hook.
            self.trainer.callbacks.add(_SyncMeasuredSteps(self), name=f"{type(self).__name__}.sync")

    def _on_cuda(self) -> bool:
        self._cuda = self.trainer.world.device.type == "cuda"
        if self.measure_every is None:  # also when attached after pre_fit
            self.measure_every = 10 if self._cuda else 1
        return self._cuda

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        trainer = self.trainer
        if self.measure_every is None:
            self._on_cuda()
        if trainer.is_accumulating_gradients or trainer.step_skipped or not self._measured_done():
            return
        s = trainer.step_stats
        if math.isnan(s.compute_s):  # attached after pre_fit: its step times are measured from the next step on
            trainer.request_step_times()
            trainer.request_batch_counts()
            return
        self.rows.append({"step": s.step, "time": s.step_time_s, "data": s.data_wait_s, "compute": s.compute_s,
                          "optimizer": s.optimizer_s, "samples": s.samples or 0, "tokens": s.tokens or 0})

    def _measured_done(self) -> bool:
        return self.trainer.global_step % self.measure_every == 0  # type: ignore[operator]

    def post_fit(self) -> None:
        self.write()

    def on_teardown(self, status: str) -> None:
        if self.report is None and self.rows:
            self.write()  # a run that stopped or failed: what was measured is still reported

    # ------------------------------------------------------------------ the report
    def write(self) -> dict[str, Any]:
        """Compute the report from the steps measured so far and write both files."""
        self.report = report = self.compute()
        out = self.output_dir or Path(self.trainer.run_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "performance_report.json").write_text(json.dumps(report, indent=1))
        (out / "performance_report.md").write_text(_markdown(report))
        logger.info("performance report: %s", "; ".join(report["findings"]))
        logger.info("performance report: %s", report["flops"]["peak_source"])
        return report

    def compute(self) -> dict[str, Any]:
        """The numbers and findings (no files)."""
        trainer, rows = self.trainer, list(self.rows)
        steady = [r for r in rows if r["step"] > self.warmup_steps] or rows
        warm = [r for r in rows if r["step"] <= self.warmup_steps]
        times = sorted(r["time"] for r in steady)
        total = sum(r["time"] for r in steady) or float("nan")
        data, compute, optimizer = (sum(r[k] for r in steady) for k in ("data", "compute", "optimizer"))
        shares = {
            "data": data / total,
            "training_step": (compute - optimizer) / total,
            "optimizer": optimizer / total,
            "callbacks_and_other": max(0.0, total - data - compute) / total,
        }
        stats = trainer.step_stats
        per_rank_samples = sum(r["samples"] for r in steady) / total
        per_rank_tokens = sum(r["tokens"] for r in steady) / total if stats.total_tokens else None
        dp = trainer.world.dp_size
        build = getattr(trainer, "build", None)  # a DreamTrainer's BuildRecord (compile time: CompileMonitorCallback's)
        compile_s = build.total_compile_time_s if build is not None else None
        report = {
            "steps_measured": len(rows), "measure_every": self.measure_every, "warmup_steps": self.warmup_steps,
            "step_time_s": {"median": _q(times, 0.5), "p90": _q(times, 0.9), "mean": total / max(1, len(steady))},
            "warmup_step_time_s": [r["time"] for r in warm],
            "shares": shares,
            "throughput": {"samples_per_s_per_rank": per_rank_samples, "samples_per_s": per_rank_samples * dp,
                           "tokens_per_s_per_rank": per_rank_tokens,
                           "tokens_per_s": per_rank_tokens * dp if per_rank_tokens is not None else None},
            "flops": self._flops(per_rank_samples * dp, per_rank_tokens * dp if per_rank_tokens is not None else None),
            "peak_memory_mb": trainer.world.memory_status().peak_allocated / MB,
            "memory_kind": "device allocated" if self._cuda else "process RSS",
            "compile_time_s": compile_s,
            "device": str(trainer.world.device), "world_size": trainer.world.world_size,
        }
        report["findings"] = self._findings(report)
        return report

    def _findings(self, report: dict[str, Any]) -> list[str]:
        shares, t, found = report["shares"], report["step_time_s"], []
        pct = lambda x: f"{100 * x:.0f} %"  # noqa: E731
        if shares["data"] >= self.thresholds["data"]:
            found.append(f"dataloader-bound: {pct(shares['data'])} of step time waiting for batches — raise "
                         "num_workers, use pin_memory and persistent_workers, or make the dataset cheaper")
        if shares["optimizer"] >= self.thresholds["optimizer"]:
            found.append(f"optimizer-heavy: {pct(shares['optimizer'])} of step time in the optimizer step — try a "
                         "fused or foreach optimizer, or clip less often")
        if shares["callbacks_and_other"] >= self.thresholds["callbacks"]:
            found.append(f"callbacks and logging take {pct(shares['callbacks_and_other'])} of step time — log less "
                         "often, or look for a slow callback (ProfileCallback shows which)")
        if t["median"] and t["p90"] / t["median"] >= self.thresholds["irregular"]:
            found.append(f"irregular step times: p90 is {t['p90'] / t['median']:.1f}x the median — recompiles, "
                         "garbage collection, checkpoint saves or a straggling rank")
        warm = report["warmup_step_time_s"]
        if warm and t["median"] and max(warm) >= 5 * t["median"]:
            found.append(f"warm-up: the first steps took up to {max(warm):.2f} s ({max(warm) / t['median']:.0f}x a "
                         "steady step): compilation or allocation; it is paid once")
        if not found:
            found.append(f"no bottleneck outside the model: {pct(shares['training_step'])} of step time in "
                         "training_step (forward and backward)")
        return found

    def _flops(self, samples_per_s: float, tokens_per_s: float | None) -> dict[str, Any]:
        """Model FLOP/s (from the trainer's FLOPs per token or per sample), MFU and the peak's source."""
        trainer = self.trainer
        per_token, ranks = trainer.model_flops_per_token, trainer.world.world_size
        achieved = model_flops(trainer, samples_per_s, tokens_per_s, per_token)
        resolved = resolve_peak(trainer, self.peak_flops)
        peak = resolved.value
        return {
            "peak": resolved.as_dict(), "peak_source": resolved.describe(),
            "model_flops_per_token": per_token, "model_flops_per_sample": trainer.model_flops_per_sample,
            "tflops_per_device": achieved / ranks / 1e12 if achieved is not None else None,
            "peak_tflops_per_device": peak / 1e12 if peak else None,
            "mfu": achieved / (peak * ranks) if achieved is not None and peak else None,
        }


def _q(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def _markdown(r: dict[str, Any]) -> str:
    t, s, th = r["step_time_s"], r["shares"], r["throughput"]
    tokens = f"{th['tokens_per_s']:,.0f} tokens/s ({th['tokens_per_s_per_rank']:,.0f} per rank), " if th["tokens_per_s"] else ""
    lines = [
        "# Performance report", "",
        "## Findings", "", *[f"- {f}" for f in r["findings"]], "",
        "## Step time", "",
        f"{r['steps_measured']} steps measured (every {r['measure_every']}; the first {r['warmup_steps']} reported apart) on "
        f"{r['device']}, {r['world_size']} rank(s).", "",
        "| median | p90 | mean |", "|---|---|---|",
        f"| {1e3 * t['median']:.1f} ms | {1e3 * t['p90']:.1f} ms | {1e3 * t['mean']:.1f} ms |", "",
        "## Where it goes", "",
        "| part | share of step time |", "|---|---|",
        *[f"| {name.replace('_', ' ')} | {100 * share:.1f} % |" for name, share in s.items()], "",
        "## Throughput and memory", "",
        f"- {tokens}{th['samples_per_s']:,.1f} samples/s ({th['samples_per_s_per_rank']:,.1f} per rank)",
        f"- peak memory: {r['peak_memory_mb']:,.0f} MiB ({r['memory_kind']})",
    ]
    f = r["flops"]
    if f["tflops_per_device"] is not None:
        mfu = f", MFU {100 * f['mfu']:.1f} % of {f['peak_tflops_per_device']:,.0f} TFLOP/s" if f["mfu"] is not None else ""
        lines.append(f"- model FLOPs: {f['tflops_per_device']:,.4g} TFLOP/s per device{mfu}")
    lines.append(f"- {f['peak_source']}")
    if r["compile_time_s"] is not None:
        lines.append(f"- compile time: {r['compile_time_s']:.2f} s")
    if r["warmup_step_time_s"]:
        lines.append(f"- warm-up steps: {', '.join(f'{x:.3f} s' for x in r['warmup_step_time_s'])}")
    return "\n".join(lines) + "\n"


class _SyncMeasuredSteps(RankZeroCallback[BaseTrainer]):
    """On CUDA: synchronize at the boundaries of the steps `PerformanceReportCallback` measures, so
    its host clocks see device time (deliberate syncs, on measured steps only)."""

    critical = False
    order = 10_000  # last: its pre_train_step sync is right before training_step

    def __init__(self, report: PerformanceReportCallback):
        self.report, self.sync = report, False

    def pre_train_step(self, batch: Any, batch_idx: int) -> None:
        self.sync = (self.trainer.global_step + 1) % self.report.measure_every == 0  # type: ignore[operator]
        if self.sync:
            torch.cuda.synchronize()  # the data wait ends on the device too

    def pre_optimizer_step(self, model: Any, optimizer: Any) -> None:
        if self.sync:
            torch.cuda.synchronize()  # backward done before the optimizer's clock runs

    def post_optimizer_zero_grad(self, model: Any, optimizer: Any) -> None:
        if self.sync:
            torch.cuda.synchronize()  # the update done within the optimizer's time


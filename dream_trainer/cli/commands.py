"""The subcommands of `dream_trainer.cli`: each takes a parsed `Command` and a function
making the user's trainer from a config, and ends with a useful output (rank 0 prints it)."""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dream_trainer.cli import Command, config_json
from dream_trainer.protocol.base import Callback, StopTraining

logger = logging.getLogger(__name__)


def run(command: Command, make_trainer: Callable[[Any], Any]) -> Any:
    if command.print_config:
        print(config_json(command.config))
        return None
    return _RUNNERS[command.name](command, make_trainer)


def _build(command: Command, make_trainer: Callable[[Any], Any], config: Any = None, *, keep_checkpoints: bool = True,
           record: bool = True) -> Any:
    from dream_trainer.callbacks.checkpoint import CheckpointCallback
    from dream_trainer.callbacks.run_record import InitFromCheckpointCallback, RunRecordCallback

    trainer = make_trainer(command.config if config is None else config)
    if not keep_checkpoints and CheckpointCallback in trainer.callbacks:  # a diagnostic run saves and resumes nothing
        trainer.callbacks.remove(CheckpointCallback)
    if record:
        trainer.callbacks.add(RunRecordCallback(command.argv))
    if command.init_from:
        trainer.callbacks.add(InitFromCheckpointCallback(command.init_from))
    return trainer


def _print0(trainer: Any, text: str) -> None:
    if trainer.world.is_rank_zero:
        print(text, flush=True)


def _train(command: Command, make_trainer: Callable[[Any], Any]) -> Any:
    trainer = _build(command, make_trainer)
    trainer.fit()
    return trainer


def _resume(command: Command, make_trainer: Callable[[Any], Any]) -> Any:
    from dream_trainer.callbacks.checkpoint import CheckpointCallback
    from dream_trainer.errors import CheckpointError

    trainer = _build(command, make_trainer)
    if CheckpointCallback not in trainer.callbacks:
        raise CheckpointError(f"resume {command.target}: this trainer has no CheckpointCallback to resume with")
    checkpoints = trainer.callbacks[CheckpointCallback]
    if checkpoints.params.resume_mode is None:
        checkpoints.params = dataclasses.replace(checkpoints.params, resume_mode="last")
    trainer.fit()
    if checkpoints.resumed_from is None:
        raise CheckpointError(f"resume {command.target}: the run has no checkpoint to resume from")
    return trainer


def _profile(command: Command, make_trainer: Callable[[Any], Any]) -> Any:
    from dream_trainer.callbacks.profile import ProfileCallback

    active = command.options["active"]
    config = _with(command.config, training_parameters=_NO_VALIDATION)
    trainer = _build(command, make_trainer, config, keep_checkpoints=False)
    profiler = ProfileCallback(wait=1, warmup=1, active=active, row_limit=25, stop_training=True)
    trainer.callbacks.add(profiler)
    trainer.fit()
    tables = [p for p in profiler.exported if p.name.startswith("key_averages")]
    traces = [p for p in profiler.exported if p.name.endswith(".pt.trace.json")]
    if tables:
        _print0(trainer, tables[0].read_text())
    _print0(trainer, f"profiled {active} steps; trace: {traces[0] if traces else '(none)'}; files in "
                     f"{profiler.output_dir}")
    return trainer


def _graph_breaks(command: Command, make_trainer: Callable[[Any], Any]) -> Any:
    from dream_trainer.callbacks.graph_breaks import FindGraphBreaksCallback

    config = _with(command.config, device_parameters={"compile_model": True}, training_parameters=_NO_VALIDATION)
    trainer = _build(command, make_trainer, config, keep_checkpoints=False)
    finder = FindGraphBreaksCallback(fullgraph=command.options["fullgraph"])
    trainer.callbacks.add(finder)
    trainer.fit()
    report = finder.report or {}
    lines = [f"graph breaks ({report.get('mode', '?')} at step {report.get('step', '?')}):"]
    for region, found in report.get("regions", {}).items():
        if not found.get("ran"):
            lines.append(f"  {region}: not run by the step")
        elif "breaks" in found:
            lines.append(f"  {region}: {found['breaks']} break(s), {found.get('graphs', '?')} graph(s)")
            lines += [f"    - {b['reason']} ({b['file']}:{b['line']})" for b in found.get("break_reasons", [])][:20]
        else:
            lines.append(f"  {region}: {'compiles with fullgraph=True' if found.get('ok') else found.get('error')}")
    _print0(trainer, "\n".join(lines) + f"\nreport: {trainer.run_dir / finder.log_file}")
    return trainer


def _benchmark(command: Command, make_trainer: Callable[[Any], Any]) -> dict[str, Any]:
    """Eager against compiled, `--bench-rounds` rounds, the order alternating: each run trains
    warm-up + timed steps and times the timed ones as one window (`StepWindowCallback`), so
    tokens/s and the step time come from the same span. The speed-up is the median of the
    rounds' compiled / eager; its spread over the rounds says whether it is conclusive."""
    from dream_trainer.callbacks.step_window import StepWindowCallback, spread, verdict

    opts = command.options
    steps, warm, rounds = opts["bench_steps"], opts["bench_warmup"], opts["bench_rounds"]
    for flag, value, lowest in (("--bench-steps", steps, 1), ("--bench-warmup", warm, 1), ("--bench-rounds", rounds, 1)):
        if value < lowest:
            raise ValueError(f"benchmark: {flag} {value} is invalid: expected an int >= {lowest}")
    runs: dict[str, list[dict[str, Any]]] = {"eager": [], "compiled": []}
    trainer = None
    for r in range(rounds):
        for variant in (("eager", "compiled") if r % 2 == 0 else ("compiled", "eager")):
            config = _with(command.config, device_parameters={"compile_model": variant == "compiled"},
                           training_parameters={"max_steps": warm + steps, "n_epochs": None, **_NO_VALIDATION})
            trainer = _build(command, make_trainer, config, keep_checkpoints=False, record=False)
            window = StepWindowCallback(warmup=warm)
            trainer.callbacks.add(window)
            trainer.fit()
            runs[variant].append(window.result())
    assert trainer is not None
    unit = "tokens_per_s" if runs["eager"][0]["tokens_per_s"] else "samples_per_s"
    ratios = [c[unit] / e[unit] for e, c in zip(runs["eager"], runs["compiled"])]
    results: dict[str, Any] = {v: _summary_of(runs[v], unit) for v in runs}
    results.update(speedup=statistics.median(ratios), speedup_rounds=ratios, spread=spread(ratios),
                   verdict=verdict(ratios), steps=steps, warmup=warm, rounds=rounds, unit=unit,
                   device=str(trainer.world.device), world_size=trainer.world.world_size)
    if trainer.world.is_rank_zero:
        out = trainer.run_dir / "benchmark.json"
        out.write_text(json.dumps(results, indent=1))
        print(_benchmark_table(results) + f"\nwritten: {out}", flush=True)
    return results


def _summary_of(runs: list[dict[str, Any]], unit: str) -> dict[str, Any]:
    return {unit: statistics.median(r[unit] for r in runs), "step_time_s": statistics.median(r["step_s"] for r in runs),
            "first_step_s": runs[0]["first_step_s"], "rounds": runs}


def _benchmark_table(r: dict[str, Any]) -> str:
    unit = r["unit"]
    rows = [f"{r['rounds']} round(s) of {r['steps']} timed steps after {r['warmup']} on {r['device']} "
            f"({r['world_size']} rank(s)); medians over rounds:",
            f"{'variant':<10} {unit:>16} {'ms/step':>9} {'first step s':>13}"]
    rows += [f"{v:<10} {r[v][unit]:>16,.1f} {1e3 * r[v]['step_time_s']:>9.2f} {r[v]['first_step_s']:>13.2f}"
             for v in ("eager", "compiled")]
    per_round = " ".join(f"{x:.2f}" for x in r["speedup_rounds"])
    rows.append(f"compiled / eager: {r['speedup']:.2f}x (rounds: {per_round}; spread {100 * r['spread']:.0f} %)")
    if r["verdict"] != "ok":
        rows.append(f"not conclusive: {r['verdict']} (more --bench-steps or --bench-rounds, a quieter machine)")
    return "\n".join(rows)


def _summarize(command: Command, make_trainer: Callable[[Any], Any]) -> dict[str, Any]:
    config = _with(command.config, training_parameters=_NO_VALIDATION)
    trainer = _build(command, make_trainer, config, keep_checkpoints=False, record=False)
    summary = _Summary()
    trainer.callbacks.add(summary)
    trainer.fit()
    _print0(trainer, summary.table)
    return summary.result


class _Summary(Callback[Any]):
    """Reads the built models and optimizers on every rank after `configure`, gathers the
    numbers on rank 0, and stops the run before any step."""

    order = -1000

    def __init__(self) -> None:
        self.result: dict[str, Any] = {}
        self.table = ""

    def post_configure(self) -> None:
        trainer, world = self.trainer, self.trainer.world
        local = trainer_bytes(trainer)
        ranks = world.all_gather_object(local) if world.world_size > 1 else [local]
        full = sum(p.numel() for m in trainer.named_models().values() for p in m.parameters())
        plan = world.plan
        self.result = {
            "parameters": full, "trainable_parameters": local["trainable_full"],
            "flops_per_token": trainer.model_flops_per_token,
            "plan": {"world_size": plan.world_size, "dp_replicate": plan.dp_replicate, "dp_shard": plan.dp_shard,
                     "cp": plan.cp, "tp": plan.tp},
            "gradient_accumulation_steps": trainer.gradient_accumulation_steps, "per_rank": ranks,
        }
        mb = 2**20
        lines = [f"parameters: {full:,} ({local['trainable_full']:,} trainable); FLOPs per token: "
                 f"{trainer.model_flops_per_token or float('nan'):.3g}",
                 "plan: " + ", ".join(f"{k}={v}" for k, v in self.result["plan"].items())
                 + f"; gradient accumulation {trainer.gradient_accumulation_steps}",
                 f"{'rank':>4} {'params':>12} {'params MB':>10} {'grads MB':>9} {'optim MB':>9} {'total MB':>9}"]
        for r, row in enumerate(ranks):
            optim = row["optimizer_bytes"]
            total = row["param_bytes"] + row["grad_bytes"] + (optim or 0)
            lines.append(f"{r:>4} {row['params']:>12,} {row['param_bytes'] / mb:>10.2f} {row['grad_bytes'] / mb:>9.2f} "
                         f"{(optim or float('nan')) / mb:>9.2f} {total / mb:>9.2f}")
        lines.append("(memory: parameters, gradients and optimizer state of each rank's shards; activations not "
                     "included)")
        self.table = "\n".join(lines)
        raise StopTraining("summarized")


_STATE_PER_PARAM = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adagrad": 1, "RMSprop": 1}


def trainer_bytes(trainer: Any) -> dict[str, Any]:
    """This rank's parameters (local shards), their bytes, the gradients' and an estimate
    of the optimizer state's (Adam: two tensors per trained parameter; None: unknown)."""
    params = trainable = trainable_full = param_bytes = grad_bytes = 0
    for model in trainer.named_models().values():
        for p in model.parameters():  # a tied parameter once
            t = p.to_local() if hasattr(p, "to_local") else p
            params += t.numel()
            param_bytes += t.numel() * t.element_size()
            if p.requires_grad:
                trainable += t.numel()
                trainable_full += p.numel()
                grad_bytes += t.numel() * t.element_size()
    optimizer_bytes: int | None = 0
    for opt in trainer.named_optimizers().values():
        per = _STATE_PER_PARAM.get(type(opt).__name__)
        if per is None and isinstance(opt, torch.optim.SGD):
            per = 1 if any(g.get("momentum", 0) for g in opt.param_groups) else 0
        if per is None or optimizer_bytes is None:
            optimizer_bytes = None
            continue
        for group in opt.param_groups:
            for p in group["params"]:
                t = p.to_local() if hasattr(p, "to_local") else p
                optimizer_bytes += per * t.numel() * 4 if p.requires_grad else 0
    return {"params": params, "trainable": trainable, "trainable_full": trainable_full, "param_bytes": param_bytes,
            "grad_bytes": grad_bytes, "optimizer_bytes": optimizer_bytes}


def _export(command: Command, make_trainer: Callable[[Any], Any]) -> Path:
    from dream_trainer.weights_io import export_model

    checkpoint, opts = Path(command.target or ""), command.options
    dtype = getattr(torch, opts["dtype"]) if opts["dtype"] else None
    output = Path(opts["output"]) if opts["output"] else checkpoint / f"{opts['model']}.safetensors"
    path = export_model(checkpoint, output, model=opts["model"], dtype=dtype, trainable_only=opts["trainable_only"])
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
    print(f"exported {len(keys)} tensor(s) of model {opts['model']!r} from {checkpoint} to {path}", flush=True)
    return path


_NO_VALIDATION = {"val_every_n_steps": None, "validate_at_epoch_end": False, "num_sanity_val_steps": 0}


def _with(config: Any, **groups: dict[str, Any]) -> Any:
    """`config` with fields of its parameter groups replaced (validated again)."""
    return dataclasses.replace(config, **{g: dataclasses.replace(getattr(config, g), **v) for g, v in groups.items()})


_RUNNERS: dict[str, Callable[[Command, Callable[[Any], Any]], Any]] = {
    "train": _train, "resume": _resume, "profile": _profile, "find-graph-breaks": _graph_breaks,
    "benchmark": _benchmark, "summarize": _summarize, "export": _export,
}

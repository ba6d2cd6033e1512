"""The subcommands of `dream_trainer.cli`: each takes a parsed `Command` and a function
making the user's trainer from a config, and ends with a useful output (rank 0 prints it)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch

from dream_trainer.cli import Command, config_json
from dream_trainer.protocol.base import Callback, StopTraining

logger = logging.getLogger(__name__)


_INSTALL = {"wandb": "wandb", "mlflow": "mlflow", "torchft": "torchft", "safetensors": "safetensors",
            "yaml": "pyyaml", "tomli": "tomli", "tensorboard": "tensorboard", "tabulate": "tabulate"}
"""Optional packages the subcommands may import: module → what ``pip install`` takes."""


def run(command: Command, make_trainer: Callable[[Any], Any]) -> Any:
    if command.print_config:
        print(config_json(command.config))
        return None
    try:
        return _RUNNERS[command.name](command, make_trainer)
    except ImportError as exc:
        line = _missing_package(exc)
        if line is None:
            raise
        _usage_error(line)


def _missing_package(exc: ImportError) -> str | None:
    """One line for an optional package that is not installed (its name and the install
    command), or None for another import error."""
    root = (getattr(exc, "name", None) or "").split(".")[0]
    if isinstance(exc, ModuleNotFoundError) and root in _INSTALL:
        return f"{root} is not installed, and this run needs it: pip install {_INSTALL[root]}"
    text = str(exc)
    if "pip install" in text and "not installed" in text:
        return text.splitlines()[0]
    return None


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
    if trainer.global_step == _step_of(checkpoints.resumed_from):  # nothing left to train
        _print0(trainer, _finished(command, trainer))
    return trainer


def _step_of(checkpoint: Path) -> int | None:
    digits = "".join(c for c in Path(checkpoint).name if c.isdigit())
    return int(digits) if digits else None


def _finished(command: Command, trainer: Any) -> str:
    """What ``resume`` of a run that has reached its end says: that, and how to extend it."""
    params, step = trainer.config.training_parameters, trainer.global_step
    flag = "--training_parameters.max_steps"
    if params.max_steps is not None and step >= params.max_steps:
        short = next((a for a, target in command.aliases.items() if target == flag), flag)
        how = f"raise its max_steps: resume {command.target} {short} {max(2 * step, step + 1)}"
        limit = f"its max_steps ({params.max_steps})"
    else:
        flag = "--training_parameters.n_epochs"
        short = next((a for a, target in command.aliases.items() if target == flag), flag)
        how = f"raise its n_epochs: resume {command.target} {short} {(params.n_epochs or 0) + 1}"
        limit = f"its n_epochs ({params.n_epochs})"
    return f"run {command.target} is finished: it stopped at step {step}, {limit}; nothing was trained. To " \
           f"train it further, {how}"


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
    _print0(trainer, "\n".join(lines) + f"\nreport: {report_path(trainer.run_dir, finder.log_file)}")
    return trainer


def report_path(run_dir: str | Path, log_file: str | Path) -> Path:
    """Where a diagnostic callback's `log_file` is: as it is when absolute or already under
    `run_dir` (the callback resolves it when it writes), else under `run_dir`."""
    run_dir, log_file = Path(run_dir), Path(log_file)
    if log_file.is_absolute() or log_file.parts[: len(run_dir.parts)] == run_dir.parts:
        return log_file
    return run_dir / log_file


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
    """The summary of the launch's mesh; with ``--world-size``/``--local-world-size`` other
    than the launch's, of that mesh, planned without launching (`_summarize_planned`)."""
    config = _with(command.config, training_parameters=_NO_VALIDATION)
    planned = _planned_world(command)
    if planned is not None:
        return _summarize_planned(command, make_trainer, config, *planned)
    trainer = _build(command, make_trainer, config, keep_checkpoints=False, record=False)
    summary = _Summary()
    trainer.callbacks.add(summary)
    trainer.fit()
    _print0(trainer, summary.table)
    return summary.result


def _planned_world(command: Command) -> tuple[int, int | None] | None:
    """``(world size, ranks per node)`` to plan for, or None: the launch's own."""
    world_size, local = command.options.get("world_size"), command.options.get("local_world_size")
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size is None and local is None:
        return None
    for flag, value in (("--world-size", world_size), ("--local-world-size", local)):
        if value is not None and value < 1:
            _usage_error(f"summarize {flag} {value}: expected an int >= 1")
    world_size = world_size or launched
    if world_size == launched and local in (None, int(os.environ.get("LOCAL_WORLD_SIZE", launched))):
        return None
    if launched > 1:
        _usage_error(f"summarize --world-size {world_size}: a plan for another world is made in one process; "
                     "run it without --nproc or torchrun")
    return world_size, local


def _summarize_planned(command: Command, make_trainer: Callable[[Any], Any], config: Any, world_size: int,
                       local: int | None) -> dict[str, Any]:
    """Plan the mesh for `world_size` ranks (`plan_mesh`: every dimension, pp included),
    build the model in this one process, and estimate each rank's share: the full model
    split evenly over the dimensions that split it (dp_shard x cp x tp x pp)."""
    from dream_trainer.world import MeshPlanError, plan_mesh

    try:
        plan = plan_mesh(config.device_parameters, world_size, local)
    except MeshPlanError as exc:
        _usage_error(f"summarize --world-size {world_size}: {exc}")
    single = _with(config, device_parameters={"dp_replicate": 1, "dp_shard": 1, "context_parallel": 1,
                                              "tensor_parallel": 1, "pipeline_parallel": 1, "compile_model": False})
    trainer = _build(command, make_trainer, single, keep_checkpoints=False, record=False)
    summary = _Summary()
    trainer.callbacks.add(summary)
    trainer.fit()
    split = plan.dp_shard * plan.cp * plan.tp * plan.pp
    whole = summary.result["per_rank"][0]
    each = {k: (v if k == "trainable_full" or v is None else -(-v // split)) for k, v in whole.items()}
    result = {**summary.result, "plan": _plan_dict(plan), "per_rank": [each], "estimated": True,
              "gradient_accumulation_steps": _accumulation(config.training_parameters, plan.dp)}
    table = _table(result, f"(estimate for each of {world_size} ranks, planned in one process: the model split "
                           f"evenly over dp_shard x cp x tp x pp = {split}; the real split follows the layers)")
    _print0(trainer, table)
    return result


def _accumulation(params: Any, dp: int) -> int | str:
    """Micro-batches per optimizer step on `dp` data-parallel ranks (as the launch derives it)."""
    if params.global_batch_size is None:
        return params.gradient_accumulation_steps
    micro = params.micro_batch_size or params.global_batch_size // dp
    if micro < 1 or params.global_batch_size % (dp * micro):
        return f"none: global_batch_size {params.global_batch_size} does not split over {dp} data-parallel ranks"
    return params.global_batch_size // (dp * micro)


def _usage_error(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _plan_dict(plan: Any) -> dict[str, int]:
    return {"world_size": plan.world_size, "pp": plan.pp, "dp_replicate": plan.dp_replicate,
            "dp_shard": plan.dp_shard, "cp": plan.cp, "tp": plan.tp}


def _table(result: dict[str, Any], note: str = "") -> str:
    mb = 2**20
    lines = [f"parameters: {result['parameters']:,} ({result['trainable_parameters']:,} trainable); FLOPs per "
             f"token: {result['flops_per_token'] or float('nan'):.3g}",
             "plan: " + ", ".join(f"{k}={v}" for k, v in result["plan"].items())
             + f"; gradient accumulation {result['gradient_accumulation_steps']}",
             f"{'rank':>4} {'params':>12} {'params MB':>10} {'grads MB':>9} {'optim MB':>9} {'total MB':>9}"]
    for r, row in enumerate(result["per_rank"]):
        optim = row["optimizer_bytes"]
        total = row["param_bytes"] + row["grad_bytes"] + (optim or 0)
        name = "each" if result.get("estimated") else str(r)
        lines.append(f"{name:>4} {row['params']:>12,} {row['param_bytes'] / mb:>10.2f} {row['grad_bytes'] / mb:>9.2f} "
                     f"{(optim or float('nan')) / mb:>9.2f} {total / mb:>9.2f}")
    lines.append("(memory: parameters, gradients and optimizer state of each rank's shards; activations not "
                 "included)")
    return "\n".join(lines + ([note] if note else []))


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
        self.result = {
            "parameters": full, "trainable_parameters": local["trainable_full"],
            "flops_per_token": trainer.model_flops_per_token, "plan": _plan_dict(world.plan),
            "gradient_accumulation_steps": trainer.gradient_accumulation_steps, "per_rank": ranks,
        }
        self.table = _table(self.result)
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

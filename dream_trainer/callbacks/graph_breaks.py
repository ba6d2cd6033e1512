"""`FindGraphBreaksCallback`: where ``torch.compile`` breaks the graph, per compiled region,
with the reason and the user's file:line, from the run's real inputs."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from dream_trainer.protocol.base import Callback
from dream_trainer.protocol.trainers import Accumulates, Counters, InWorld, Logs, Models, RunDirectory, Stops

logger = logging.getLogger(__name__)


@runtime_checkable
class GraphBreakTrainer(Accumulates, Counters, InWorld, Logs, Models, RunDirectory, Stops, Protocol):
    """What `FindGraphBreaksCallback` needs of a trainer (any trainer with these pieces)."""


class FindGraphBreaksCallback(Callback[GraphBreakTrainer]):
    """Find the graph breaks of every compiled region, with the inputs a real step gives it.

    After `skip` optimizer steps, the next training step records the inputs of each region:
    the regions the trainer compiled (``trainer.compiled_modules``: what `apply_compile`
    compiled), or each model when nothing was compiled. After that step, each region's
    ``forward`` is analysed with ``torch._dynamo.explain`` on those inputs: the number of
    graphs, and every graph break with its reason and the user's file:line. With
    ``fullgraph=True`` each region is instead compiled with ``torch.compile(fullgraph=True,
    backend=backend)`` and run once: the regions that fail are reported with the error.

    The report is written to `log_file` (text) and next to it as JSON (same name, ``.json``),
    kept as ``self.report`` and logged as ``graph_breaks/<region>`` counts. Then the run ends
    with `StopTraining` (``stop=False``: training goes on). Nothing is patched: the model and
    ``torch.compile`` are as before (the analysis resets dynamo's caches, so compiled regions
    compile again if training goes on). Sharded (FSDP2) regions are unsharded for the
    analysis and resharded after. Rank 0 writes the files; every rank analyses (the same
    model, so the same report) and stops at the same step.
    """

    def __init__(self, log_file: str | Path = "graph_breaks.txt", skip: int = 0, fullgraph: bool = False,
                 stop: bool = True, backend: str = "eager"):
        if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
            raise ValueError(f"FindGraphBreaksCallback(skip={skip!r}) is invalid: expected an int >= 0")
        self.log_file, self.skip, self.fullgraph, self.stop, self.backend = Path(log_file), skip, fullgraph, stop, backend
        self.report: dict[str, Any] | None = None
        self._inputs: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        self._hooks: list[Any] = []

    def _regions(self) -> dict[str, nn.Module]:
        compiled = getattr(self.trainer, "compiled_modules", {})
        if compiled:
            return {name: entry.module for name, entry in compiled.items()}
        return dict(self.trainer.named_models())

    def pre_train_step(self, batch: Any, batch_idx: int) -> None:
        if self.report is not None or self._hooks or self.trainer.global_step < self.skip:
            return
        for name, module in self._regions().items():
            self._hooks.append(module.register_forward_pre_hook(self._capture(name), with_kwargs=True))

    def _capture(self, name: str) -> Any:
        import torch._dynamo

        @torch._dynamo.disable  # runs eagerly, also inside a compiled region's call
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if name not in self._inputs:  # the first call of the step
                detach = lambda x: x.detach() if isinstance(x, torch.Tensor) else x  # noqa: E731
                self._inputs[name] = (tuple(detach(a) for a in args), {k: detach(v) for k, v in kwargs.items()})

        return hook

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        if not self._hooks or self.trainer.is_accumulating_gradients:
            return
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        regions = self._regions()
        analyse = self._fullgraph if self.fullgraph else self._explain
        self.report = {"mode": "fullgraph" if self.fullgraph else "explain", "step": self.trainer.global_step,
                       "regions": {}}
        for name, module in regions.items():
            if name not in self._inputs:
                self.report["regions"][name] = {"ran": False}
                continue
            args, kwargs = self._inputs[name]
            with _unsharded(module):
                self.report["regions"][name] = {"ran": True, **analyse(module, args, kwargs)}
        self._inputs = {}
        self._write()
        counts = {f"graph_breaks/{n}": r.get("breaks", int(not r.get("ok", True))) for n, r in self.report["regions"].items() if r["ran"]}
        if counts:
            self.trainer.log_dict(counts)
        if self.stop:
            self.trainer.request_stop(f"graph breaks reported in {self.log_file}")

    # ------------------------------------------------------------------ analyses
    def _explain(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        import torch._dynamo

        torch._dynamo.reset()
        out = torch._dynamo.explain(module.forward)(*args, **kwargs)
        torch._dynamo.reset()
        breaks, seen = [], set()
        for reason in out.break_reasons:
            frame = reason.user_stack[-1] if reason.user_stack else None
            entry = {
                "reason": reason.reason.strip().splitlines()[0],
                "detail": reason.reason.strip(),
                "file": frame.filename if frame else None,
                "line": frame.lineno if frame else None,
                "code": (frame.line or "").strip() if frame else None,
            }
            key = (entry["reason"], entry["file"], entry["line"])
            if key not in seen:
                seen.add(key)
                breaks.append(entry)
        return {"graphs": out.graph_count, "breaks": len(breaks), "break_reasons": breaks}

    def _fullgraph(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        import torch._dynamo

        torch._dynamo.reset()
        try:
            torch.compile(module.forward, fullgraph=True, backend=self.backend)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the failure is the finding
            return {"ok": False, "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
                    "detail": str(exc).strip()}
        finally:
            torch._dynamo.reset()
        return {"ok": True}

    # ------------------------------------------------------------------ report
    def _write(self) -> None:
        assert self.report is not None
        lines = [f"graph breaks at step {self.report['step']} ({self.report['mode']})", ""]
        for name, region in self.report["regions"].items():
            if not region["ran"]:
                lines.append(f"{name}: did not run in the step")
            elif self.fullgraph:
                lines.append(f"{name}: {'compiles with fullgraph=True' if region['ok'] else 'FAILS: ' + region['error']}")
            else:
                lines.append(f"{name}: {region['graphs']} graph(s), {region['breaks']} break(s)")
                for b in region["break_reasons"]:
                    lines.append(f"  {b['file']}:{b['line']}: {b['reason']}" + (f"\n      {b['code']}" if b["code"] else ""))
        text = "\n".join(lines) + "\n"
        logger.info("%s", text)
        if self.trainer.world.rank != 0:
            return
        if not self.log_file.is_absolute():
            self.log_file = Path(self.trainer.run_dir) / self.log_file
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        self.log_file.write_text(text)
        self.log_file.with_suffix(".json").write_text(json.dumps(self.report, indent=1))


class _unsharded:
    """An FSDP2 module's parameters gathered for the analysis, resharded after."""

    def __init__(self, module: nn.Module):
        from torch.distributed.fsdp import FSDPModule

        self.module = module if isinstance(module, FSDPModule) else None

    def __enter__(self) -> None:
        if self.module is not None:
            self.module.unshard()

    def __exit__(self, *exc: Any) -> None:
        if self.module is not None:
            self.module.reshard()

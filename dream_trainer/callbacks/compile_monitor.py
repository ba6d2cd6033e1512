"""`CompileMonitorCallback`: compile time, compiles and recompiles per compiled region, and graph
breaks, from dynamo's compile events."""

from __future__ import annotations

import logging
import re
import sys
import time
from typing import Any

from torch import nn

from dream_trainer.protocol.base import Callback
from dream_trainer.trainer.dream import DreamTrainer

logger = logging.getLogger(__name__)

_RECOMPILE_LOGGER = "torch._dynamo.guards.__recompiles"
_RECOMPILING = re.compile(r"Recompiling function (\S+) in (.+):(\d+)")


class CompileMonitorCallback(Callback[DreamTrainer]):
    """Watch ``torch.compile`` work on the trainer's compiled regions.

    Dynamo's compile-start/-end events (``torch._dynamo.callback``) are attributed to the
    region being called (``trainer.compiled_modules``; each model when nothing was compiled,
    for a model compiled elsewhere). Per region: the compile time, the graphs compiled
    (after a graph break the rest of a function is a graph of its own) and the recompiles
    (a guard failed: new shapes, dtypes, a Python value). On the trainer's log steps it logs
    ``compile/time_s``, ``compile/recompiles`` and ``compile/graph_breaks`` (total) and
    ``compile/<region>/time_s`` / ``.../recompiles``; the totals also go to
    ``self.summary()``. When a region has recompiled `warn_after` times (and again at each
    doubling) it warns, with the guard failures when torch logs them (run with
    ``TORCH_LOGS=recompiles``). No device syncs, no per-step cost beyond the events.
    """

    critical = False

    def __init__(self, warn_after: int = 4):
        if isinstance(warn_after, bool) or not isinstance(warn_after, int) or warn_after < 1:
            raise ValueError(f"CompileMonitorCallback(warn_after={warn_after!r}) is invalid: expected an int >= 1")
        self.warn_after = warn_after
        self.regions: dict[str, dict[str, Any]] = {}
        self._by_module: dict[int, str] = {}
        self._open: dict[str, tuple[float, str | None]] = {}
        self._reasons: list[str] = []
        self._handler: logging.Handler | None = None
        self._installed = False
        self._counters: Any = None  # dynamo's counters (graph breaks), once set up
        self._breaks_at_start = 0

    # ------------------------------------------------------------------ lifecycle
    def post_setup(self) -> None:
        trainer = self.trainer
        compiled = trainer.compiled_modules or {name: None for name in trainer.named_models()}
        for name in compiled:
            module = compiled[name].module if compiled[name] is not None else trainer.named_models()[name]
            self._by_module[id(module)] = name
            self.regions[name] = {"time_s": 0.0, "graphs": 0, "recompiles": 0, "reasons": [], "_warned_at": 0,
                                  "_code": _code_of(module)}
        import torch._dynamo.callback as dynamo_callback
        from torch._dynamo.utils import counters

        self._counters = counters
        self._breaks_at_start = sum(counters["graph_break"].values())
        dynamo_callback.callback_handler.register_start_callback(self._started)
        dynamo_callback.callback_handler.register_end_callback(self._ended)
        self._handler = _Collect(self._reasons)
        logging.getLogger(_RECOMPILE_LOGGER).addHandler(self._handler)
        self._installed = True

    def on_teardown(self, status: str) -> None:
        if not self._installed:
            return
        import torch._dynamo.callback as dynamo_callback

        handler = dynamo_callback.callback_handler
        for fn, registered, remove in ((self._started, handler.start_callbacks, handler.remove_start_callback),
                                       (self._ended, handler.end_callbacks, handler.remove_end_callback)):
            if fn in registered:  # torch._dynamo.reset() (graph-break finding) may have cleared them
                remove(fn)
        logging.getLogger(_RECOMPILE_LOGGER).removeHandler(self._handler)  # type: ignore[arg-type]
        self._installed = False

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        trainer = self.trainer
        if trainer.is_accumulating_gradients or trainer.global_step % trainer.logging_parameters.log_every_n_steps:
            return
        summary = self.summary()
        metrics = {"compile/time_s": summary["time_s"], "compile/recompiles": summary["recompiles"],
                   "compile/graph_breaks": summary["graph_breaks"]}
        for name, region in self.regions.items():
            metrics[f"compile/{name}/time_s"] = region["time_s"]
            metrics[f"compile/{name}/recompiles"] = region["recompiles"]
        trainer.log_dict(metrics)

    def summary(self) -> dict[str, Any]:
        """Totals, and per region: compile time (s), graphs, recompiles and their reasons."""
        return {
            "time_s": sum(r["time_s"] for r in self.regions.values()),
            "recompiles": sum(r["recompiles"] for r in self.regions.values()),
            "graph_breaks": sum(self._counters["graph_break"].values()) - self._breaks_at_start if self._counters else 0,
            "regions": {n: {k: v for k, v in r.items() if not k.startswith("_")} for n, r in self.regions.items()},
        }

    # ------------------------------------------------------------------ dynamo events
    def _started(self, args: Any) -> None:
        region = self._calling_region()
        self._open[str(args.compile_id)] = (time.perf_counter(), region)

    def _ended(self, args: Any) -> None:
        started, region = self._open.pop(str(args.compile_id), (None, None))
        if started is None or region is None:
            return
        entry, seconds = self.regions[region], time.perf_counter() - started
        entry["time_s"] += seconds
        self.trainer.build.add_compile_time(region, seconds)  # the trainer's record: what reports read
        self.trainer.goodput.add("compile", seconds)  # the ledger: out of the step (or validation) it ran in
        first = entry["graphs"] == 0  # regions sharing one forward share dynamo's frame: not a recompile
        entry["graphs"] += 1
        frame_compile = str(args.compile_id).split("/")[-1].split("]")[0]
        if not first and frame_compile.isdigit() and int(frame_compile) > 0:  # "frame/compile": a recompile
            entry["recompiles"] += 1
            entry["reasons"].extend(self._take_reasons(entry["_code"]))
            if entry["recompiles"] >= max(self.warn_after, 2 * entry["_warned_at"]):
                entry["_warned_at"] = entry["recompiles"]
                logger.warning(
                    "compiled region %r recompiled %d times (each recompile costs a compile; look for changing "
                    "shapes, dtypes or Python values)%s", region, entry["recompiles"],
                    (": latest guard failures:\n" + entry["reasons"][-1]) if entry["reasons"] else
                    " (run with TORCH_LOGS=recompiles to see why)",
                )

    def _calling_region(self) -> str | None:
        """The region whose call triggered this compile: the innermost frame on the stack
        running a region module's ``__call__``."""
        frame = sys._getframe(1)
        while frame is not None:
            module = frame.f_locals.get("self")
            if isinstance(module, nn.Module) and id(module) in self._by_module:
                return self._by_module[id(module)]
            frame = frame.f_back  # type: ignore[assignment]
        return None

    def _take_reasons(self, code: tuple[str, int] | None) -> list[str]:
        mine = []
        for reason in list(self._reasons):
            match = _RECOMPILING.search(reason)
            if code is None or (match and match.group(2) == code[0] and int(match.group(3)) == code[1]):
                mine.append(reason)
                self._reasons.remove(reason)
        return mine


class _Collect(logging.Handler):
    def __init__(self, into: list[str]):
        super().__init__(logging.DEBUG)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


def _code_of(module: nn.Module) -> tuple[str, int] | None:
    code = getattr(type(module).forward, "__code__", None)
    return (code.co_filename, code.co_firstlineno) if code is not None else None


"""`BuildRecord`: what was done to a trainer's models — the regions compiled, the modules
sharded, the models converted to float8 — and the compile time measured while training. A
component of `DreamTrainer` (``trainer.build``) with no trainer in it: the build sequence
and the plug-ins that change or measure the models record here through its methods, and
readers (`CompileMonitorCallback`, `FindGraphBreaksCallback`, `PerformanceReportCallback`, an
``apply_tensor_parallel`` choosing float8 styles) read it. No plug-in reads or writes
another's fields to learn these facts.

Facts about the built models, made again by every run's `configure`: nothing here goes into
a checkpoint.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from torch import nn


class CompiledModule(NamedTuple):
    """What `BuildRecord.compiled` records for each compiled region."""

    module: nn.Module
    """The module as written (its ``forward`` is what ``torch.compile`` traces)."""
    options: dict[str, Any] | None
    """The ``torch.compile`` options it was compiled with (None: compiled outside
    `DreamTrainer.compile_module`, options unknown)."""


class BuildRecord:
    """What was compiled, sharded and converted, and the compile time measured.

    Attributes:
        compiled: the compiled regions, ``{"<model>.<submodule path>": CompiledModule}`` in
            module order (empty when nothing was compiled).
        sharded: per model name, the modules ``fully_shard`` was applied to,
            ``{submodule path: module}`` in module order, the root (``""``) first.
        float8: ``{model name: recipe}`` of the models converted to float8 training.
        compile_time_s: per compiled region, the seconds spent compiling it so far, as
            measured by whoever measures it (`CompileMonitorCallback`); empty when nobody does.
    """

    def __init__(self) -> None:
        self.compiled: dict[str, CompiledModule] = {}
        self.sharded: dict[str, dict[str, nn.Module]] = {}
        self.float8: dict[str, str] = {}
        self.compile_time_s: dict[str, float] = {}
        self._compile_options: dict[int, dict[str, Any]] = {}  # id(module) -> options (compile_module)

    def compile_options(self, module: nn.Module, options: dict[str, Any]) -> None:
        """Remember the options `module` is being compiled with (for `compiled`)."""
        self._compile_options[id(module)] = dict(options)

    def record_compiled(self, models: dict[str, nn.Module]) -> None:
        """Find the compiled regions of `models`: ``torch.compile(module)`` assigned back, or
        ``module.compile()``."""
        from torch._dynamo.eval_frame import OptimizedModule

        self.compiled = {}
        for model_name, model in models.items():
            for path, module in model.named_modules():
                name = f"{model_name}.{path}" if path else model_name
                if isinstance(module, OptimizedModule):
                    self.compiled[name] = CompiledModule(module._orig_mod, None)
                elif getattr(module, "_compiled_call_impl", None) is not None:
                    self.compiled[name] = CompiledModule(module, self._compile_options.get(id(module)))

    def record_sharded(self, models: dict[str, nn.Module]) -> None:
        """Find the modules of `models` that ``fully_shard`` was applied to."""
        from torch.distributed.fsdp import FSDPModule

        self.sharded = {
            model_name: {path: m for path, m in model.named_modules() if isinstance(m, FSDPModule)}
            for model_name, model in models.items()
        }

    def record_float8(self, model: str, recipe: str) -> None:
        """`model` trains in float8 with `recipe` (what `Fp8QuantizationCallback` converted)."""
        if not isinstance(model, str) or not isinstance(recipe, str):
            raise TypeError(f"record_float8 takes a model name and a recipe name, got {model!r}, {recipe!r}")
        self.float8[model] = recipe

    def add_compile_time(self, region: str, seconds: float) -> None:
        """Add `seconds` of compiling to `region`'s total."""
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not math.isfinite(seconds) \
                or seconds < 0:
            raise ValueError(f"add_compile_time({region!r}, {seconds!r}): expected seconds >= 0")
        self.compile_time_s[region] = self.compile_time_s.get(region, 0.0) + float(seconds)

    @property
    def total_compile_time_s(self) -> float | None:
        """The compile time measured over every region; None when nobody measured it."""
        return sum(self.compile_time_s.values()) if self.compile_time_s else None

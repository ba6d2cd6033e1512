"""`Fp8QuantizationCallback`: float8 training with torchao, as a callback.

Needs ``torchao`` (``pip install dream-trainer[fp8]``), imported only when the callback is
used.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dream_trainer.callbacks._fp8 import Float8Hardware, float8_hardware, other_matmul_modules, summary, torchao_config
from dream_trainer.protocol.base import Callback
from dream_trainer.trainer.dream import DreamTrainer

logger = logging.getLogger(__name__)

ModuleFilter = Callable[[nn.Module, str], bool]

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
"""torchao's float8 training recipes (``Float8LinearRecipeName``)."""

_DELAYED = ("amax_history_len", "amax_compute_algo", "scaling_type_input", "scaling_type_weight",
            "scaling_type_grad_output", "delayed_scaling")
_HEAD_NAMES = ("lm_head", "head", "output", "classifier", "output_projection")


class Fp8QuantizationCallback(Callback[DreamTrainer]):
    """Train the chosen models' ``nn.Linear`` layers in float8 (torchao
    ``convert_to_float8_training``).

    The conversion happens in `post_configure_models`: on the meta device, before tensor
    parallel, activation checkpointing, ``torch.compile`` and ``fully_shard`` (compiling is
    the recommended way to run float8; it works without). Per model a recipe:
    ``"tensorwise"`` (one scale per tensor), ``"rowwise"`` or ``"rowwise_with_gw_hp"``.

    Which layers: the default filter skips a layer whose ``in_features`` or ``out_features``
    is not a multiple of 16 (float8 matmuls need it), the output head (a module named like
    ``lm_head``/``head``/``output``/``classifier``, else the model's last ``nn.Linear``: its
    logits are precision-sensitive) and layers with fewer than `min_elements` weights (the
    casts cost more than they save). It is combined (all must agree) with `module_filter_fn`
    and, per model, with the trainer's ``quantize_module_filters()`` if it has one
    (``{model name: filter(module, fqn) -> bool}``; a filter's ``validate()`` is called after
    the conversion). Only ``nn.Linear`` layers convert: other modules with a 2-D weight
    (GPT-2's ``Conv1D``) are listed as skipped, and a model with no layer converted is said to
    have "0 layers converted" and why, is not in ``trainer.float8`` and trains in high
    precision. The converted and skipped layers are kept in ``self.converted`` /
    ``self.skipped``; a summary per model is logged and, on rank 0, printed (`display`;
    a warning when nothing converted), so it shows without any logging set up.

    With FSDP2 (``dp_shard > 1``) and the tensorwise recipe, weights are all-gathered in
    float8 and their scales are precomputed for the next step after every optimizer step
    (``precompute_float8_dynamic_scale_for_fsdp``, in `post_optimizer_step`).
    ``trainer.float8`` tells which models are float8 and how (``{model: recipe}``), so an
    ``apply_tensor_parallel`` can use torchao's float8 TP styles.

    Float8 matmuls are native on NVIDIA GPUs of compute capability 8.9+ and AMD MI300/MI350.
    Elsewhere (CPUs, older GPUs) the callback sets torchao's emulation (``emulate=True``:
    float8 casts and scales, float32 matmuls): it trains, slower, and says so once. Other
    devices (``mps``) are refused when the models are configured. ``self.hardware`` holds the
    decision (`Float8Hardware`). Converted models checkpoint and
    resume like any other (the weights stay in high precision); ``export_model`` writes them
    as a plain ``state_dict`` that loads into the unconverted model.

    `fast_accum` (off by default, as in torchao's recipes) runs the backward's two matmuls
    (gradient of the input, of the weight) with the float8 GEMM's fast accumulation too, not
    only the forward's: faster on Hopper, with less precise gradient sums (see the docs'
    float8 page for what it buys).

    dream-trainer's ``Fp8QuantizationCallback(enabled=True)`` is accepted. Delayed scaling
    (``amax_history_len=``, ``amax_compute_algo=``) no longer exists in torchao: passing it
    is an error that names the recipe to use instead.
    """

    def __init__(
        self,
        model_to_recipe: dict[str, str] | str | None = None,
        module_filter_fn: ModuleFilter | None = None,
        *,
        enabled: bool = True,
        min_elements: int = 4096,
        fsdp_float8_all_gather: bool = True,
        fast_accum: bool = False,
        display: bool = True,
        **legacy: Any,
    ):
        delayed = sorted(set(legacy) & set(_DELAYED))
        if delayed:
            raise TypeError(
                f"Fp8QuantizationCallback({', '.join(f'{k}=' for k in delayed)}...): delayed scaling was removed from torchao; "
                "use the dynamic 'tensorwise' recipe (the closest), or 'rowwise'"
            )
        if legacy:
            raise TypeError(f"Fp8QuantizationCallback got unexpected argument(s) {sorted(legacy)}")
        for flag, value in (("enabled", enabled), ("display", display), ("fast_accum", fast_accum)):
            if not isinstance(value, bool):
                raise TypeError(f"Fp8QuantizationCallback({flag}={value!r}): expected True or False")
        if isinstance(model_to_recipe, dict):
            self.model_to_recipe: dict[str, str] | None = dict(model_to_recipe)
            self.default_recipe = "tensorwise"
        elif model_to_recipe is None or isinstance(model_to_recipe, str):
            self.model_to_recipe, self.default_recipe = None, model_to_recipe or "tensorwise"
        else:
            raise TypeError(
                f"Fp8QuantizationCallback(model_to_recipe={model_to_recipe!r}): expected {{model name: recipe}}, a recipe "
                "for every model, or None"
            )
        for recipe in [*(self.model_to_recipe or {}).values(), self.default_recipe]:
            if recipe not in RECIPES:
                raise ValueError(f"Fp8QuantizationCallback: recipe {recipe!r} is not one of {list(RECIPES)}")
        self.module_filter_fn, self.enabled, self.min_elements = module_filter_fn, enabled, min_elements
        self.fsdp_float8_all_gather, self.display, self.fast_accum = fsdp_float8_all_gather, display, fast_accum
        self.hardware: Float8Hardware | None = None
        self.converted: dict[str, list[str]] = {}
        self.skipped: dict[str, dict[str, str]] = {}
        self._precompute: list[nn.Module] = []

    # ------------------------------------------------------------------ conversion
    def post_configure_models(self, models: dict[str, nn.Module]) -> None:
        if not self.enabled:
            logger.info("Fp8QuantizationCallback(enabled=False): no model is converted")
            return
        recipes = self.model_to_recipe if self.model_to_recipe is not None else {n: self.default_recipe for n in models}
        unknown = sorted(set(recipes) - set(models))
        if unknown:
            raise KeyError(f"Fp8QuantizationCallback: no model named {unknown}; the trainer has {sorted(models)}")
        trainer = self.trainer
        self.hardware = float8_hardware(trainer.world.device)  # refuses a device torchao's float8 cannot run on
        _quiet_torchao()
        trainer_filters = trainer.quantize_module_filters() if callable(getattr(trainer, "quantize_module_filters", None)) else {}
        for name, recipe in recipes.items():
            filters = [f for f in (self.module_filter_fn, trainer_filters.get(name)) if f is not None]
            self._convert(name, recipe, models[name], filters, self.hardware)
        if not self.hardware.native and any(self.converted.values()) and trainer.world.is_rank_zero:
            logger.warning(
                "Fp8QuantizationCallback: %s has no float8 matmul, so torchao emulates it (Float8LinearConfig(emulate=True)): "
                "the converted layers round their matmul inputs to float8 with the recipe's scales, as float8 hardware "
                "does, and multiply in float32. It trains with float8 numerics but slower than without float8; the "
                "speedup needs an NVIDIA GPU of compute capability 8.9+ (Ada, H100, H200, B200) or an AMD MI300/MI350",
                self.hardware.name,
            )

    def _convert(self, name: str, recipe: str, model: nn.Module, filters: list[ModuleFilter],
                 hardware: Float8Hardware) -> None:
        """Convert one model, record what was and was not converted, and report it."""
        from torchao.float8 import convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear

        trainer, head = self.trainer, _output_head(model)
        skipped: dict[str, str] = {}

        def keep(module: nn.Module, fqn: str) -> bool:
            if not isinstance(module, nn.Linear):
                return False
            reason = self._default_reason(module, fqn, head)
            if reason is None and not all(f(module, fqn) for f in filters):
                reason = "excluded by a filter"
            if reason is not None:
                skipped[fqn] = reason
            return reason is None

        n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
        all_gather = trainer.world.plan.dp_shard > 1 and recipe == "tensorwise" and self.fsdp_float8_all_gather
        config = torchao_config(recipe, emulate=not hardware.native, fsdp_float8_all_gather=all_gather,
                                fast_accum=self.fast_accum)
        converted = convert_to_float8_training(model, module_filter_fn=keep, config=config)
        if converted is not model:
            trainer.replace_model(name, converted)
        for f in filters:
            if callable(getattr(f, "validate", None)):
                f.validate()  # type: ignore[union-attr]
        for fqn, kind in other_matmul_modules(converted).items():
            skipped[fqn] = f"{kind}, not an nn.Linear: torchao converts only nn.Linear"
        self.converted[name] = [fqn for fqn, m in converted.named_modules() if isinstance(m, Float8Linear)]
        self.skipped[name] = skipped
        if self.converted[name]:  # only a model with float8 layers is float8 (TP styles, scale precompute)
            trainer.build.record_float8(name, recipe)
            if all_gather:
                self._precompute.append(converted)
        how = ("native float8 matmuls" if hardware.native else "float8 matmuls emulated") + (
            ", float8 all-gather" if all_gather else "")
        self._report(summary(name, recipe, self.converted[name], skipped, n_linear, how), bool(self.converted[name]))

    def _default_reason(self, module: nn.Linear, fqn: str, head: str | None) -> str | None:
        if module.in_features % 16 or module.out_features % 16:
            return f"dimensions {module.in_features}x{module.out_features} are not multiples of 16"
        if fqn == head:
            return "the output head"
        if module.in_features * module.out_features < self.min_elements:
            return f"tiny ({module.in_features * module.out_features} < {self.min_elements} weights)"
        return None

    def post_optimizer_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self._precompute:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            for converted in self._precompute:
                precompute_float8_dynamic_scale_for_fsdp(converted)  # one all-reduce of the amaxes

    def _report(self, text: str, converted: bool) -> None:
        """A model's summary: logged (INFO) and, on rank 0, shown without any logging set up:
        printed with `display`, or a warning when no layer was converted."""
        rank_zero = self.trainer.world.is_rank_zero
        logger.log(logging.WARNING if rank_zero and not converted else logging.INFO, "%s", text)
        if converted and self.display and rank_zero:
            print(text, flush=True)


def _output_head(model: nn.Module) -> str | None:
    """The fqn of the model's output head: a Linear named like one, else the last Linear."""
    linears = [fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]
    named = [fqn for fqn in linears if fqn.split(".")[-1] in _HEAD_NAMES]
    return named[-1] if named else (linears[-1] if linears else None)


def _quiet_torchao() -> None:
    """torchao logs failures to load its CUDA-only extensions (and torch a deprecation note)
    when imported on a CPU machine: harmless, kept out of the user's face."""
    import sys

    if "torchao" in sys.modules:
        return
    loggers = [logging.getLogger(name) for name in ("torchao", "torchao.kernel.intmm", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        import torchao.float8  # noqa: F401
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


Fp8Quantization = Fp8QuantizationCallback
"""`Fp8QuantizationCallback` under dream-trainer's name (the same class)."""

"""`Fp8Quantization`: float8 training with torchao, as a callback.

Needs ``torchao`` (``pip install dream-trainer[fp8]``), imported only when the callback is
used.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dream_trainer.callbacks.base import Callback
from dream_trainer.trainer.dream import DreamTrainer

logger = logging.getLogger(__name__)

ModuleFilter = Callable[[nn.Module, str], bool]

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
"""torchao's float8 training recipes (``Float8LinearRecipeName``)."""

_DELAYED = ("amax_history_len", "amax_compute_algo", "scaling_type_input", "scaling_type_weight",
            "scaling_type_grad_output", "delayed_scaling")
_HEAD_NAMES = ("lm_head", "head", "output", "classifier", "output_projection")


class Fp8Quantization(Callback[DreamTrainer]):
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
    the conversion). The converted and skipped layers are logged and kept in
    ``self.converted`` / ``self.skipped``.

    With FSDP2 (``dp_shard > 1``) and the tensorwise recipe, weights are all-gathered in
    float8 and their scales are precomputed for the next step after every optimizer step
    (``precompute_float8_dynamic_scale_for_fsdp``, in `post_optimizer_step`).
    ``trainer.float8`` tells which models are float8 and how (``{model: recipe}``), so an
    ``apply_tensor_parallel`` can use torchao's float8 TP styles.

    Without native float8 (CPUs, GPUs before compute capability 8.9) torchao emulates the
    float8 matmuls: it works, slower, and says so once. Converted models checkpoint and
    resume like any other (the weights stay in high precision); ``export_model`` writes them
    as a plain ``state_dict`` that loads into the unconverted model.

    dream-trainer's ``Fp8Quantization(enabled=True)`` is accepted. Delayed scaling
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
        **legacy: Any,
    ):
        delayed = sorted(set(legacy) & set(_DELAYED))
        if delayed:
            raise TypeError(
                f"Fp8Quantization({', '.join(f'{k}=' for k in delayed)}...): delayed scaling was removed from torchao; "
                "use the dynamic 'tensorwise' recipe (the closest), or 'rowwise'"
            )
        if legacy:
            raise TypeError(f"Fp8Quantization got unexpected argument(s) {sorted(legacy)}")
        if not isinstance(enabled, bool):
            raise TypeError(f"Fp8Quantization(enabled={enabled!r}): expected True or False")
        if isinstance(model_to_recipe, dict):
            self.model_to_recipe: dict[str, str] | None = dict(model_to_recipe)
            self.default_recipe = "tensorwise"
        elif model_to_recipe is None or isinstance(model_to_recipe, str):
            self.model_to_recipe, self.default_recipe = None, model_to_recipe or "tensorwise"
        else:
            raise TypeError(
                f"Fp8Quantization(model_to_recipe={model_to_recipe!r}): expected {{model name: recipe}}, a recipe "
                "for every model, or None"
            )
        for recipe in [*(self.model_to_recipe or {}).values(), self.default_recipe]:
            if recipe not in RECIPES:
                raise ValueError(f"Fp8Quantization: recipe {recipe!r} is not one of {list(RECIPES)}")
        self.module_filter_fn, self.enabled, self.min_elements = module_filter_fn, enabled, min_elements
        self.fsdp_float8_all_gather = fsdp_float8_all_gather
        self.converted: dict[str, list[str]] = {}
        self.skipped: dict[str, dict[str, str]] = {}
        self._precompute: list[nn.Module] = []

    # ------------------------------------------------------------------ conversion
    def post_configure_models(self, models: dict[str, nn.Module]) -> None:
        if not self.enabled:
            logger.info("Fp8Quantization(enabled=False): no model is converted")
            return
        recipes = self.model_to_recipe if self.model_to_recipe is not None else {n: self.default_recipe for n in models}
        unknown = sorted(set(recipes) - set(models))
        if unknown:
            raise KeyError(f"Fp8Quantization: no model named {unknown}; the trainer has {sorted(models)}")
        _quiet_torchao()
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        trainer = self.trainer
        trainer_filters = trainer.quantize_module_filters() if callable(getattr(trainer, "quantize_module_filters", None)) else {}
        sharded = trainer.world.plan.dp_shard > 1
        for name, recipe in recipes.items():
            model = models[name]
            head = _output_head(model)
            skipped: dict[str, str] = {}
            filters = [f for f in (self.module_filter_fn, trainer_filters.get(name)) if f is not None]

            def keep(module: nn.Module, fqn: str, head: str | None = head, skipped: dict[str, str] = skipped,
                     filters: list[ModuleFilter] = filters) -> bool:
                if not isinstance(module, nn.Linear):
                    return False
                reason = self._default_reason(module, fqn, head)
                if reason is None and not all(f(module, fqn) for f in filters):
                    reason = "excluded by a filter"
                if reason is not None:
                    skipped[fqn] = reason
                return reason is None

            config = Float8LinearConfig.from_recipe_name(recipe)
            all_gather = sharded and recipe == "tensorwise" and self.fsdp_float8_all_gather
            if all_gather:
                config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
            converted = convert_to_float8_training(model, module_filter_fn=keep, config=config)
            if converted is not model:
                setattr(trainer, name, converted)
            for f in filters:
                if callable(getattr(f, "validate", None)):
                    f.validate()  # type: ignore[union-attr]
            from torchao.float8.float8_linear import Float8Linear

            self.converted[name] = [fqn for fqn, m in converted.named_modules() if isinstance(m, Float8Linear)]
            self.skipped[name] = skipped
            trainer.float8[name] = recipe
            if all_gather:
                self._precompute.append(converted)
            logger.info(
                "float8 (%s%s) %s: converted %d Linear layer(s) %s; skipped %s", recipe,
                ", float8 all-gather" if all_gather else "", name, len(self.converted[name]), self.converted[name],
                {k: v for k, v in skipped.items()} or "none",
            )
            if not self.converted[name]:
                logger.warning("Fp8Quantization: no Linear layer of %r was converted (see the skipped list)", name)
        self._warn_if_emulated()

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

    def _warn_if_emulated(self) -> None:
        device = self.trainer.world.device
        native = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
        if not native:
            where = "this CPU" if device.type == "cpu" else f"{torch.cuda.get_device_name(device)} (before SM89)"
            logger.warning(
                "Fp8Quantization: %s has no native float8 matmul; torchao emulates it. Training runs and is "
                "numerically float8, but without float8's speedup (that needs an H100/H200/Ada-class GPU)", where
            )


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

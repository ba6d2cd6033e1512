"""Models wrapped by an adapter library (peft): which weights of such a model are the
wrapped model's, under which names that model stores them, and which are the adapters'.
`dream_trainer.checkpoint.load_weights` uses it so that ``--init-from`` a checkpoint of a
plain model starts a LoRA model from its weights, the adapters keeping their own init.
`dream_trainer.adapter_export.export_peft` writes a trained peft model's checkpoint the ways
peft and the wrapped model load it."""

from __future__ import annotations

from collections.abc import Iterable

import torch

_PEFT_PREFIX = "base_model.model."  # PeftModel -> its tuner (LoraModel, ...) -> the wrapped model
_WRAPPED = ".base_layer."  # a tuner layer keeps the original layer under this name


def is_peft_model(model: torch.nn.Module) -> bool:
    """Whether `model` is a peft ``PeftModel`` (recognized without importing peft)."""
    return hasattr(model, "peft_config") and isinstance(getattr(model, "base_model", None), torch.nn.Module)


def adapter_layer_names(model: torch.nn.Module) -> set[str]:
    """The names peft's tuner layers in `model` give their adapter weights (``lora_A``,
    ``lora_B``, ``lora_embedding_A``, ...: each layer's ``adapter_layer_names``)."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "adapter_layer_names", ()) or ())
    return names


def base_keys(model: torch.nn.Module, keys: Iterable[str]) -> tuple[dict[str, str], set[str]]:
    """For a peft model: ``({key: the same weight's key in the wrapped model}, adapter keys)``
    for the state-dict `keys` of `model` (``base_model.model.blocks.0.attn.q_proj.base_layer.weight``
    is ``blocks.0.attn.q_proj.weight``; ``...q_proj.lora_A.default.weight`` is an adapter's).
    For any other model: every key is its own, no adapters."""
    keys = list(keys)
    if not is_peft_model(model):
        return {key: key for key in keys}, set()
    markers = adapter_layer_names(model)
    adapters = {key for key in keys if markers.intersection(key.split("."))}
    renamed = {key: key.removeprefix(_PEFT_PREFIX).replace(_WRAPPED, ".") for key in keys if key not in adapters}
    return renamed, adapters

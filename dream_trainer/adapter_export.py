"""A trained peft model's checkpoint as peft and the wrapped model load it, without
dream_trainer: `export_peft` writes an adapter directory (``adapter_config.json`` +
``adapter_model.safetensors``, peft's own ``save_pretrained``) that
``PeftModel.from_pretrained(base_model, directory)`` loads, and the wrapped model with the
adapters merged into its weights (``merge_and_unload``), a ``.safetensors`` file its
``load_state_dict(strict=True)`` takes. In one process, with no process group, from a
checkpoint written by any number of ranks (sharded or not)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from dream_trainer.adapters import is_peft_model
from dream_trainer.errors import CheckpointError
from dream_trainer.weights_io import read_model_state

__all__ = ["export_peft"]


def export_peft(
    checkpoint: str | os.PathLike[str],
    model: torch.nn.Module,
    adapter_dir: str | os.PathLike[str] | None = None,
    merged: str | os.PathLike[str] | None = None,
    *,
    name: str = "model",
    base_model_name_or_path: str | None = None,
) -> dict[str, Path]:
    """Write model `name` of a checkpoint (any number of ranks, sharded or not), a peft
    model, as peft and the wrapped model load it, in one process with no process group.

    `model`: the run's peft model, built as the run built it (on the meta device or the
    CPU; its ``peft_config`` is the one the run used). The checkpoint's weights load into
    it strictly: every name and shape (so the adapters' rank and targets) must be the
    run's. Then

    - `adapter_dir`: peft's ``save_pretrained``: ``adapter_config.json`` (the
      ``LoraConfig``; `base_model_name_or_path` recorded in it) and
      ``adapter_model.safetensors`` under peft's names (``get_peft_model_state_dict``),
      loaded by ``PeftModel.from_pretrained(base_model, adapter_dir)``;
    - `merged`: a ``.safetensors`` file of the wrapped model with the adapters merged into
      its weights (``merge_and_unload``): ``wrapped_model.load_state_dict(..., strict=True)``.

    Returns the files written by kind (``adapter_config``, ``adapter_model``, ``merged``).
    """
    if not is_peft_model(model):
        raise TypeError(f"export_peft(model=<{type(model).__name__}>): expected a peft PeftModel (get_peft_model)")
    if adapter_dir is None and merged is None:
        raise ValueError("export_peft: give adapter_dir (an adapter directory), merged (a .safetensors file) or both")
    if merged is not None and Path(merged).suffix != ".safetensors":
        raise ValueError(f"export_peft(merged={str(merged)!r}): the merged model is written as safetensors only "
                         "(a pickle can run code when loaded): give a path ending in '.safetensors'")
    from safetensors.torch import save_file

    _load_strict(checkpoint, model, name)
    model.eval()
    written: dict[str, Path] = {}
    if adapter_dir is not None:
        adapter_dir = Path(adapter_dir)
        for config in model.peft_config.values():
            if base_model_name_or_path is not None:
                config.base_model_name_or_path = base_model_name_or_path
        # (save_embedding_layers: no peft-resized vocabulary here; "auto" looks for a Hugging Face config.json)
        model.save_pretrained(str(adapter_dir), safe_serialization=True, save_embedding_layers=False)
        written["adapter_config"] = adapter_dir / "adapter_config.json"
        written["adapter_model"] = adapter_dir / "adapter_model.safetensors"
    if merged is not None:
        state = model.merge_and_unload().state_dict()  # the adapters folded into the wrapped model's weights
        seen: set[int] = set()
        tensors = {}
        for key, tensor in state.items():  # a shared (tied) tensor saved once per name
            ptr = tensor.untyped_storage().data_ptr()
            tensors[key] = tensor.detach().clone() if ptr in seen else tensor.detach().contiguous()
            seen.add(ptr)
        Path(merged).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(merged))
        written["merged"] = Path(merged)
    return written


def _load_strict(checkpoint: str | os.PathLike[str], model: torch.nn.Module, name: str) -> None:
    """Model `name` of the checkpoint into `model` (materialized on the CPU if on meta),
    every name and shape checked first: a difference is a `CheckpointError` naming it."""
    state = read_model_state(checkpoint, name)
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    shapes = [f"{k}: {tuple(state[k].shape)} in the checkpoint, {tuple(v.shape)} in the model"
              for k, v in own.items() if k in state and state[k].shape != v.shape]
    what = [*([f"missing from the checkpoint: {', '.join(missing[:3])}"] if missing else []),
            *([f"not in the model: {', '.join(unexpected[:3])}"] if unexpected else []), *shapes[:3]]
    if what:
        raise CheckpointError(f"checkpoint {checkpoint}: model {name!r} is not this peft model ({'; '.join(what)}): "
                              "build it with the run's LoraConfig (rank, targets) and model shape")
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        persistent = set(own)
        lost = [n for n, _ in model.named_buffers() if n not in persistent]
        if lost:
            raise ValueError(f"export_peft: the model is on the meta device and has buffers no checkpoint holds "
                             f"({', '.join(lost[:3])}): build it on the CPU instead")
        model.to_empty(device="cpu")
    model.load_state_dict(state, strict=True, assign=False)

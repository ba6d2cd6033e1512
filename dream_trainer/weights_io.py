"""A checkpoint's model weights alone: `load_weights` (``--init-from``: fine-tuning, any
sharding on either side, peft models from a checkpoint of the model they wrap) and
`export_model` (one model as a safetensors file, in one process with no process group;
`read_model_state`: its tensors)."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from dream_trainer.checkpoint import _check_format, _dcp_load, _read_metadata, match_template
from dream_trainer.errors import CheckpointError

logger = logging.getLogger(__name__)


def load_weights(path: str | os.PathLike[str], models: dict[str, torch.nn.Module], strict: bool = True) -> None:
    """Load the weights of `models` (by the trainer's model names) from the checkpoint at
    `path`, and nothing else: no optimizer, counter, RNG or data position (fine-tuning,
    ``--init-from``). Any sharding on either side; every rank of the world calls it.

    A peft model (LoRA, ...) loads from a checkpoint of the model it wraps (none of its own
    names in it): each base weight from its name there (`dream_trainer.adapters.base_keys`),
    the adapters keeping their init; `strict` then holds for the base weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    from dream_trainer.adapters import base_keys

    path = Path(path)
    _check_format(path)
    saved = _read_metadata(path).state_dict_metadata
    template: dict[str, Any] = {"models": {}}
    names: dict[str, dict[str, str]] = {}
    partial = set()  # models whose adapters are not loaded
    for name, model in models.items():
        state = get_model_state_dict(model)
        names[name], adapters = ({k: k for k in state}, set()) if any(f"models.{name}.{k}" in saved for k in state) \
            else base_keys(model, state)
        if adapters:
            partial.add(name)
            logger.info("%s: %d adapter weight(s) keep their init; the wrapped model's from %s", name, len(adapters), path)
        template["models"][name] = {names[name][k]: v for k, v in state.items() if k not in adapters}
    template = match_template(path, template, strict)
    _dcp_load(template, path)
    for name, model in models.items():
        own = {saved_as: key for key, saved_as in names[name].items()}
        loaded = {own[k]: v for k, v in template["models"].get(name, {}).items()}
        set_model_state_dict(model, loaded, options=StateDictOptions(strict=strict and name not in partial))


def _trained_names(saved: dict[str, Any]) -> set[str]:
    """The parameter names some optimizer of the checkpoint keeps state for
    (``optimizers.<optimizer>.state.<parameter name>.<statistic>``)."""
    names = set()
    for key in saved:
        parts = key.split(".state.", 1)
        if key.startswith("optimizers.") and len(parts) == 2 and "." in parts[1]:
            names.add(parts[1].rsplit(".", 1)[0])
    return names


def read_model_state(checkpoint: str | os.PathLike[str], model: str = "model",
                     trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Model `model` of a checkpoint (written by any number of ranks, sharded or not) as
    full CPU tensors by their names in the model, read in one process with no process
    group (what `export_model` writes; `dream_trainer.adapter_export.export_peft` loads it into
    a peft model). `trainable_only`: only the parameters some optimizer holds state for."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(checkpoint)
    saved = _read_metadata(path).state_dict_metadata
    prefix = f"models.{model}."
    template = {
        key: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for key, md in saved.items()
        if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }
    if trainable_only:
        trained = _trained_names(saved)
        template = {key: t for key, t in template.items() if key[len(prefix):] in trained}
        if not template:
            raise CheckpointError(f"checkpoint {path}: no parameter of model {model!r} has optimizer state, so none "
                                  "is known to be trainable (trainable_only=True needs a checkpoint of a trained run)")
    if not template:
        models = sorted({k.split(".")[1] for k in saved if k.startswith("models.")})
        raise CheckpointError(f"checkpoint {path} has no model named {model!r}; it has: {models or 'none'}")
    with warnings.catch_warnings():  # "loading in a single process": intended here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        _dcp_load(template, path, no_dist=True)
    return {key[len(prefix):]: t for key, t in template.items()}


def export_model(
    checkpoint: str | os.PathLike[str],
    output: str | os.PathLike[str],
    model: str = "model",
    dtype: torch.dtype | None = None,
    trainable_only: bool = False,
) -> Path:
    """Write model `model` of a checkpoint (written by any number of ranks, sharded or not)
    as one plain ``state_dict`` file in the safetensors format (`output` must end in
    ``.safetensors``): a format that holds only tensors, so loading it can never run code
    (a ``torch.save`` pickle could). Runs in one process, without a process group; needs
    the ``safetensors`` package.

    Load it with ``safetensors.torch.load_file`` and ``model.load_state_dict`` —
    dream_trainer is not needed. `trainable_only`: only the parameters some optimizer of
    the checkpoint holds state for, i.e. those that were trained (a LoRA adapter's weights,
    under their names in the model): ``model.load_state_dict(..., strict=False)`` over the
    base model. A peft model's checkpoint as peft loads it (an adapter directory) or merged
    into the wrapped model: `dream_trainer.adapter_export.export_peft`.
    """
    path, output = Path(checkpoint), Path(output)
    if output.suffix != ".safetensors":
        raise ValueError(f"export_model(output={str(output)!r}): the exported model is written as safetensors only "
                         "(a pickle can run code when loaded): give a path ending in '.safetensors'")
    try:
        from safetensors.torch import save_file
    except ImportError as exc:
        raise ImportError("export_model writes .safetensors and needs the safetensors package: pip install "
                          "safetensors") from exc
    state = read_model_state(path, model, trainable_only=trainable_only)
    state = {key: (t.to(dtype) if dtype is not None and t.is_floating_point() else t) for key, t in state.items()}
    output.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(output))
    return output


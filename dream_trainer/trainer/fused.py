"""`prefer_fused`: torch's Adam, AdamW and SGD run fused on CUDA (one kernel launch per update
phase for all parameters) when the user chose neither ``fused`` nor ``foreach``; torch's own
choice there is ``foreach``. The trainer applies it to its optimizers after ``configure``
unless `DeviceParameters.fused_optimizers` is False."""

from __future__ import annotations

import torch
from torch.optim import Optimizer

_FUSABLE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def prefer_fused(optimizer: Optimizer) -> bool:
    """Run `optimizer` fused if it is a torch Adam, AdamW or SGD whose every parameter is
    a floating-point CUDA tensor (DTensor shards included) and whose ``fused`` and
    ``foreach`` were left unset (None) in every param group. Returns whether it now runs
    fused. Call it before the optimizer's first step (its state is created at that step,
    where fused keeps the step counters on the device)."""
    if type(optimizer) not in _FUSABLE or optimizer.state:
        return False
    groups = optimizer.param_groups
    if any(g.get("fused") is not None or g.get("foreach") is not None or g.get("differentiable") for g in groups):
        return False
    params = [p for g in groups for p in g["params"]]
    if not params or any(p.device.type != "cuda" or not p.is_floating_point() for p in params):
        return False
    for group in groups:
        group["fused"] = True
    optimizer.defaults["fused"] = True  # param groups added later run fused too
    optimizer._step_supports_amp_scaling = True  # what the constructor sets for fused=True (GradScaler)
    return True

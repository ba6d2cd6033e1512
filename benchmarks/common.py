"""What every benchmark script shares: the machine description and the JSON file."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch

from dream_trainer import Callback


def machine() -> dict[str, Any]:
    """Where the numbers were taken."""
    return {"platform": platform.platform(), "cpu_count": os.cpu_count(), "python": sys.version.split()[0],
            "torch": torch.__version__}


def write_json(result: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write `result` to `path` (creating its folder) and say where."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return out


class StepTimes(Callback[Any]):
    """Each optimizer step's wall time, from ``trainer.step_stats`` (synchronized on CUDA)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        if not self.trainer.is_accumulating_gradients:
            if self.trainer.world.device.type == "cuda":
                torch.cuda.synchronize()
            self.times.append(self.trainer.step_stats.step_time_s)

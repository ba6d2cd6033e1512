"""What every benchmark script shares: the machine description, the JSON file, the spread of
repeated measurements and a per-step timer (windows of steps: `StepWindowCallback`)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from dream_trainer import Callback
from dream_trainer.callbacks.step_window import spread, verdict  # noqa: F401  (the benchmarks' import point)




def cpu_model() -> str:
    """The processor's name (Linux: /proc/cpuinfo), else the platform's."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    """Where the numbers were taken: the host, the GPUs (if any) and the versions."""
    info: dict[str, Any] = {"platform": platform.platform(), "processor": cpu_model(), "cpu_count": os.cpu_count(),
                            "python": sys.version.split()[0], "torch": torch.__version__,
                            "torchao": _version("torchao"), "date": time.strftime("%Y-%m-%d")}
    if torch.cuda.is_available():
        info["cuda"] = torch.version.cuda
        info["gpus"] = [f"{torch.cuda.get_device_name(i)} (sm_{''.join(map(str, torch.cuda.get_device_capability(i)))}, "
                        f"{torch.cuda.get_device_properties(i).total_memory / 2**30:.0f} GiB)"
                        for i in range(torch.cuda.device_count())]
    return info


def device_name(device: str) -> str:
    """The GPU's name on CUDA, else the processor's."""
    return torch.cuda.get_device_name(0) if device == "cuda" else cpu_model()


def write_json(result: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write `result` to `path` (creating its folder) and say where."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return out


def _sync(trainer: Any) -> None:
    if trainer.world.device.type == "cuda":
        torch.cuda.synchronize()  # deliberate: the window's edges are device time


class StepTimes(Callback[Any]):
    """Each optimizer step's wall time, from ``trainer.step_stats`` (synchronized on CUDA)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        if not self.trainer.is_accumulating_gradients:
            _sync(self.trainer)
            self.times.append(self.trainer.step_stats.step_time_s)

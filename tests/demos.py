"""The example trainers as tests use them: the GPT demo, the Llama and LoRA examples, loaded from
their files, run through their own ``main`` with short settings, and a callback that records
what a test compares (the initial weights, per-step losses, the final weights)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch

from dream_trainer import Callback, StopTraining

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = {"gpt": ROOT / "examples" / "gpt" / "train.py", "llama": ROOT / "examples" / "llama" / "train.py",
            "lora": ROOT / "examples" / "gpt" / "lora.py"}

# A small model and corpus: a few seconds per run on one core.
SMALL = ["--n-chars", "20000", "--d-model", "64", "--n-layer", "2", "--n-head", "4", "--block-size", "32",
         "--warmup", "2", "--log-every", "1"]


def load(example: str) -> Any:
    """The example's ``train`` module (``main``, its trainer class)."""
    name = f"dream_trainer_examples_{example}_train"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLES[example])
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[name] = module
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    return sys.modules[name]


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer as a full (unsharded) CPU tensor, by name."""
    out = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
    for name, tensor in named:
        tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        out[name] = tensor.detach().float().cpu().clone()
    return out


class Record(Callback):
    """Records the weights right after `configure` (``initial``), each optimizer step's
    loss averaged over the data-parallel ranks (``losses``, step -> float), and the final
    weights (``final``). ``stop_after_configure``: end the run there (`StopTraining`)."""

    def __init__(self, stop_after_configure: bool = False):
        self.stop_after_configure = stop_after_configure
        self.initial: dict[str, torch.Tensor] = {}
        self.final: dict[str, torch.Tensor] = {}
        self.losses: dict[int, float] = {}
        self._sum: torch.Tensor | None = None
        self._n = 0

    def post_configure(self) -> None:
        if not self.trainer.resumed:
            self.initial = full_state(self.trainer.model)
        if self.stop_after_configure:
            raise StopTraining("initial weights recorded")

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        loss = result["loss"].detach().float()
        self._sum = loss if self._sum is None else self._sum + loss
        self._n += 1
        trainer = self.trainer
        if trainer.is_accumulating_gradients or trainer.step_skipped:
            return
        mean = self._sum / self._n
        world = trainer.world
        if world.dp_size > 1:  # the global batch's loss: the mean over data-parallel ranks
            mean = world.all_reduce(mean.clone(), "mean", group=world.get_mesh("dp").get_group())
        self.losses[trainer.global_step] = float(mean)  # a test: one read per step is fine
        self._sum, self._n = None, 0

    def post_fit(self) -> None:
        self.final = full_state(self.trainer.model)

    def result(self) -> dict[str, Any]:
        return {"initial": self.initial, "final": self.final, "losses": self.losses}


def curve(run: dict[str, Any], steps: Any) -> torch.Tensor:
    """`Record` losses at `steps`, as a tensor (to compare loss curves)."""
    return torch.tensor([run["losses"][s] for s in steps])


def assert_tracks_and_resumes(full: dict[str, Any], resumed: dict[str, Any], reference: dict[str, Any], steps: int,
                              every: int, tolerance: float) -> None:
    """`full`'s loss curve and validation losses are `reference`'s within `tolerance`
    (relative), and `resumed` (from `full`'s checkpoint at step `every`) continues `full`'s
    losses bit-exactly to step `steps`."""
    torch.testing.assert_close(curve(full, range(1, steps + 1)), curve(reference, range(1, steps + 1)),
                               rtol=tolerance, atol=0.0)
    torch.testing.assert_close(torch.tensor([v for _, v in full["val"]]), torch.tensor([v for _, v in reference["val"]]),
                               rtol=tolerance, atol=0.0)
    assert sorted(resumed["losses"]) == list(range(every + 1, steps + 1))
    for step, loss in resumed["losses"].items():
        assert loss == full["losses"][step], step

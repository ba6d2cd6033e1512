"""Fine-tune the GPT demo with LoRA adapters (peft): the base model frozen, low-rank
adapters on the attention projections trained, under any layout of the demo (FSDP2 too)::

    python examples/gpt/train.py --run-name base                     # a base model to adapt
    python examples/gpt/lora.py --init-from runs/gpt/base/checkpoints/step_000000250 \\
        --run-name adapt --nproc 2 --parallel fsdp                    # LoRA on 2 FSDP2 ranks
    python examples/gpt/lora.py export runs/gpt-lora/adapt/checkpoints/step_000000250 \\
        --trainable-only --output adapter.safetensors                # the adapters alone, one process

``--init-from`` loads the base model's weights into the wrapped model (peft's names are
mapped to the base model's; the adapters keep their init: lora_B zero, so step 0 is the base
model exactly). Only the adapters are given to the optimizer, so a checkpoint holds
optimizer state for them alone, and ``export --trainable-only`` writes them under their
names (``base_model.model.blocks.0.attn.q_proj.lora_A.default.weight``, ...) from the
checkpoint files, with no process group. Every option of ``examples/gpt/train.py``
applies; ``--lora.rank``, ``--lora.alpha``, ``--lora.targets`` shape the adapters (fixed on
resume). Needs the ``peft`` extra (``pip install 'dream_trainer[peft]'``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train as gpt  # noqa: E402  (the GPT demo beside this file)

from dream_trainer import entrypoint  # noqa: E402
from dream_trainer.config_files import FIXED_ON_RESUME  # noqa: E402


@dataclass(kw_only=True)
class LoraShape:
    """LoRA adapters (peft ``LoraConfig``).

    Attributes:
        rank: the adapters' rank r.
        alpha: the scale numerator: an adapter's update is scaled by alpha / rank.
        targets: the names of the linear layers that get adapters (q_proj, k_proj, v_proj,
            o_proj, fc1, fc2).
        dropout: dropout on the adapters' input.
    """

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoraShape.rank={self.rank!r} is invalid: expected an int >= 1")
        allowed = ("q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2")
        unknown = [t for t in self.targets if t not in allowed]
        if unknown or not self.targets:
            raise ValueError(f"LoraShape.targets={self.targets!r} is invalid: expected names among {allowed}")


@dataclass(kw_only=True)
class LoraRunConfig(gpt.GPTRunConfig):
    """The GPT demo's config with adapters.

    Attributes:
        lora: the adapters' shape (fixed on resume).
    """

    experiment: str = "gpt-lora"
    lr: float = 1e-2
    warmup: int = 5
    lora: LoraShape = field(default_factory=LoraShape, metadata=FIXED_ON_RESUME)


class LoraTrainer(gpt.GPTTrainer):
    """The demo's GPT wrapped by peft: every base weight frozen, the adapters trained."""

    config: LoraRunConfig

    def configure_models(self) -> None:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            raise ImportError("examples/gpt/lora.py needs peft: pip install 'dream_trainer[peft]'") from None
        super().configure_models()  # the GPT, on the meta device
        shape = self.config.lora
        self.model = get_peft_model(self.model, LoraConfig(r=shape.rank, lora_alpha=shape.alpha,
                                                           target_modules=list(shape.targets),
                                                           lora_dropout=shape.dropout))

    def init_weights(self) -> None:
        """The GPT's init (which also draws the adapters' Linear layers), then peft's own
        for the adapters: lora_A random, lora_B zero, so the model starts as the base."""
        super().init_weights()
        for module in self.model.modules():
            if callable(getattr(module, "reset_lora_parameters", None)):
                for adapter in module.lora_A:
                    module.reset_lora_parameters(adapter, True)

    def configure_optimizers(self) -> None:
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=self.config.lr, betas=(0.9, 0.95), weight_decay=0.0)


def main(argv: list[str] | None = None, callbacks: list[Any] | None = None) -> Any:
    return gpt.main(argv, callbacks, trainer_cls=LoraTrainer, config=LoraRunConfig())


if __name__ == "__main__":
    raise SystemExit(getattr(entrypoint(main), "exit_code", 0))

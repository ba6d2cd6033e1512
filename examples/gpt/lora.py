"""Fine-tune the GPT demo with LoRA adapters (peft): the base model frozen, low-rank
adapters on the attention projections trained, under any layout of the demo (FSDP2 too)::

    python examples/gpt/train.py --run-name base                     # a base model to adapt
    python examples/gpt/lora.py --init-from runs/gpt/base/checkpoints/step_000000250 \\
        --run-name adapt --nproc 2 --parallel fsdp                    # LoRA on 2 FSDP2 ranks
    python examples/gpt/lora.py export runs/gpt-lora/adapt/checkpoints/step_000000250 \\
        --adapter adapter/ --merged merged.safetensors               # for peft, and merged; one process

``--init-from`` loads the base model's weights into the wrapped model (peft's names are
mapped to the base model's; the adapters keep their init: lora_B zero, so step 0 is the base
model exactly). Only the adapters are given to the optimizer, so a checkpoint holds
optimizer state for them alone. ``export CHECKPOINT --adapter DIR`` writes a peft adapter
directory (``adapter_config.json``, ``adapter_model.safetensors``) that
``PeftModel.from_pretrained(GPT(...), DIR)`` loads; ``--merged FILE`` the GPT with the
adapters merged into its weights (``GPT.load_state_dict(..., strict=True)``). Both read the
checkpoint's files in one process with no process group, the model and the adapters' shape
from the run's record (``run.json``). ``export --trainable-only`` (the demo's export) writes
the trained tensors under their names in the wrapped model. Every option of
``examples/gpt/train.py`` applies; ``--lora.rank``, ``--lora.alpha``, ``--lora.targets``
shape the adapters (fixed on resume). Needs the ``peft`` extra (``pip install
'dream_trainer[peft]'``).
"""

from __future__ import annotations

import argparse
import sys
import warnings
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
            from peft import get_peft_model
        except ImportError:
            raise ImportError("examples/gpt/lora.py needs peft: pip install 'dream_trainer[peft]'") from None
        super().configure_models()  # the GPT, on the meta device
        self.model = get_peft_model(self.model, lora_config(self.config.lora))

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


def lora_config(shape: LoraShape) -> Any:
    """peft's ``LoraConfig`` for `shape`: the one the trainer wraps the GPT with and the one
    ``export --adapter`` writes as ``adapter_config.json``."""
    from peft import LoraConfig

    return LoraConfig(r=shape.rank, lora_alpha=shape.alpha, target_modules=list(shape.targets),
                      lora_dropout=shape.dropout)


_PEFT_EXPORT = ("--adapter", "--merged")
_EXPORT_HELP = """
LoRA exports (lora.py export CHECKPOINT ...: one process; the shapes from the run's run.json):
  --adapter DIR              a peft adapter directory: adapter_config.json, adapter_model.safetensors;
                             PeftModel.from_pretrained(GPT(...), DIR) loads it
  --merged FILE              the GPT with the adapters merged into its weights (.safetensors):
                             GPT(...).load_state_dict(..., strict=True) loads it"""


def export_adapters(args: list[str]) -> dict[str, Path]:
    """``export CHECKPOINT --adapter DIR --merged FILE [--model M] [config flags]``: the
    checkpoint's LoRA model as a peft adapter directory and/or the merged GPT
    (`dream_trainer.adapter_export.export_peft`). The GPT's and the adapters' shape are the run's
    record's (``<run>/run.json`` above the checkpoint), then the flags'."""
    try:
        from peft import get_peft_model
    except ImportError:
        raise ImportError("lora.py export --adapter/--merged needs peft: pip install 'dream_trainer[peft]'") from None

    from dream_trainer.adapter_export import export_peft

    parser = argparse.ArgumentParser(prog="lora.py export", description=_EXPORT_HELP.strip().splitlines()[0])
    parser.add_argument("checkpoint", metavar="CHECKPOINT")
    parser.add_argument("--adapter", metavar="DIR", default=None)
    parser.add_argument("--merged", metavar="FILE", default=None)
    parser.add_argument("--model", default="model", help="which model of the checkpoint")
    known, rest = parser.parse_known_args(args)
    plain = [token for token in rest if token.partition("=")[0] in ("--output", "--trainable-only", "--dtype")]
    if plain:
        parser.error(f"{plain[0]} is an option of the plain export (a safetensors file of the checkpoint's tensors), "
                     "not of --adapter/--merged: give one or the other")
    config, base = _recorded_config(Path(known.checkpoint), rest)
    with torch.device("meta"):
        model = get_peft_model(gpt.GPT(_gpt_config(config)), lora_config(config.lora))
    written = export_peft(known.checkpoint, model, known.adapter, known.merged, name=known.model,
                          base_model_name_or_path=base)
    for kind, path in written.items():
        print(f"exported {kind}: {path}", flush=True)
    return written


def _gpt_config(config: LoraRunConfig) -> Any:
    shape = config.model  # as GPTTrainer builds it
    return gpt.GPTConfig(vocab_size=gpt.ByteTokenizer().vocab_size, block_size=shape.block_size,
                         n_layer=shape.n_layer, n_head=shape.n_head, d_model=shape.d_model)


def _recorded_config(checkpoint: Path, flags: list[str]) -> tuple[LoraRunConfig, str | None]:
    """The config of the run that wrote `checkpoint` (its record, then `flags`), and the
    base model it started from (its ``--init-from``), if recorded."""
    from dream_trainer.cli import parse
    from dream_trainer.config_files import apply_config
    from dream_trainer.run_records import RECORD, read_record

    run_dir = checkpoint.resolve().parent.parent  # <run>/checkpoints/step_N
    record, config, base = read_record(run_dir), LoraRunConfig(), None
    if record is None:
        warnings.warn(f"export {checkpoint}: no run record ({run_dir / RECORD}); the GPT's and the adapters' shape "
                      "(--lora.rank, --lora.alpha, --lora.targets, --lora.dropout, --d-model, ...) are the command "
                      "line's, and alpha and dropout, which the checkpoint does not hold, are not checked",
                      stacklevel=3)
    else:
        config = apply_config(config, record["config"], source=str(run_dir / RECORD))
        base = _init_from([record, *reversed(record.get("history") or [])])
    command = parse(config, ["export", str(checkpoint), *flags], aliases=gpt.ALIASES, presets=gpt.PRESETS,
                    prog="lora.py")
    return command.config, base


def _init_from(starts: list[Any]) -> str | None:
    """The ``--init-from`` of the latest of the run's recorded starts that had one."""
    for start in starts:
        argv = [str(a) for a in (start.get("argv") or [] if isinstance(start, dict) else [])]
        for i, token in enumerate(argv):
            flag, eq, value = token.partition("=")
            if flag in ("--init-from", "--init_from") and (eq or i + 1 < len(argv)):
                return value if eq else argv[i + 1]
    return None


def main(argv: list[str] | None = None, callbacks: list[Any] | None = None) -> Any:
    """The demo's command line with adapters; ``export CHECKPOINT --adapter DIR`` and/or
    ``--merged FILE`` write what peft and the GPT load (`export_adapters`)."""
    args = list(sys.argv[1:] if argv is None else argv)
    flags = {token.partition("=")[0] for token in args[1:]} if args[:1] == ["export"] else set()
    if flags & set(_PEFT_EXPORT) and not flags & {"-h", "--help", "--help-all"}:
        return export_adapters(args[1:])
    try:
        return gpt.main(args, callbacks, trainer_cls=LoraTrainer, config=LoraRunConfig())
    except SystemExit as exit_:
        if flags & {"-h", "--help"} and not exit_.code:
            print(_EXPORT_HELP)
        raise


if __name__ == "__main__":
    raise SystemExit(getattr(entrypoint(main), "exit_code", 0))

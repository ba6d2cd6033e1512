"""Train a tiny GPT on a generated corpus with dream_trainer.

    python examples/gpt/train.py                      # one process (about a minute on 2 CPU cores)
    python examples/gpt/train.py --nproc 2            # 2 local ranks, spawned by dream_trainer
    torchrun --nproc_per_node 2 examples/gpt/train.py # 2 ranks under torchrun (DDP over gloo on CPU)
    torchrun --nproc_per_node 2 examples/gpt/train.py --parallel fsdp   # or tp; --compile

The corpus is generated, written as text and turned into byte-level token files (what
``python -m dream_trainer.data.prepare`` does for any corpus) under ``runs/data``; the demo
trains from them with a `TokenLoader` (its position is the run's: a checkpoint resumes on
any number of ranks, with the same global batch). Metrics go to ``runs/gpt/<run>/logs`` (TensorBoard event files and metrics.jsonl),
checkpoints to ``runs/gpt/<run>/checkpoints`` (every 50 steps, async). Stop a run with
Ctrl-C or SIGTERM: it saves at the next step boundary and exits with status 75; run it
again with the same ``--run-name`` and it resumes where it stopped.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))

from data import ByteTokenizer, prepare_token_files  # noqa: E402
from model import GPT, GPTConfig, lm_loss  # noqa: E402

from dream_trainer import (  # noqa: E402
    Callback,
    CheckpointCallback,
    CheckpointParameters,
    DeviceParameters,
    DreamTrainer,
    LoggerCallback,
    LoggingParameters,
    ProgressBarCallback,
    TrainerConfig,
    TrainingParameters,
    entrypoint,
)
from dream_trainer.data import TokenDataset, TokenLoader  # noqa: E402


class GPTTrainer(DreamTrainer):
    """Byte-level GPT: model on meta, AdamW, warmup + cosine, token files shared by the world."""

    experiment = "gpt"  # runs go to <root>/gpt/<run name>

    def __init__(self, config: TrainerConfig, args: argparse.Namespace):
        super().__init__(config)
        self.args = args
        self.train_file, self.val_file = prepare_token_files(Path(args.data_dir or Path(config.root_dir) / "data"),
                                                             n_chars=args.n_chars)
        self.tokenizer = ByteTokenizer()
        self.gpt_config = GPTConfig(
            vocab_size=self.tokenizer.vocab_size,
            block_size=args.block_size,
            n_layer=args.n_layer,
            n_head=args.n_head,
            d_model=args.d_model,
        )

    def configure_models(self) -> None:
        self.model = GPT(self.gpt_config)  # on the meta device: nothing allocated yet

    # -- parallelism: called by DreamTrainer only when the DeviceParameters ask for it --------
    def apply_tensor_parallel(self, tp_mesh: Any) -> None:
        """Megatron-style: q/k/v and fc1 split by output features, o_proj and fc2 by input
        features, so each block needs one all-reduce in attention and one in the MLP."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {
            "attn.q_proj": ColwiseParallel(),
            "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(),
            "attn.o_proj": RowwiseParallel(),
            "mlp.fc1": ColwiseParallel(),
            "mlp.fc2": RowwiseParallel(),
        }
        for block in self.model.blocks:
            parallelize_module(block, tp_mesh, plan)

    def apply_compile(self) -> None:
        for block in self.model.blocks:
            self.compile_module(block)  # per block: small graphs, compiled once and reused by every block

    def apply_fully_shard(self, fsdp_config: dict[str, Any]) -> None:
        from torch.distributed.fsdp import fully_shard

        for block in self.model.blocks:
            fully_shard(block, **fsdp_config)  # one all-gather / reduce-scatter per block
        fully_shard(self.model, **fsdp_config)  # the root: embeddings, final norm, head

    def configure_optimizers(self) -> None:
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.args.lr,
            betas=(0.9, 0.95),
        )

    def configure_schedulers(self) -> None:
        warmup, total = self.args.warmup, self.args.steps

        def lr_factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor)

    def configure_dataloaders(self) -> tuple[Any, DataLoader[Any]]:
        """Training: this rank's share of each global batch (``--batch-size``), in the run's
        order; under fault tolerance the global batch is split over the quorum's groups.
        Validation: the held-out windows, in order, split over the data-parallel ranks."""
        train: Any = TokenLoader.for_trainer(self, self.train_file, self.args.block_size)
        if self.args.data_delay_ms:
            train = _Slow(train, self.args.data_delay_ms / 1000)
        val_set = TokenDataset(self.val_file, self.args.block_size)
        sampler = DistributedSampler(val_set, self.world.dp_size, self.world.dp_rank, shuffle=False)
        return train, DataLoader(val_set, batch_size=train.micro_batch_size, sampler=sampler)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        loss = lm_loss(self.model(x), y)
        self.backward(loss)
        self.step(self.optimizer)
        return {"loss": loss}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        return {"loss": lm_loss(self.model(x), y)}


class _Slow:
    """`--data-delay-ms`: a data pipeline that takes `delay` seconds per batch (the loader's
    position, length and epochs are the wrapped loader's)."""

    def __init__(self, loader: TokenLoader, delay: float):
        self.loader, self.delay = loader, delay

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Any:
        for batch in self.loader:
            time.sleep(self.delay)
            yield batch


class ValidationHistory(Callback[DreamTrainer]):
    """Keeps (step, val loss) of every validation, sanity check included."""

    def __init__(self) -> None:
        self.history: list[tuple[int, float]] = []

    def post_validation_epoch(self, result: dict[str, Any]) -> None:
        if "val/loss" in result:
            self.history.append((self.trainer.global_step, float(result["val/loss"])))


PARALLEL = {
    "single": DeviceParameters.SINGLE_DEVICE,
    "ddp": DeviceParameters.DDP,  # one rank: plain; N ranks: gradients averaged
    "fsdp": DeviceParameters.FSDP,  # parameters, gradients and optimizer state sharded
    "hsdp": lambda **kw: DeviceParameters.HSDP(dp_shard=2, **kw),  # shard in pairs, replicate pairs
    "tp": lambda **kw: DeviceParameters(dp_replicate="auto", tensor_parallel=2, **kw),  # x DDP on 4+ ranks
    "fsdp_tp": lambda **kw: DeviceParameters(dp_replicate=1, dp_shard="auto", tensor_parallel=2, **kw),  # 4+ ranks
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=250, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=32,
                   help="global batch size: samples per optimizer step over all data-parallel ranks (and replica groups)")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="samples per forward pass on one rank (default: the rank's whole share; smaller: accumulation)")
    p.add_argument("--lr", type=float, default=6e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--val-every", type=int, default=50)
    p.add_argument("--log-every", type=int, default=10, help="log training metrics every N steps")
    p.add_argument("--val-batches", type=int, default=None, help="batches per validation (default: all)")
    p.add_argument("--n-chars", type=int, default=400_000, help="size of the generated corpus")
    p.add_argument("--data-dir", default=None, help="where the corpus's token files are made (default: <root-dir>/data)")
    p.add_argument("--data-delay-ms", type=float, default=0.0,
                   help="make every training batch this much slower to load (a slow data pipeline, to see it found)")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--root-dir", default="runs")
    p.add_argument("--run-name", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parallel", choices=sorted(PARALLEL), default="ddp",
                   help="how ranks share the work (single: one process; tp needs 2 ranks, hsdp and fsdp_tp 4)")
    p.add_argument("--compile", action="store_true", help="torch.compile each transformer block")
    p.add_argument("--progress", action="store_true", help="draw the progress bar even when not a terminal")
    p.add_argument("--checkpoint-every", type=int, default=50, help="save a checkpoint every N steps (0: only at the end)")
    p.add_argument("--async-checkpoint", choices=["off", "async", "async_pinned"], default="async",
                   help="write checkpoints in the background (the loop waits only for a copy)")
    p.add_argument("--resume", default="last",
                   help="'last' (the newest checkpoint of this run name), 'none', or a checkpoint path")
    p.add_argument("--ft-group", type=int, default=None,
                   help="fault tolerant (torchft): this job is replica group N (see examples/gpt/fault_tolerant.py)")
    p.add_argument("--lighthouse", default=None, help="the lighthouse, http://host:port (default: TORCHFT_LIGHTHOUSE)")
    return p.parse_args(argv)


def _fault_tolerance(args: argparse.Namespace) -> list[Callback[Any]]:
    if args.ft_group is None:
        return []
    from dream_trainer import FaultToleranceCallback, FaultToleranceParameters

    return [FaultToleranceCallback(FaultToleranceParameters(lighthouse=args.lighthouse, replica_group_id=args.ft_group,
                                                            heartbeat_interval=0.1, timeout_s=30.0))]


def main(argv: list[str] | None = None, callbacks: list[Callback[Any]] | None = None,
         trainer_cls: type[GPTTrainer] = GPTTrainer) -> GPTTrainer:
    """Train the demo; `callbacks` are added to its own (see examples/callbacks).
    `trainer_cls`: another model on the same data and loop (examples/llama)."""
    args = parse_args(argv)
    history = ValidationHistory()
    config = TrainerConfig(
        experiment=trainer_cls.experiment,
        run_name=args.run_name,
        root_dir=args.root_dir,
        seed=args.seed,
        device_parameters=PARALLEL[args.parallel](compile_model=args.compile),
        training_parameters=TrainingParameters(
            n_epochs=None,
            max_steps=args.steps,
            val_every_n_steps=args.val_every,
            val_steps_per_epoch=args.val_batches,
            global_batch_size=args.batch_size,
            micro_batch_size=args.micro_batch_size,
            gradient_clip_val=1.0,
        ),
        logging_parameters=LoggingParameters(log_every_n_steps=args.log_every),
        callbacks=[
            ProgressBarCallback(enabled=True if args.progress else None),
            LoggerCallback(),
            history,
            CheckpointCallback(
                CheckpointParameters(
                    every_n_steps=args.checkpoint_every or None,
                    async_mode=args.async_checkpoint,
                    resume_mode=None if args.resume == "none" else args.resume,
                    monitor="val/loss",
                )
            ),
            *_fault_tolerance(args),
            *(callbacks or []),
        ],
    )
    trainer = trainer_cls(config, args)
    trainer.fit()
    if trainer.world.is_rank_zero:
        steps = ", ".join(f"{step}: {loss:.3f}" for step, loss in history.history)
        print(f"validation loss by step: {steps}")
        print(f"logs: {trainer.run_dir / 'logs'}")
        if trainer.status == "preempted":
            print(f"preempted at step {trainer.global_step}: run again with --run-name {trainer.run_name} to resume")
    return trainer


if __name__ == "__main__":
    # 75 when preempted (SIGTERM/Ctrl-C: checkpointed at a step boundary), so a scheduler
    # or torchrun --max-restarts can tell it from a crash and restart to resume; with
    # --nproc N the launcher exits with the ranks' status too.
    raise SystemExit(entrypoint(main).exit_code)

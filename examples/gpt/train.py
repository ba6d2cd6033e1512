"""Train a tiny GPT on a generated corpus with dream_trainer.

    python examples/gpt/train.py                      # one process (about a minute on 2 CPU cores)
    python examples/gpt/train.py --nproc 2            # 2 local ranks, spawned by dream_trainer
    torchrun --nproc_per_node 2 examples/gpt/train.py # 2 ranks under torchrun (DDP over gloo on CPU)
    torchrun --nproc_per_node 2 examples/gpt/train.py --parallel fsdp   # or tp; --compile
    python examples/gpt/train.py --help               # the subcommands, options and short flags
    python examples/gpt/train.py --help-all           # every config field's flag (--help-all model: one group)
    python examples/gpt/train.py summarize --parallel fsdp --nproc 2    # or profile, benchmark, ...
    python examples/gpt/train.py summarize --parallel pp --world-size 8 # plan 8 ranks, launching none

The command line is dream_trainer's (`dream_trainer.cli`): a flag for every config field
(``--training_parameters.max_steps 100``, ``--model.d_model 256``), ``--config run.yaml``,
``--print-config``, the subcommands ``resume RUN``, ``profile``, ``find-graph-breaks``,
``benchmark``, ``summarize``, ``export CHECKPOINT``, and the short flags of `ALIASES`
(``--steps``, ``--batch-size``, ...). The corpus is generated, written as text and turned
into byte-level token files (what ``python -m dream_trainer.data.prepare`` does for any
corpus) under ``runs/data``; the demo trains from them with a `TokenLoader` (its position is
the run's: a checkpoint resumes on any number of ranks, with the same global batch).
Metrics go to ``runs/gpt/<run>/logs`` (TensorBoard event files and metrics.jsonl),
checkpoints to ``runs/gpt/<run>/checkpoints`` (every 50 steps, async), the resolved config,
git commit and versions to ``runs/gpt/<run>/run.json``. Stop a run with Ctrl-C or SIGTERM:
it saves at the next step boundary and exits with status 75; run it again with the same
``--run-name`` (or ``resume runs/gpt/<run>``) and it resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))

from data import ByteTokenizer, prepare_token_files  # noqa: E402
from model import GPT, GPTConfig, lm_loss  # noqa: E402

from dream_trainer import cli  # noqa: E402
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
from dream_trainer.config_files import FIXED_ON_RESUME  # noqa: E402
from dream_trainer.data import TokenDataset, TokenLoader  # noqa: E402
from dream_trainer.data.documents import DocumentBatch  # noqa: E402
from dream_trainer.pipeline import PipelineLayout  # noqa: E402


@dataclass(kw_only=True)
class ModelShape:
    """The GPT's shape (a resume cannot change it).

    Attributes:
        block_size: tokens per sample (the context length).
        n_layer: transformer blocks.
        n_head: attention heads per block.
        d_model: the width of the residual stream.
    """

    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128


@dataclass(kw_only=True)
class DemoData:
    """The generated corpus.

    Attributes:
        n_chars: size of the generated corpus, in characters (bytes: one token each).
        data_dir: where the corpus's token files are made (default: <root_dir>/data).
        data_delay_ms: make every training batch this much slower to load (a slow data
            pipeline, to see it found).
        documents: each line of the corpus is a document, and the samples know them
            (`TokenLoader(document_info=True, mask_document_boundaries=True)`): no loss on
            predicting a document from the previous one, positions restarting at each
            document, attention that stops at its start (a block-causal mask). Not with
            pipeline or context parallelism.
        prefetch: training micro-batches the `TokenLoader` reads ahead on a background
            thread (default: 2 on CUDA, where it pins them; 0 on CPU).
    """

    n_chars: int = 400_000
    data_dir: str | None = None
    data_delay_ms: float = 0.0
    documents: bool = False
    prefetch: int | None = None


@dataclass(kw_only=True)
class GPTRunConfig(TrainerConfig):
    """The demo's config: dream_trainer's fields and the demo's own.

    Attributes:
        model: the GPT's shape (fixed on resume).
        data: the generated corpus.
        lr: AdamW's peak learning rate.
        warmup: linear warm-up steps, then cosine decay to 10 % at the last step.
        checkpoint: when checkpoints are saved and what is resumed.
        progress: draw the progress bar even when not a terminal.
        trackers: experiment trackers beside TensorBoard: wandb (offline, under the run
            directory) and/or mlflow (a file store under root_dir/mlruns).
        ft_group: fault tolerant (torchft): this job is replica group N (see
            examples/gpt/fault_tolerant.py).
        lighthouse: the torchft lighthouse, http://host:port (default: TORCHFT_LIGHTHOUSE).
        ft_start_groups: a fresh fault-tolerant run waits at its first step until this many
            groups are in the quorum (FaultToleranceParameters.start_groups).
        cuda_graphs: on one CUDA device, `--compile` replays the compiled model as CUDA
            graphs (torch.compile's mode="reduce-overhead"): a launch or two per step
            instead of one per kernel, which is what a small model's step is made of.
    """

    experiment: str = "gpt"  # runs go to <root>/gpt/<run name>
    seed: int | None = 0
    training_parameters: TrainingParameters = field(default_factory=lambda: TrainingParameters(
        n_epochs=None, max_steps=250, val_every_n_steps=50, global_batch_size=32, gradient_clip_val=1.0))
    device_parameters: DeviceParameters = field(default_factory=DeviceParameters.DDP)
    logging_parameters: LoggingParameters = field(default_factory=lambda: LoggingParameters(log_every_n_steps=10))
    model: ModelShape = field(default_factory=ModelShape, metadata=FIXED_ON_RESUME)
    data: DemoData = field(default_factory=DemoData)
    lr: float = 6e-3
    warmup: int = 20
    checkpoint: CheckpointParameters = field(default_factory=lambda: CheckpointParameters(
        every_n_steps=50, async_mode="async", monitor="val/loss"))
    progress: bool = False
    trackers: tuple[Literal["wandb", "mlflow"], ...] = ()
    ft_group: int | None = None
    lighthouse: str | None = None
    ft_start_groups: int = 1
    cuda_graphs: bool = True


class GPTTrainer(DreamTrainer):
    """Byte-level GPT: model on meta, AdamW, warmup + cosine, token files shared by the world."""

    config: GPTRunConfig
    # --parallel pp: the stages' cut (the blocks; the embeddings first, the head last)
    pipeline_layout = PipelineLayout(layers="blocks", first=("tok_emb", "pos_emb"), last=("ln_f", "lm_head"))

    def __init__(self, config: GPTRunConfig):
        super().__init__(config)
        data = config.data
        self.train_file, self.val_file = prepare_token_files(Path(data.data_dir or Path(config.root_dir) / "data"),
                                                             n_chars=data.n_chars,
                                                             split="lines" if data.documents else "paragraphs")
        self.tokenizer = ByteTokenizer()
        shape = config.model
        self.gpt_config = GPTConfig(vocab_size=self.tokenizer.vocab_size, block_size=shape.block_size,
                                    n_layer=shape.n_layer, n_head=shape.n_head, d_model=shape.d_model)
        pipeline = config.device_parameters.pipeline  # --parallel pp: the schedule's cost model needs the sample size
        if pipeline.sample_tokens is None:
            pipeline.sample_tokens = shape.block_size

    def configure_models(self) -> None:
        self.model = GPT(self.gpt_config)  # on the meta device: nothing allocated yet

    def estimate_model_flops_per_token(self) -> float | None:
        """The model's training FLOPs per token with attention at this run's context length
        (causal: counted at half); the dense 6N estimate for a model without the count."""
        count = getattr(self.model, "flops_per_token", None)
        return count(self.config.model.block_size) if count is not None else super().estimate_model_flops_per_token()

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
        """On one device the whole model is one compiled region (the fewest calls into
        compiled code per step: what a small model's step time is made of), but for the
        embeddings, which stay eager: inductor's embedding backward adds into the gradient
        with atomics, so two runs (and a run and its resume) would differ in the last bits;
        ATen's does not. Sharded or split (FSDP2, DDP, TP, pipeline, context parallel) each
        block is a region of its own: FSDP2 gathers and DDP reduces block by block around
        them, and the blocks share one graph, compiled once (benchmarks/compile.py measures
        both). On one GPU the region runs as CUDA graphs (`cuda_graphs`, on by default): the
        host launching kernels one by one is what made the compiled demo no faster than eager
        there."""
        if self.world.world_size == 1:
            for embedding in (self.model.tok_emb, self.model.pos_emb):
                embedding.forward = torch.compiler.disable(embedding.forward)
            graphs = self.config.cuda_graphs and self.world.device.type == "cuda"
            self.compile_module(self.model, **({"mode": "reduce-overhead"} if graphs else {}))
            return
        for block in self.model.blocks:
            self.compile_module(block)

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
            lr=self.config.lr,
            betas=(0.9, 0.95),
        )

    def configure_schedulers(self) -> None:
        warmup, total = self.config.warmup, self.config.training_parameters.max_steps or 1

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
        block, delay_ms = self.config.model.block_size, self.config.data.data_delay_ms
        documents = {"document_info": True, "mask_document_boundaries": True} if self.config.data.documents else {}
        if documents and (self.pipeline is not None or self.context_parallel is not None):
            raise ValueError("--data.documents with pipeline or context parallelism: the document mask reaches "
                             "neither the pipeline's stages nor ring attention; run them without --data.documents")
        train: Any = TokenLoader.for_trainer(self, self.train_file, block, prefetch=self.config.data.prefetch,
                                             **documents)
        if delay_ms:
            train = _Slow(train, delay_ms / 1000)
        val_set = TokenDataset(self.val_file, block, **documents)
        sampler = DistributedSampler(val_set, self.world.dp_size, self.world.dp_rank, shuffle=False)
        pin = self.world.device.type == "cuda"  # the training batches are pinned by the TokenLoader
        return train, DataLoader(val_set, batch_size=train.micro_batch_size, sampler=sampler, pin_memory=pin)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = _model_inputs(batch)
        loss = self.forward_backward(self.model, x, y, lm_loss)  # through the stages when pipelined
        self.step(self.optimizer)
        return {"loss": loss}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = _model_inputs(batch)
        return {"loss": self.forward_loss(self.model, x, y, lm_loss)}


def _model_inputs(batch: Any) -> tuple[Any, torch.Tensor]:
    """``(what the model takes, targets)``: the token ids, or with --data.documents the
    ids, position ids and document ids (``model(*inputs)``)."""
    if isinstance(batch, DocumentBatch):
        return (batch.inputs, batch.position_ids, batch.document_ids), batch.targets
    x, y = batch
    return x, y


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


def _layout(**device: Any) -> dict[str, Any]:
    return {"device_parameters": device}


# --parallel NAME: how ranks share the work (single: one process; tp needs 2 ranks, hsdp and fsdp_tp 4).
PRESETS = {"parallel": {
    "single": _layout(dp_replicate=1, dp_shard=1),
    "ddp": _layout(dp_replicate="auto", dp_shard=1),  # one rank: plain; N ranks: gradients averaged
    "fsdp": _layout(dp_replicate=1, dp_shard="auto"),  # parameters, gradients and optimizer state sharded
    "hsdp": _layout(dp_replicate="auto", dp_shard=2),  # shard in pairs, replicate pairs
    "tp": _layout(dp_replicate="auto", dp_shard=1, tensor_parallel=2),  # x DDP on 4+ ranks
    "fsdp_tp": _layout(dp_replicate=1, dp_shard="auto", tensor_parallel=2),  # 4+ ranks
    "pp": _layout(dp_replicate=1, dp_shard="auto", pipeline_parallel=2),  # 2 stages (x FSDP2 on 4+ ranks)
    "cp": _layout(dp_replicate=1, dp_shard="auto", context_parallel=2),  # sequences in 2 (x FSDP2 on 4+ ranks)
}}

# Short flags for the fields set most often (each is the dotted flag's other name).
ALIASES = {
    "--steps": "--training_parameters.max_steps",
    "--batch-size": "--training_parameters.global_batch_size",
    "--micro-batch-size": "--training_parameters.micro_batch_size",
    "--val-every": "--training_parameters.val_every_n_steps",
    "--val-batches": "--training_parameters.val_steps_per_epoch",
    "--log-every": "--logging_parameters.log_every_n_steps",
    "--compile": "--device_parameters.compile_model",
    "--n-chars": "--data.n_chars",
    "--data-dir": "--data.data_dir",
    "--data-delay-ms": "--data.data_delay_ms",
    "--block-size": "--model.block_size",
    "--n-layer": "--model.n_layer",
    "--n-head": "--model.n_head",
    "--d-model": "--model.d_model",
    "--root-dir": "--root_dir",
    "--run-name": "--run_name",
    "--checkpoint-every": "--checkpoint.every_n_steps",
    "--async-checkpoint": "--checkpoint.async_mode",
    "--resume": "--checkpoint.resume_mode",
    "--ft-group": "--ft_group",
    "--ft-start-groups": "--ft_start_groups",
}


# The layouts as DeviceParameters constructors (benchmarks: PARALLEL["fsdp"](device="cuda")).
PARALLEL = {name: (lambda sizes: lambda **kw: DeviceParameters(**sizes, **kw))(preset["device_parameters"])
            for name, preset in PRESETS["parallel"].items()}


def parse_args(argv: list[str]) -> GPTRunConfig:
    """The demo's config from its flags (no subcommand): what the benchmarks build trainers from."""
    return cli.parse(GPTRunConfig(), argv, aliases=ALIASES, presets=PRESETS).config


def demo_config(config: TrainerConfig, demo: GPTRunConfig) -> GPTRunConfig:
    """`demo`'s own fields (model, data, lr, ...) with `config`'s trainer fields."""
    return dataclasses.replace(demo, **{f.name: getattr(config, f.name) for f in dataclasses.fields(TrainerConfig)})


def _trackers(config: GPTRunConfig) -> list[Callback[Any]]:
    from dream_trainer.callbacks import MLflowLoggerCallback, WandbLoggerCallback

    made = {"wandb": WandbLoggerCallback, "mlflow": MLflowLoggerCallback}
    return [made[name]() for name in dict.fromkeys(config.trackers)]


def _fault_tolerance(config: GPTRunConfig) -> list[Callback[Any]]:
    if config.ft_group is None:
        return []
    from dream_trainer import FaultToleranceCallback, FaultToleranceParameters

    return [FaultToleranceCallback(FaultToleranceParameters(lighthouse=config.lighthouse, replica_group_id=config.ft_group,
                                                            start_groups=config.ft_start_groups,
                                                            heartbeat_interval=0.1, timeout_s=30.0))]


def main(argv: list[str] | None = None, callbacks: list[Callback[Any]] | None = None,
         trainer_cls: type[GPTTrainer] = GPTTrainer, config: GPTRunConfig | None = None) -> Any:
    """Run the command line (`argv`: default ``sys.argv[1:]``); returns the trainer for
    ``train`` and ``resume`` (what the subcommand returns otherwise). `callbacks` are added
    to the demo's own (see examples/callbacks); `trainer_cls`: another model on the same
    data and loop (examples/llama); `config`: other defaults."""
    history = ValidationHistory()

    def make(config: GPTRunConfig) -> GPTTrainer:
        own = [ProgressBarCallback(enabled=True if config.progress else None), LoggerCallback(), history,
               CheckpointCallback(config.checkpoint), *_trackers(config), *_fault_tolerance(config), *(callbacks or [])]
        return trainer_cls(dataclasses.replace(config, callbacks=own))

    result = cli.main(make, config or GPTRunConfig(), argv, aliases=ALIASES, presets=PRESETS,
                      description="Train a tiny GPT on a generated corpus (examples/gpt/train.py).")
    if isinstance(result, GPTTrainer) and result.world.is_rank_zero and history.history:
        steps = ", ".join(f"{step}: {loss:.3f}" for step, loss in history.history)
        print(f"validation loss by step: {steps}")
        print(f"logs: {result.run_dir / 'logs'}")
        print(f"goodput: {result.goodput.line()} (the table: {result.run_dir / 'goodput.json'})")
        if result.status == "preempted":
            print(f"preempted at step {result.global_step}: run again with --run-name {result.run_name} to resume")
    return result


if __name__ == "__main__":
    # 75 when preempted (SIGTERM/Ctrl-C: checkpointed at a step boundary), so a scheduler
    # or torchrun --max-restarts can tell it from a crash and restart to resume; with
    # --nproc N the launcher exits with the ranks' status too.
    # Other subcommands return their output: status 0.
    raise SystemExit(getattr(entrypoint(main), "exit_code", 0))

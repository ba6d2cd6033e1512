"""A blend of token files (`dream_trainer.data.TokenBlend`) through `DreamTrainer`: the run
trains on the blend's global batches, logs its exact per-source counts, and a checkpoint taken
on a validation step resumes on another world size (2 gloo ranks with FSDP2 -> 1 process, and
1 -> 2) with the same samples step by step (each step's multiset of ``(source, id)`` rows the
uninterrupted run's: none replayed, none skipped), the same counts and the uninterrupted run's
loss curve; a position of another blend is refused at the resume.

A global batch can hold one sample twice: when a source's own epoch ends inside the step, the
end of one permutation and the start of the next are both in it (steps 5 and 9 here, for
``small``). That is the blend's design (every sample once per pass of its source), so the
reference run is checked pass by pass, not for distinct ids within a step.

Every run starts from the same seed and the same weights (drawn as full tensors, then each rank
keeps its shard); no weights are copied between runs. The blend: ``small`` (49 windows, weight
0.7: about 11 samples a step, so it repeats, epoch after epoch of its own) and ``big`` (79
windows, weight 0.3); its nominal epoch is (49 + 79) // 16 = 8 steps, so the 12 steps cross one.
Tolerance of the losses: rel 1e-4, the FSDP2 reduce-scatter summing a global batch's gradient
in its own order (tests/distributed/test_data_resume.py's FSDP tolerance)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from dream_trainer import (
    Callback,
    CheckpointCallback,
    CheckpointParameters,
    DeviceParameters,
    DreamTrainer,
    TrainerConfig,
    TrainingParameters,
)
from dream_trainer.data import TokenBlend, TokenDataset, TokenFile, TokenLoader, write_tokens
from dream_trainer.testing import copy_full_, spawn_world

SEQ, VOCAB, G, MICRO, STEPS, CUT = 8, 64, 16, 4, 12, 5
WEIGHTS = {"small": 0.7, "big": 0.3}
NAMES = list(WEIGHTS)
TOLERANCE = 1e-4


class BlendLM(DreamTrainer):
    """An Embedding + Linear language model on a blend (validated on a file of its own)."""

    def __init__(self, config: TrainerConfig, files: dict[str, str], weights: dict[str, float], val: str):
        super().__init__(config)
        self.files, self.weights, self.val = files, weights, val

    def configure_models(self) -> None:
        self.model = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB))

    def init_weights(self) -> None:
        """Full tensors from a generator, each rank keeping its part: the same weights on 1 and
        2 ranks."""
        g = torch.Generator().manual_seed(0)
        for _, param in self.model.named_parameters():
            copy_full_(param, torch.randn(param.shape, generator=g) * 0.1)

    def apply_fully_shard(self, fsdp_config: dict[str, Any]) -> None:
        from torch.distributed.fsdp import fully_shard

        for layer in self.model:
            fully_shard(layer, **fsdp_config)
        fully_shard(self.model, **fsdp_config)

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.05)

    def configure_dataloaders(self) -> tuple[Any, Any]:
        blend = TokenBlend({name: (self.files[name], weight) for name, weight in self.weights.items()})
        train = TokenLoader.for_trainer(self, blend, SEQ, return_ids=True)
        val_set = TokenDataset(self.val, SEQ)
        sampler = DistributedSampler(val_set, self.world.dp_size, self.world.dp_rank, shuffle=False)
        return train, DataLoader(val_set, batch_size=train.micro_batch_size, sampler=sampler)

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y, ids = batch
        loss = self._loss(x, y)
        self.backward(loss)
        self.step(self.optimizer)
        self.log_dict(self.train_dataloader.log_metrics())  # type: ignore[union-attr]
        return {"loss": loss, "ids": ids, "x": x}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        return {"loss": self._loss(x, y)}


class Record(Callback[DreamTrainer]):
    """Per micro-batch on this rank: (step, its ``(source, id)`` rows, its inputs); per logged
    step: the loss (the mean over ranks) and the blend's metrics."""

    def __init__(self) -> None:
        self.micro: list[tuple[int, list[list[int]], list[list[int]]]] = []
        self.logged: dict[int, float] = {}
        self.blend: dict[int, dict[str, float]] = {}
        self.resumed_from: str | None = None
        self.steps = 0
        self.validated: list[int] = []

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        step = self.trainer.global_step + (1 if self.trainer.is_accumulating_gradients else 0)
        self.micro.append((step, result["ids"].tolist(), result["x"].tolist()))

    def post_validation_epoch(self, result: dict[str, Any]) -> None:
        self.validated.append(self.trainer.global_step)

    def on_log(self, metrics: dict[str, float], step: int) -> None:
        if "train/loss" in metrics:
            self.logged[step] = metrics["train/loss"]
        data = {k: v for k, v in metrics.items() if k.startswith("data/")}
        if data:
            self.blend[step] = data

    def post_fit(self) -> None:
        resumed = self.trainer.callbacks["CheckpointCallback"].resumed_from
        self.resumed_from = None if resumed is None else resumed.name
        self.steps = self.trainer.global_step


def _fit(root: str, files: dict[str, str], val: str, max_steps: int, ranks: int = 1,
         weights: dict[str, float] | None = None) -> dict[str, Any]:
    """One run (on this process, or on each rank of a `spawn_world`): checkpoints under `root`
    every CUT steps, after that step's validation; resumes from the newest one there."""
    record = Record()
    checkpoints = CheckpointCallback(CheckpointParameters(root_dir=root, every_n_steps=CUT, every_n_epochs=None,
                                                          async_mode="off"))
    device = DeviceParameters.FSDP(dp_shard=2) if ranks == 2 else DeviceParameters.SINGLE_DEVICE()
    config = TrainerConfig(run_name="blend", seed=3, device_parameters=device, callbacks=[record, checkpoints],
                           training_parameters=TrainingParameters(
                               n_epochs=None, max_steps=max_steps, global_batch_size=G, micro_batch_size=MICRO,
                               num_sanity_val_steps=0, val_every_n_steps=CUT, val_steps_per_epoch=2))
    config.logging_parameters.log_every_n_steps = 1
    trainer = BlendLM(config, files, weights or WEIGHTS, val)
    trainer.fit()
    return {"micro": record.micro, "logged": record.logged, "blend": record.blend, "steps": record.steps,
            "resumed_from": record.resumed_from, "validated": record.validated,
            "accumulation": trainer.gradient_accumulation_steps,
            "sharded": [type(p).__name__ == "DTensor" for p in trainer.model.parameters()]}


def _write(path, n_tokens: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return str(write_tokens(path, [rng.integers(0, VOCAB, size=n_tokens)]))


@pytest.fixture()
def data(tmp_path):
    """small: 49 windows of 8 tokens, big: 79, val: 24 (every window distinct)."""
    files = {"small": _write(tmp_path / "small.tokens", 400, 0), "big": _write(tmp_path / "big.tokens", 640, 1)}
    sizes = {name: TokenFile(path).n_samples(SEQ) for name, path in files.items()}
    assert sizes == {"small": 49, "big": 79}
    return files, _write(tmp_path / "val.tokens", 200, 2)


def _steps(runs: list[dict[str, Any]]) -> dict[int, list[tuple[int, int]]]:
    """Each step's ``(source, id)`` rows over all the ranks' micro-batches, sorted (a repeated
    sample stays twice in the list)."""
    out: dict[int, list[tuple[int, int]]] = {}
    for run in runs:
        for step, ids, _ in run["micro"]:
            out.setdefault(step, []).extend(tuple(row) for row in ids)
    return {step: sorted(rows) for step, rows in sorted(out.items())}


def _check_samples_are_the_sources(runs: list[dict[str, Any]], files: dict[str, str]) -> None:
    """The rows' ids name what was trained on: each input is that source's window."""
    opened = [TokenFile(files[name]) for name in NAMES]
    for run in runs:
        for _, ids, inputs in run["micro"]:
            for (source, i), x in zip(ids, inputs):
                assert x == opened[source].sample(i, SEQ)[:-1].astype(np.int64).tolist()


def _counts(steps: dict[int, list[tuple[int, int]]]) -> dict[int, dict[str, float]]:
    """The blend's metrics recomputed from the samples: each source's samples up to each step
    (and the passes over it)."""
    sizes = {"small": 49, "big": 79}
    taken, out = dict.fromkeys(NAMES, 0), {}
    for step in sorted(steps):
        for source, _ in steps[step]:
            taken[NAMES[source]] += 1
        out[step] = {**{f"data/samples/{n}": float(taken[n]) for n in NAMES},
                     **{f"data/epochs/{n}": taken[n] / sizes[n] for n in NAMES}}
    return out


def _check_reference(full: dict[str, Any], files: dict[str, str]) -> dict[int, list[tuple[int, int]]]:
    """The uninterrupted run: 12 steps of 16 samples, each source's passes whole, the small
    source repeating, the logged counts those of the samples."""
    steps = _steps([full])
    assert full["steps"] == STEPS and full["accumulation"] == G // MICRO
    assert sorted(steps) == list(range(1, STEPS + 1))
    assert all(len(rows) == G for rows in steps.values())
    # Each source's epochs: after every step, every sample of a source taken e or e + 1 times
    # (e: its whole passes), the extra ones as many as the current pass has taken.
    sizes, seen = [49, 79], [np.zeros(49, dtype=int), np.zeros(79, dtype=int)]
    for rows in steps.values():
        for source, i in rows:
            seen[source][i] += 1
        for n, counts in zip(sizes, seen):
            passes, extra = divmod(int(counts.sum()), n)
            assert set(counts.tolist()) <= {passes, passes + 1} and int((counts == passes + 1).sum()) == extra
    assert seen[0].sum() == 134 and seen[0].min() == 2  # 12 * 16 * 0.7 = 134.4: the small source repeats
    assert seen[1].sum() == 58 and seen[1].max() == 1  # the big one is in its first pass
    assert full["blend"] == _counts(steps)
    assert sorted(full["logged"]) == list(range(1, STEPS + 1))
    _check_samples_are_the_sources([full], files)
    return steps


def _check_resumed(cut: list[dict[str, Any]], resumed: list[dict[str, Any]], full: dict[str, Any],
                   reference: dict[int, list[tuple[int, int]]]) -> None:
    """`cut` (each of its ranks) stopped at CUT and `resumed` (each rank) went on from its
    checkpoint: together the uninterrupted run's samples, counts and losses."""
    before, after = range(1, CUT + 1), range(CUT + 1, STEPS + 1)
    assert {run["steps"] for run in cut} == {CUT} and {run["steps"] for run in resumed} == {STEPS}
    assert {tuple(run["validated"]) for run in cut} == {(CUT,)}  # the checkpoint of a validation step
    assert {run["resumed_from"] for run in resumed} == {f"step_{CUT:09d}"}
    first, second = _steps(cut), _steps(resumed)
    assert first == {s: reference[s] for s in before}  # every step's 16 samples, none twice, none skipped
    assert second == {s: reference[s] for s in after}  # resumed at the cut, not replayed, nothing skipped
    expected = _counts(reference)
    for run in cut:
        assert run["blend"] == {s: expected[s] for s in before}
    for run in resumed:  # the resumed run's counts go on from the saved position
        assert run["blend"] == {s: expected[s] for s in after}
        assert sorted(run["logged"]) == list(after)
        assert run["logged"] == pytest.approx({s: full["logged"][s] for s in after}, rel=TOLERANCE)
    for run in cut:
        assert run["logged"] == pytest.approx({s: full["logged"][s] for s in before}, rel=TOLERANCE)


def test_two_fsdp_ranks_checkpoint_a_blend_and_one_process_resumes_it(tmp_path, data):
    files, val = data
    full = _fit(str(tmp_path / "full"), files, val, STEPS)
    reference = _check_reference(full, files)
    root = str(tmp_path / "two_to_one")
    cut = spawn_world(2, _fit, root, files, val, CUT, 2, timeout=120)
    assert {run["accumulation"] for run in cut} == {G // (2 * MICRO)}
    assert all(all(run["sharded"]) for run in cut) and not any(full["sharded"])  # FSDP2 on 2 ranks
    resumed = _fit(root, files, val, STEPS)
    assert resumed["accumulation"] == G // MICRO
    _check_resumed(cut, [resumed], full, reference)
    _check_samples_are_the_sources([*cut, resumed], files)


def test_one_process_checkpoints_a_blend_and_two_fsdp_ranks_resume_it(tmp_path, data):
    files, val = data
    full = _fit(str(tmp_path / "full"), files, val, STEPS)
    reference = _check_reference(full, files)
    root = str(tmp_path / "one_to_two")
    cut = _fit(root, files, val, CUT)
    resumed = spawn_world(2, _fit, root, files, val, STEPS, 2, timeout=120)
    assert {run["accumulation"] for run in resumed} == {G // (2 * MICRO)}
    assert all(all(run["sharded"]) for run in resumed) and not any(cut["sharded"])  # FSDP2 on 2 ranks
    _check_resumed([cut], resumed, full, reference)
    _check_samples_are_the_sources([cut, *resumed], files)


def test_a_checkpoint_of_another_blend_is_refused_at_the_resume(tmp_path, data):
    files, val = data
    root = str(tmp_path / "run")
    cut = _fit(root, files, val, CUT)
    assert cut["steps"] == CUT
    with pytest.raises(ValueError, match=r"the saved data position is of another blend \(small: weight 0\.7 saved, "
                                         r"0\.6 now; big: weight 0\.3 saved, 0\.4 now\).*allow_different_data=True"):
        _fit(root, files, val, STEPS, weights={"small": 0.6, "big": 0.4})

"""Resume across world sizes (issue 23): the GPT demo, which trains from token files with a
`TokenLoader` and ``--batch-size`` as the global batch, checkpointed on a validation step
with 2 data-parallel ranks resumes on 1 (and 1 -> 2) on the same samples in the same global
order, and its loss curve goes on as the uninterrupted run's with that global batch. Each
step's samples are compared by id (read back from the token file), not only through the
losses: every rank's micro-batches of a step together are the one-rank run's global batch.

The tolerance, relative per step: the global batch and its order are the same; what differs
is the order in which one global batch's gradient is summed, a float32 rounding that Adam
carries through the steps. With DDP (two ranks' micro-batch means averaged by an all-reduce,
or one rank accumulating the same two micro-batches) within 1e-5 (seen: below 1e-6); with
FSDP2 (its reduce-scatter sums in its own order) within 1e-4, the acceptance matrix's eager
float32 tolerance (seen: 2.1e-5 at step 12). The same bounds compare the two layouts' whole
uninterrupted runs."""

from __future__ import annotations

from typing import Any

import pytest

from dream_trainer import Callback
from dream_trainer.testing import spawn_world
from tests.demos import SMALL, Record, load

STEPS, CUT = 12, 5
ARGS = [*SMALL, "--steps", str(STEPS), "--val-every", str(CUT), "--checkpoint-every", str(CUT), "--val-batches", "2",
        "--batch-size", "16", "--micro-batch-size", "8", "--async-checkpoint", "off"]
TOLERANCE = {"ddp": 1e-5, "fsdp": 1e-4}  # fsdp: tests/acceptance/test_matrix.py's eager float32 tolerance


class SampleIds(Callback[Any]):
    """The sample ids of each optimizer step's micro-batches on this rank, read back from the
    token file: a window's inputs are found among the file's windows (each is unique in the
    generated corpus; a repeated one fails the test)."""

    def __init__(self) -> None:
        self.ids: dict[int, list[int]] = {}
        self._index: dict[bytes, int] | None = None

    def pre_train_step(self, batch: Any, batch_idx: int) -> None:
        loader = self.trainer.train_dataloader
        if self._index is None:
            tokens, seq_len = loader.file.tokens, loader.seq_len
            n = loader.file.n_samples(seq_len)
            self._index = {tokens[i * seq_len:(i + 1) * seq_len].astype("int64").tobytes(): i for i in range(n)}
            assert len(self._index) == n, "repeated windows: ids cannot be read back"
        step = self.trainer.global_step + 1
        for row in batch[0].cpu().numpy():
            self.ids.setdefault(step, []).append(self._index[row.tobytes()])


def _train(root: str, run: str, resume: str = "None", parallel: str = "ddp") -> dict:
    record, ids = Record(), SampleIds()
    argv = [*ARGS, "--root-dir", root, "--run-name", run, "--resume", resume, "--parallel", parallel]
    trainer = load("gpt").main(argv, callbacks=[record, ids])
    resumed = trainer.callbacks["CheckpointCallback"].resumed_from
    return {"losses": record.losses, "accumulation": trainer.gradient_accumulation_steps,
            "resumed_from": None if resumed is None else str(resumed), "steps": trainer.global_step,
            "ids": ids.ids}


def _world_ids(ranks: list[dict]) -> dict[int, list[int]]:
    """Each step's sample ids over all ranks, sorted."""
    steps = {step for rank in ranks for step in rank["ids"]}
    return {step: sorted(i for rank in ranks for i in rank["ids"].get(step, [])) for step in steps}


def _checkpoint(root, run):
    return str(root / "gpt" / run / "checkpoints" / f"step_{CUT:09d}")


@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_a_checkpoint_of_two_ranks_resumes_on_one_and_one_on_two(tmp_path, layout):
    """`layout`: the 2-rank runs' (DDP, or FSDP2 with sharded checkpoints); one rank is one
    process without sharding."""
    one = _train(str(tmp_path), "one")
    two_ranks = spawn_world(2, _train, str(tmp_path), "two", "None", layout, timeout=300)
    two = two_ranks[0]
    assert (one["accumulation"], two["accumulation"]) == (2, 1)  # 16 = 1 x 8 x 2 = 2 x 8 x 1
    # Step by step, the two ranks' samples together are the one rank's global batch, 16 distinct ids.
    assert sorted(one["ids"]) == list(range(1, STEPS + 1)) and all(len(set(v)) == 16 for v in one["ids"].values())
    assert _world_ids(two_ranks) == _world_ids([one])
    assert set(two_ranks[0]["ids"][1]).isdisjoint(two_ranks[1]["ids"][1])
    assert sorted(one["losses"]) == sorted(two["losses"]) == list(range(1, STEPS + 1))
    # The same global batches from the start: the layouts track each other.
    assert two["losses"] == pytest.approx(one["losses"], rel=TOLERANCE[layout])

    two_to_one = _train(str(tmp_path), "two_to_one", _checkpoint(tmp_path, "two"))
    one_to_two_ranks = spawn_world(2, _train, str(tmp_path), "one_to_two", _checkpoint(tmp_path, "one"), layout,
                                   timeout=300)
    one_to_two = one_to_two_ranks[0]
    reference_ids = _world_ids([one])
    for resumed_ids in (_world_ids([two_to_one]), _world_ids(one_to_two_ranks)):  # the same samples after the cut
        assert resumed_ids == {s: reference_ids[s] for s in range(CUT + 1, STEPS + 1)}
    assert two_to_one["resumed_from"] == _checkpoint(tmp_path, "two")
    assert one_to_two["resumed_from"] == _checkpoint(tmp_path, "one")
    after = list(range(CUT + 1, STEPS + 1))
    for resumed, reference in ((two_to_one, one), (one_to_two, two)):
        assert resumed["steps"] == STEPS and sorted(resumed["losses"]) == after  # resumed at the cut, not replayed
        assert resumed["losses"] == pytest.approx({s: reference["losses"][s] for s in after}, rel=TOLERANCE[layout])

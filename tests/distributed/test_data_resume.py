"""Resume across world sizes (issue 23): the GPT demo, which trains from token files with a
`TokenLoader` and ``--batch-size`` as the global batch, checkpointed on a validation step
with 2 data-parallel ranks resumes on 1 (and 1 -> 2) on the same samples in the same global
order, and its loss curve goes on as the uninterrupted run's with that global batch.

The tolerance, relative per step: the global batch and its order are the same; what differs
is the order in which one global batch's gradient is summed, a float32 rounding that Adam
carries through the steps. With DDP (two ranks' micro-batch means averaged by an all-reduce,
or one rank accumulating the same two micro-batches) within 1e-5 (seen: below 1e-6); with
FSDP2 (its reduce-scatter sums in its own order) within 1e-4, the acceptance matrix's eager
float32 tolerance (seen: 2.1e-5 at step 12). The same bounds compare the two layouts' whole
uninterrupted runs."""

from __future__ import annotations

import pytest

from dream_trainer.testing import spawn_world
from tests.demos import SMALL, Record, load

STEPS, CUT = 12, 5
ARGS = [*SMALL, "--steps", str(STEPS), "--val-every", str(CUT), "--checkpoint-every", str(CUT), "--val-batches", "2",
        "--batch-size", "16", "--micro-batch-size", "8", "--async-checkpoint", "off"]
TOLERANCE = {"ddp": 1e-5, "fsdp": 1e-4}  # fsdp: tests/acceptance/test_matrix.py's eager float32 tolerance


def _train(root: str, run: str, resume: str = "None", parallel: str = "ddp") -> dict:
    record = Record()
    argv = [*ARGS, "--root-dir", root, "--run-name", run, "--resume", resume, "--parallel", parallel]
    trainer = load("gpt").main(argv, callbacks=[record])
    resumed = trainer.callbacks["CheckpointCallback"].resumed_from
    return {"losses": record.losses, "accumulation": trainer.gradient_accumulation_steps,
            "resumed_from": None if resumed is None else str(resumed), "steps": trainer.global_step}


def _checkpoint(root, run):
    return str(root / "gpt" / run / "checkpoints" / f"step_{CUT:09d}")


@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_a_checkpoint_of_two_ranks_resumes_on_one_and_one_on_two(tmp_path, layout):
    """`layout`: the 2-rank runs' (DDP, or FSDP2 with sharded checkpoints); one rank is one
    process without sharding."""
    one = _train(str(tmp_path), "one")
    two = spawn_world(2, _train, str(tmp_path), "two", "None", layout, timeout=300)[0]
    assert (one["accumulation"], two["accumulation"]) == (2, 1)  # 16 = 1 x 8 x 2 = 2 x 8 x 1
    assert sorted(one["losses"]) == sorted(two["losses"]) == list(range(1, STEPS + 1))
    # The same global batches from the start: the layouts track each other.
    assert two["losses"] == pytest.approx(one["losses"], rel=TOLERANCE[layout])

    two_to_one = _train(str(tmp_path), "two_to_one", _checkpoint(tmp_path, "two"))
    one_to_two = spawn_world(2, _train, str(tmp_path), "one_to_two", _checkpoint(tmp_path, "one"), layout,
                             timeout=300)[0]
    assert two_to_one["resumed_from"] == _checkpoint(tmp_path, "two")
    assert one_to_two["resumed_from"] == _checkpoint(tmp_path, "one")
    after = list(range(CUT + 1, STEPS + 1))
    for resumed, reference in ((two_to_one, one), (one_to_two, two)):
        assert resumed["steps"] == STEPS and sorted(resumed["losses"]) == after  # resumed at the cut, not replayed
        assert resumed["losses"] == pytest.approx({s: reference["losses"][s] for s in after}, rel=TOLERANCE[layout])

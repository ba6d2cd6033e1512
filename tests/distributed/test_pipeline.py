"""Pipeline parallelism on 2 gloo ranks, through the GPT demo's own ``main``: each schedule
tracks the single-process loss curve from the same seed; a checkpoint taken on a validation
step resumes bit-exactly on the same layout, and across a change of ``pipeline_parallel``
(2 stages -> 1 process, 1 process -> 2 stages)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dream_trainer.testing import spawn_world
from tests.demos import SMALL, Record, assert_tracks_and_resumes, curve, load

STEPS, EVERY = 6, 3
# 4 blocks: 2 stages of 2, or 4 stages (2 per rank) for the interleaved schedules; 4 micro-batches of 2.
ARGS = [*SMALL, "--n-layer", "4", "--steps", str(STEPS), "--val-every", str(EVERY), "--checkpoint-every", str(EVERY),
        "--val-batches", "2", "--batch-size", "8", "--async-checkpoint", "off"]
TOLERANCE = 1e-4  # relative: one batch at once vs. micro-batches through the stages (summation order)


def _train(root: str, run: str, layout: str, schedule: str = "auto", resume: str = "None") -> dict:
    if layout == "pp" and not dist.is_initialized():
        dist.init_process_group("gloo")
    record = Record()
    trainer = load("gpt").main([*ARGS, "--parallel", layout, "--root-dir", root, "--run-name", run, "--resume", resume,
                                "--device_parameters.pipeline.schedule", schedule], callbacks=[record])
    assert trainer.status == "completed"
    result = record.result()
    result["schedule"] = trainer.pipeline.choice.schedule if trainer.pipeline else None
    result["val"] = trainer.callbacks["ValidationHistory"].history if "ValidationHistory" in trainer.callbacks else None
    return result


def _full_and_resumed(root: str, schedule: str) -> dict:
    full = _train(root, "full", "pp", schedule)
    checkpoint = Path(root) / "gpt" / "full" / "checkpoints" / f"step_{EVERY:09d}"
    return {"full": full, "resumed": _train(root, "resumed", "pp", schedule, str(checkpoint))}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp-single")
    return str(root), _train(str(root), "single", "single")


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble"])
def test_two_stages_track_one_process_and_resume_exactly(schedule, single, tmp_path):
    _, reference = single
    ranks = spawn_world(2, _full_and_resumed, str(tmp_path), schedule, timeout=600)
    full, resumed = ranks[0]["full"], ranks[0]["resumed"]
    assert full["schedule"] == schedule  # auto's choice: tests/unit/test_pipeline_plan.py, test_readme_commands.py
    for rank in ranks[1:]:  # the loss reached every stage
        assert rank["full"]["losses"] == full["losses"]
    # The single-process start: each stage's weights, bitwise, under their names in one process.
    held = [name for rank in ranks for name in rank["full"]["initial"]]
    assert sorted(held) == sorted(reference["initial"])
    for rank in ranks:
        for name, value in rank["full"]["initial"].items():
            assert torch.equal(value, reference["initial"][name]), name
    # One process's losses, validation through the pipeline too; the checkpoint taken on a
    # validation step resumes bit-exactly on the same layout.
    assert_tracks_and_resumes(full, resumed, reference, STEPS, EVERY, TOLERANCE)
    for rank in ranks:
        for name, value in rank["full"]["final"].items():
            assert torch.equal(rank["resumed"]["final"][name], value), name


def _resume_pp(root: str, checkpoint: str) -> dict:
    return _train(root, "onto-pp", "pp", "auto", checkpoint)


def test_resume_across_a_change_of_pipeline_stages(single, tmp_path):
    """A 1-process checkpoint resumes on 2 stages, and a 2-stage one in 1 process: both
    continue the single-process curve."""
    root, reference = single
    steps = range(EVERY + 1, STEPS + 1)
    one = str(Path(root) / "gpt" / "single" / "checkpoints" / f"step_{EVERY:09d}")
    stages = spawn_world(2, _resume_pp, str(tmp_path), one, timeout=600)
    onto_pp = stages[0]
    assert sorted(onto_pp["losses"]) == list(steps)
    torch.testing.assert_close(curve(onto_pp, steps), curve(reference, steps), rtol=TOLERANCE, atol=0.0)
    staged = str(tmp_path / "gpt" / "onto-pp" / "checkpoints" / f"step_{STEPS:09d}")
    back = _train(str(tmp_path), "back", "single", resume=staged)
    assert back["losses"] == {}  # the run was complete: nothing left to train ...
    staged_final = {name: value for rank in stages for name, value in rank["final"].items()}
    assert sorted(back["final"]) == sorted(staged_final) == sorted(reference["final"])
    for name, value in back["final"].items():  # ... and every stage's weights came back, exactly
        assert torch.equal(value, staged_final[name]), name


def _layouts(root: str, layouts: dict[str, tuple[str, ...]]) -> dict:
    dist.init_process_group("gloo")
    runs = {}
    for name, extra in layouts.items():
        record = Record()
        trainer = load("gpt").main([*ARGS, "--batch-size", "16", "--parallel", "pp", "--root-dir", root, "--run-name", name,
                                    "--resume", "None", "--checkpoint-every", "None", *extra], callbacks=[record])
        runs[name] = {"schedule": trainer.pipeline.choice.schedule, "plan": trainer.world.plan.shape, **record.result()}
    return runs


def test_two_stages_with_data_parallelism_inside_on_four_ranks(tmp_path):
    """PP x FSDP2, PP x DDP and PP x TP on 4 ranks (2 stages, each over 2 ranks) track one
    process: Interleaved1F1B with FSDP2 stages, zero-bubble with replicated ones (with
    sharded stages it differs from one process: refused, `test_pipeline_plan`), TP under
    the automatic choice (the cost model's: never zero-bubble at this size over gloo)."""
    ranks = spawn_world(4, _layouts, str(tmp_path), {"pp-fsdp": INTERLEAVED, "pp-ddp": (*REPLICATE, "--device_parameters.dp_shard", "1",
                                                                             *ZERO_BUBBLE),
                                                     "pp-tp": (*TP, "--device_parameters.dp_shard", "1")}, timeout=600)
    first = ranks[0]
    assert first["pp-fsdp"]["plan"] == (2, 1, 2, 1, 1) and first["pp-fsdp"]["schedule"] == "Interleaved1F1B"
    assert first["pp-ddp"]["plan"] == (2, 2, 1, 1, 1) and first["pp-ddp"]["schedule"] == "InterleavedZeroBubble"
    assert first["pp-tp"]["plan"] == (2, 1, 1, 1, 2) and first["pp-tp"]["schedule"] != "InterleavedZeroBubble"
    _track_one_process(ranks, tmp_path)


ZERO_BUBBLE = ("--device_parameters.pipeline.schedule", "InterleavedZeroBubble")
INTERLEAVED = ("--device_parameters.pipeline.schedule", "Interleaved1F1B")
REPLICATE, TP = ("--device_parameters.dp_replicate", "2"), ("--device_parameters.tensor_parallel", "2")


def _track_one_process(ranks: list[dict], tmp_path: Path) -> None:
    single = load("gpt").main([*ARGS, "--batch-size", "16", "--parallel", "single", "--root-dir", str(tmp_path),
                               "--run-name", "single16", "--resume", "None", "--checkpoint-every", "None"],
                              callbacks=[record := Record()])
    assert single.status == "completed"
    steps = range(1, STEPS + 1)
    for name, run in ranks[0].items():
        torch.testing.assert_close(curve(run, steps), curve(record.result(), steps), rtol=TOLERANCE, atol=0.0,
                                   msg=lambda m, name=name: f"{name}: {m}")
        assert all(rank[name]["losses"] == run["losses"] for rank in ranks)


def test_two_stages_with_hsdp_and_with_fsdp_x_tp_on_eight_ranks(tmp_path):
    """PP x HSDP (2 stages x 2 replicas x 2 shards) and PP x FSDP2 x TP (2 x 2 x 2) on 8
    ranks track one process."""
    ranks = spawn_world(8, _layouts, str(tmp_path), {"pp-hsdp": (*REPLICATE, "--device_parameters.dp_shard", "2"),
                                                     "pp-fsdp-tp": (*TP, "--device_parameters.dp_shard", "2")}, timeout=600)
    assert ranks[0]["pp-hsdp"]["plan"] == (2, 2, 2, 1, 1) and ranks[0]["pp-fsdp-tp"]["plan"] == (2, 1, 2, 1, 2)
    _track_one_process(ranks, tmp_path)

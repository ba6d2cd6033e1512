"""Context parallelism on gloo ranks: ring attention (PyTorch's ring algorithm around SDPA's
CPU kernel) against whole-sequence attention, forward and backward; the GPT demo with its
sequences split over 2 ranks (FSDP2 over them) tracks one process from the same seed,
validates the same, resumes bit-exactly from a validation-step checkpoint and across a
change of ``context_parallel``; CP x FSDP2 and CP x HSDP on 4 ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import _get_current_function_mode_stack

from dream_trainer.context_parallel import ContextParallel, head_tail_indices, sequence_positions
from dream_trainer.testing import spawn_world
from tests.demos import SMALL, Record, assert_tracks_and_resumes, curve, load

STEPS, EVERY = 6, 3
ARGS = [*SMALL, "--steps", str(STEPS), "--val-every", str(EVERY), "--checkpoint-every", str(EVERY),
        "--val-batches", "2", "--batch-size", "8", "--async-checkpoint", "off"]
TOLERANCE = 1e-4  # relative: attention merged from ring blocks vs. one kernel call (summation order)


# ---------------------------------------------------------------------------- the sharding
def test_head_tail_indices_cover_the_sequence_once_and_balance_causal_work():
    for cp in (1, 2, 4):
        parts = [head_tail_indices(32, cp, r) for r in range(cp)]
        assert sorted(torch.cat(parts).tolist()) == list(range(32))
        causal_work = [int((p + 1).sum()) for p in parts]  # keys each rank's queries attend to
        assert len(set(causal_work)) == 1, causal_work
    assert head_tail_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert head_tail_indices(8, 2, 0).tolist() == [0, 1, 6, 7]


def test_head_tail_layout_is_pytorch_context_parallels():
    """On CUDA PyTorch's ring attention runs on our shards: it assumes its own head-tail
    layout, which `head_tail_indices` must be, rank by rank."""
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    for cp in (2, 4):
        order = _HeadTailLoadBalancer(32, cp, "cpu")._generate_indices()[0]  # rank 0's part, then rank 1's, ...
        assert torch.equal(torch.cat([head_tail_indices(32, cp, r) for r in range(cp)]), order)


def test_a_sequence_the_ranks_cannot_split_evenly_is_refused():
    with pytest.raises(ValueError, match=r"sequence length 30 is not divisible by 2 x context_parallel = 4.*multiple of 4"):
        head_tail_indices(30, 2, 0)
    with pytest.raises(ValueError, match="need 0 <= rank < cp"):
        head_tail_indices(32, 2, 2)


def test_positions_outside_a_region_are_arange():
    assert sequence_positions(5).tolist() == [0, 1, 2, 3, 4]


# ---------------------------------------------------------------------------- ring attention
def _ring_vs_whole(causal: bool) -> dict:
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    cp = ContextParallel(init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",)), seq_dim=2)
    torch.manual_seed(0)
    x = torch.randn(2, 4, 16, 8)  # (batch, heads, sequence, features): the same on every rank
    weight = torch.randn(8, 24, requires_grad=True)

    def attention(x: torch.Tensor) -> torch.Tensor:
        q, k, v = (x @ weight).split(8, -1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    whole = attention(x)
    (whole ** 2).sum().backward()
    whole_grad, weight.grad = weight.grad.clone(), None
    part = cp.shard(x)
    with cp.region(torch.device("cpu")):
        out = attention(part)
        positions = sequence_positions(part.shape[2]).tolist()
        refused = []
        for kwargs in ({"attn_mask": torch.ones(8, 8, dtype=torch.bool)}, {"dropout_p": 0.1}):
            try:
                F.scaled_dot_product_attention(part, part, part, **kwargs)
            except NotImplementedError as exc:
                refused.append(str(exc))
    (out ** 2).sum().backward()
    grad = weight.grad.clone()
    dist.all_reduce(grad)  # each rank's share of the gradient
    assert not _get_current_function_mode_stack()  # the ring's mode is gone after the region
    return {"out": out.detach(), "expected": whole.detach().index_select(2, torch.tensor(positions)),
            "grad": grad, "whole_grad": whole_grad, "positions": positions, "refused": refused}


@pytest.mark.parametrize("causal", [True, False])
def test_ring_attention_matches_whole_sequence_attention(causal):
    ranks = spawn_world(2, _ring_vs_whole, causal, timeout=120)
    assert ranks[0]["positions"] == [0, 1, 2, 3, 12, 13, 14, 15] and ranks[1]["positions"] == list(range(4, 12))
    for rank in ranks:
        torch.testing.assert_close(rank["out"], rank["expected"], rtol=1e-5, atol=1e-5)
        scale = rank["whole_grad"].abs().max()  # gradients of a sum of squares: ~1e3, summed in another order
        assert (rank["grad"] - rank["whole_grad"]).abs().max() <= 1e-5 * scale
        assert len(rank["refused"]) == 2
        assert "attn_mask=a tensor" in rank["refused"][0] and "dropout_p=0.1" in rank["refused"][1]


# ---------------------------------------------------------------------------- the demo
def _train(root: str, run: str, layout: str, resume: str = "None", extra: tuple[str, ...] = ()) -> dict:
    if layout != "single" and not dist.is_initialized():
        dist.init_process_group("gloo")
    record = Record()
    trainer = load("gpt").main([*ARGS, "--parallel", layout, "--root-dir", root, "--run-name", run, "--resume", resume,
                                *extra], callbacks=[record])
    assert trainer.status == "completed"
    result = record.result()
    result["plan"] = trainer.world.plan.shape
    result["val"] = trainer.callbacks["ValidationHistory"].history
    return result


def _full_and_resumed(root: str) -> dict:
    full = _train(root, "full", "cp")
    checkpoint = Path(root) / "gpt" / "full" / "checkpoints" / f"step_{EVERY:09d}"
    return {"full": full, "resumed": _train(root, "resumed", "cp", str(checkpoint))}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp-single")
    return str(root), _train(str(root), "single", "single")


def test_sequences_split_over_two_ranks_track_one_process_and_resume_exactly(single, tmp_path):
    _, reference = single
    ranks = spawn_world(2, _full_and_resumed, str(tmp_path), timeout=600)
    full, resumed = ranks[0]["full"], ranks[0]["resumed"]
    assert full["plan"] == (1, 1, 1, 2, 1)
    assert ranks[1]["full"]["losses"] == full["losses"]  # the sequences' mean loss on both ranks
    for name, value in full["initial"].items():  # FSDP2 over the 2 ranks, from one process's weights
        assert torch.equal(value, reference["initial"][name]), name
    # One process's losses and validation; the validation-step checkpoint resumes bit-exactly.
    assert_tracks_and_resumes(full, resumed, reference, STEPS, EVERY, TOLERANCE)
    for name, value in full["final"].items():
        assert torch.equal(resumed["final"][name], value), name


def _onto_cp(root: str, checkpoint: str) -> dict:
    return _train(root, "onto-cp", "cp", checkpoint)


def test_resume_across_a_change_of_context_parallel(single, tmp_path):
    root, reference = single
    steps = range(EVERY + 1, STEPS + 1)
    one = str(Path(root) / "gpt" / "single" / "checkpoints" / f"step_{EVERY:09d}")
    onto_cp = spawn_world(2, _onto_cp, str(tmp_path), one, timeout=600)[0]
    assert sorted(onto_cp["losses"]) == list(steps)
    torch.testing.assert_close(curve(onto_cp, steps), curve(reference, steps), rtol=TOLERANCE, atol=0.0)
    split = str(tmp_path / "gpt" / "onto-cp" / "checkpoints" / f"step_{STEPS:09d}")
    back = _train(str(tmp_path), "back", "single", resume=split)
    assert back["losses"] == {}  # complete: nothing left to train, and the weights came back exactly
    for name, value in back["final"].items():
        assert torch.equal(value, onto_cp["final"][name]), name


def _four_ranks(root: str) -> dict:
    dist.init_process_group("gloo")
    once = ("--checkpoint-every", "None", "--batch-size", "16")
    fsdp = _train(root, "cp-fsdp", "cp", extra=once)  # sequences in 2, batches in 2
    hsdp = _train(root, "cp-hsdp", "cp", extra=(*once, "--device_parameters.dp_replicate", "2",
                                                "--device_parameters.dp_shard", "1"))
    refused = None
    try:
        load("gpt").main([*ARGS, "--parallel", "cp", "--device_parameters.tensor_parallel", "2",
                          "--device_parameters.dp_shard", "1", "--root-dir", root, "--run-name", "cp-tp"])
    except ValueError as exc:
        refused = str(exc)
    return {"fsdp": fsdp, "hsdp": hsdp, "refused": refused}


def test_context_parallel_with_fsdp2_and_hsdp_on_four_ranks(tmp_path):
    ranks = spawn_world(4, _four_ranks, str(tmp_path), timeout=600)
    reference = _train(str(tmp_path), "single16", "single", extra=("--checkpoint-every", "None", "--batch-size", "16"))
    steps = range(1, STEPS + 1)
    first = ranks[0]
    assert first["fsdp"]["plan"] == (1, 1, 2, 2, 1) and first["hsdp"]["plan"] == (1, 2, 1, 2, 1)
    for layout in ("fsdp", "hsdp"):
        torch.testing.assert_close(curve(first[layout], steps), curve(reference, steps), rtol=TOLERANCE, atol=0.0)
        assert all(rank[layout]["losses"] == first[layout]["losses"] for rank in ranks)
    assert "composes with FSDP2/HSDP only for now" in first["refused"]

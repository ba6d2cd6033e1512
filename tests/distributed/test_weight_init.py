"""Sharded models start from the weights one process initializes with the same seed: after
`configure()`, every parameter's (and buffer's) ``full_tensor()`` equals the single-process
initialization, for the GPT demo and the Llama example (tied embeddings, RoPE buffers), on
FSDP2, TP, HSDP, FSDP2 x TP and TP x DDP over gloo (over NCCL: the cuda lane, where 2 GPUs
are present). Also: tied weights stay tied through materialization, and DTensor's "random
operators" warning (the sign of per-shard init on CPU) is no longer raised."""

import os
import warnings

import pytest
import torch
import torch.distributed as dist

from dream_trainer import DeviceParameters, TrainerConfig
from dream_trainer.testing import spawn_world
from tests.demos import SMALL, Record, load

LAYOUTS_2 = ("fsdp", "tp")
LAYOUTS_4 = ("hsdp", "fsdp_tp", "tp")  # tp on 4 ranks: TP x DDP


def _initial(example, parallel, root="runs"):
    record = Record(stop_after_configure=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = load(example).main([*SMALL, "--parallel", parallel, "--root-dir", root, "--resume", "None",
                                      "--checkpoint-every", "None"], callbacks=[record])
    assert trainer.status == "stopped"
    dtensor_warnings = [str(w.message) for w in caught if "DTensor random" in str(w.message)]
    return {"initial": record.initial, "warnings": dtensor_warnings,
            "tied": trainer.model.lm_head.weight is getattr(trainer.model, "model", trainer.model).embed_tokens.weight
            if example == "llama" else None}


def _ranks(layouts, backend="gloo"):
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["RANK"]))
    dist.init_process_group(backend)  # one group for every configure below
    return {(example, parallel): _initial(example, parallel) for example in ("gpt", "llama") for parallel in layouts}


def _check(ranks, layouts, reference):
    for example in ("gpt", "llama"):
        expected = reference[example]["initial"]
        for parallel in layouts:
            for rank, result in enumerate(ranks):
                got = result[(example, parallel)]
                assert got["warnings"] == [], (example, parallel, got["warnings"])
                assert set(got["initial"]) == set(expected), (example, parallel)
                for name, value in expected.items():
                    assert torch.equal(got["initial"][name], value), f"{example} {parallel} rank {rank}: {name}"
                if example == "llama":
                    assert got["tied"] is True, (parallel, rank)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("single"))
    return {example: _initial(example, "single", root) for example in ("gpt", "llama")}


def test_single_process_keeps_tied_weights(reference):
    assert reference["llama"]["tied"] is True
    init = reference["llama"]["initial"]
    assert torch.equal(init["lm_head.weight"], init["model.embed_tokens.weight"])
    # the rotary buffer holds the computed frequencies, not what to_empty left there
    inv_freq = init["model.rotary_emb.inv_freq"]
    assert inv_freq[0] == 1.0 and torch.all(inv_freq[1:] < inv_freq[:-1])


def test_two_rank_layouts_start_from_the_single_process_weights(reference):
    _check(spawn_world(2, _ranks, LAYOUTS_2, timeout=240), LAYOUTS_2, reference)


def test_four_rank_layouts_start_from_the_single_process_weights(reference):
    _check(spawn_world(4, _ranks, LAYOUTS_4, timeout=300), LAYOUTS_4, reference)


def test_sharded_init_is_refused_on_cpu(tmp_path):
    from dream_trainer.testing import ToyTrainer

    config = TrainerConfig(root_dir=str(tmp_path), device_parameters=DeviceParameters.FSDP(weight_init="sharded"))
    for error in spawn_world(2, _fit_toy, config, timeout=120):
        assert "weight_init='sharded' needs DTensor's RNG tracker" in error and "cpu" in error
    with pytest.raises(ValueError, match=r"weight_init='bogus' is invalid: expected 'full' or 'sharded'"):
        DeviceParameters(weight_init="bogus")


def _fit_toy(config):
    from dream_trainer.testing import ToyTrainer

    trainer = ToyTrainer(config)
    try:
        trainer.fit()
    except ValueError as exc:
        assert not hasattr(trainer, "model")  # refused before any model was built
        return str(exc)
    return "no error"

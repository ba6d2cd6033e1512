"""Fine-tuning with adapters (examples/gpt/lora.py, peft LoRA): ``--init-from`` a plain GPT
checkpoint starts the wrapped model from its weights, the adapters train under FSDP2 on 2
ranks as in one process from the same seed, and ``export --trainable-only`` writes the
adapters alone, under their names, from the 2-rank checkpoint, in one process with no
process group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("peft")

from dream_trainer.testing import spawn_world  # noqa: E402
from tests.demos import SMALL, Record, load  # noqa: E402

STEPS = 6
ADAPTERS = ("lora_A", "lora_B")


class _AfterInitFrom(Record):
    order = 950  # the initial weights after InitFromCheckpointCallback (900) loaded the base


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A plain GPT trained 4 steps: the model the adapters are put on."""
    root = tmp_path_factory.mktemp("lora-base")
    trainer = load("gpt").main([*SMALL, "--root-dir", str(root), "--run-name", "base", "--steps", "4", "--val-every",
                                "4", "--val-batches", "2", "--checkpoint-every", "4", "--async-checkpoint", "off"])
    final = {name: tensor.detach().clone() for name, tensor in trainer.model.state_dict().items()}
    return root / "gpt" / "base" / "checkpoints" / "step_000000004", final


def _tune(layout: str, root: str, base_checkpoint: str) -> dict:
    if layout == "fsdp" and not dist.is_initialized():
        dist.init_process_group("gloo")
    record = _AfterInitFrom()
    trainer = load("lora").main([*SMALL, "--root-dir", root, "--run-name", layout, "--steps", str(STEPS),
                                 "--parallel", layout, "--init-from", base_checkpoint, "--resume", "None",
                                 "--checkpoint-every", str(STEPS), "--async-checkpoint", "off",
                                 "--val-every", str(STEPS), "--val-batches", "2"], callbacks=[record])
    assert trainer.status == "completed"
    return record.result()


def _is_adapter(name: str) -> bool:
    return any(part in ADAPTERS for part in name.split("."))


def test_lora_trains_under_fsdp2_like_one_process_and_exports_the_adapters_alone(base, tmp_path):
    base_checkpoint, base_final = base
    single = _tune("single", str(tmp_path / "single"), str(base_checkpoint))
    ranks = spawn_world(2, _tune, "fsdp", str(tmp_path / "fsdp"), str(base_checkpoint), timeout=600)
    sharded = ranks[0]
    assert ranks[1]["losses"] == sharded["losses"]
    # The start: the base model's weights under peft's names; lora_B zero (the base model exactly).
    initial = single["initial"]
    adapters = sorted(name for name in initial if _is_adapter(name))
    assert len(adapters) == 2 * 2 * 2  # 2 blocks x q_proj, v_proj x A, B
    for name, value in base_final.items():
        wrapped = "base_model.model." + name.replace("q_proj.", "q_proj.base_layer.").replace("v_proj.", "v_proj.base_layer.")
        assert torch.equal(initial[wrapped], value.float()), name
    assert all(not initial[name].any() for name in adapters if ".lora_B." in name)
    # 2 FSDP2 ranks: the same start, bitwise, and the same loss curve as one process.
    for name, value in initial.items():
        assert torch.equal(sharded["initial"][name], value), name
    assert sorted(sharded["losses"]) == list(range(1, STEPS + 1))
    want = torch.tensor([single["losses"][s] for s in range(1, STEPS + 1)])
    got = torch.tensor([sharded["losses"][s] for s in range(1, STEPS + 1)])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=0.0)
    assert got[-1] < got[0]
    # Only the adapters trained.
    final = sharded["final"]
    assert all(torch.equal(final[n], initial[n]) for n in initial if not _is_adapter(n))
    assert all(not torch.equal(final[n], initial[n]) for n in adapters)
    # The adapters alone, from the 2-rank checkpoint, in this process (no process group).
    from safetensors.torch import load_file

    checkpoint = tmp_path / "fsdp" / "gpt-lora" / "fsdp" / "checkpoints" / f"step_{STEPS:09d}"
    output = tmp_path / "adapter.safetensors"
    load("lora").main(["export", str(checkpoint), "--trainable-only", "--output", str(output)])
    assert not dist.is_initialized()
    exported = load_file(str(output))
    assert sorted(exported) == adapters
    for name in adapters:
        assert torch.equal(exported[name], final[name]), name


def test_init_from_a_checkpoint_of_another_shape_names_the_weight(base, tmp_path):
    """strict holds for the base weights: a LoRA model of another shape is refused."""
    from dream_trainer.errors import CheckpointError

    base_checkpoint, _ = base
    args = [*SMALL, "--root-dir", str(tmp_path), "--run-name", "wide", "--steps", "1", "--d-model", "32",
            "--init-from", str(base_checkpoint), "--resume", "None"]
    with pytest.raises(CheckpointError, match=r"tok_emb\.weight"):
        load("lora").main(args)

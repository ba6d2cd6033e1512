"""Fine-tuning with adapters (examples/gpt/lora.py, peft LoRA): ``--init-from`` a plain GPT
checkpoint starts the wrapped model from its weights, the adapters train under FSDP2 on 2
ranks as in one process from the same seed, and from the 2-rank checkpoint, in one process
with no process group, ``export --trainable-only`` writes the adapters alone under their
names, ``export --adapter DIR`` a directory ``PeftModel.from_pretrained`` loads and
``export --merged FILE`` the GPT with the adapters merged in, both giving the trained
model's outputs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("peft")

from dream_trainer.testing import spawn_world  # noqa: E402
from tests.demos import SMALL, Record, load  # noqa: E402

STEPS = 6
ADAPTERS = ("lora_A", "lora_B")
SHAPE = ["--lora.rank", "4", "--lora.alpha", "24"]  # not the defaults (8, 16): the export must read the run's


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
                                 "--val-every", str(STEPS), "--val-batches", "2", *SHAPE], callbacks=[record])
    assert trainer.status == "completed"
    return record.result()


def _is_adapter(name: str) -> bool:
    return any(part in ADAPTERS for part in name.split("."))


@pytest.fixture(scope="module")
def tuned(base, tmp_path_factory):
    """The adapters trained in one process and on 2 FSDP2 ranks: (single, ranks, the 2-rank
    run's last checkpoint)."""
    root = tmp_path_factory.mktemp("lora-tuned")
    base_checkpoint, _ = base
    single = _tune("single", str(root / "single"), str(base_checkpoint))
    ranks = spawn_world(2, _tune, "fsdp", str(root / "fsdp"), str(base_checkpoint), timeout=600)
    return single, ranks, root / "fsdp" / "gpt-lora" / "fsdp" / "checkpoints" / f"step_{STEPS:09d}"


def test_lora_trains_under_fsdp2_like_one_process_and_exports_the_adapters_alone(base, tuned, tmp_path):
    _, base_final = base
    single, ranks, checkpoint = tuned
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

    output = tmp_path / "adapter.safetensors"
    load("lora").main(["export", str(checkpoint), "--trainable-only", "--output", str(output)])
    assert not dist.is_initialized()
    exported = load_file(str(output))
    assert sorted(exported) == adapters
    for name in adapters:
        assert torch.equal(exported[name], final[name]), name


def _gpt_config():
    return load("gpt").GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, d_model=64)  # SMALL's


def _trained_model(checkpoint):
    """The training-time model, built here (the GPT wrapped with the run's LoraConfig) with
    the checkpoint's weights, strictly."""
    from peft import LoraConfig, get_peft_model

    from dream_trainer.weights_io import read_model_state

    model = get_peft_model(load("gpt").GPT(_gpt_config()),
                           LoraConfig(r=4, lora_alpha=24, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    model.load_state_dict(read_model_state(checkpoint), strict=True)
    return model.eval()


def test_export_writes_a_peft_adapter_directory_and_a_merged_model(base, tuned, tmp_path):
    """``export --adapter``: ``PeftModel.from_pretrained(GPT, DIR)`` gives the trained model's
    outputs (not the base model's); ``export --merged``: the GPT loads it strictly and gives
    them too. From the 2-rank FSDP2 checkpoint, in this process (no process group)."""
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file

    base_checkpoint, base_final = base
    _, ranks, checkpoint = tuned
    adapter, merged = tmp_path / "adapter", tmp_path / "merged.safetensors"
    written = load("lora").main(["export", str(checkpoint), "--adapter", str(adapter), "--merged", str(merged)])
    assert not dist.is_initialized()
    assert written == {"adapter_config": adapter / "adapter_config.json",
                       "adapter_model": adapter / "adapter_model.safetensors", "merged": merged}
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 24
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"] and config["lora_dropout"] == 0.0
    assert config["base_model_name_or_path"] == str(base_checkpoint)  # the run's --init-from
    trained = _trained_model(checkpoint)
    for name, value in ranks[0]["final"].items():  # the checkpoint: the weights the run ended with
        assert torch.equal(trained.state_dict()[name], value), name
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    want_tensors = get_peft_model_state_dict(trained)  # peft's names: no adapter name (".default")
    assert sorted(tensors) == sorted(want_tensors) and len(tensors) == 8
    assert not any(".default." in name for name in tensors)
    for name, value in want_tensors.items():
        assert torch.equal(tensors[name], value), name

    tokens = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    gpt = load("gpt")
    plain = gpt.GPT(_gpt_config()).eval()
    plain.load_state_dict(base_final, strict=True)
    with torch.no_grad():
        want, base_out = trained(tokens), plain(tokens)
        assert (want - base_out).abs().max() > 1e-3  # the adapters change the outputs
        loaded = PeftModel.from_pretrained(plain, str(adapter)).eval()  # adapters put on `plain`
        torch.testing.assert_close(loaded(tokens), want, rtol=1e-5, atol=1e-6)
        fresh = gpt.GPT(_gpt_config()).eval()
        fresh.load_state_dict(load_file(str(merged)), strict=True)  # the GPT's names, every one
        torch.testing.assert_close(fresh(tokens), want, rtol=1e-4, atol=1e-5)


def test_export_without_a_run_record_warns_and_checks_the_shape(tuned, tmp_path, capsys):
    """A checkpoint moved away from its run: the shape comes from the flags, with a warning; a
    rank that is not the run's is refused, naming the weight. Options of the plain export
    with --adapter are a usage error; ``export --help`` lists --adapter and --merged."""
    from safetensors.torch import load_file

    from dream_trainer.adapter_export import export_peft
    from dream_trainer.errors import CheckpointError

    _, _, checkpoint = tuned
    moved = tmp_path / "elsewhere" / "step"
    shutil.copytree(checkpoint, moved)
    lora = load("lora")
    with pytest.warns(UserWarning, match=r"no run record .*run\.json.*alpha and dropout.*not checked"):
        with pytest.raises(CheckpointError, match=r"lora_A\.default\.weight: \(4, 64\) in the checkpoint, "
                                                  r"\(8, 64\) in the model"):
            lora.main(["export", str(moved), "--adapter", str(tmp_path / "wrong"), *SMALL])  # rank 8: the default
    with pytest.warns(UserWarning, match="no run record"):
        lora.main(["export", str(moved), "--adapter", str(tmp_path / "a"), *SMALL, *SHAPE])
    lora.main(["export", str(checkpoint), "--adapter", str(tmp_path / "b")])
    first, second = (load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in ("a", "b"))
    assert sorted(first) == sorted(second) and all(torch.equal(first[k], second[k]) for k in first)
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["lora_alpha"] == 24
    with pytest.raises(TypeError, match=r"export_peft\(model=<GPT>\): expected a peft PeftModel"):
        export_peft(checkpoint, load("gpt").GPT(_gpt_config()), tmp_path / "d")
    with pytest.raises(ValueError, match=r"export_peft\(merged='.*m\.pt'\): .*give a path ending in '\.safetensors'"):
        export_peft(checkpoint, _trained_model(checkpoint), merged=tmp_path / "m.pt")
    assert not (tmp_path / "d").exists() and not (tmp_path / "m.pt").exists()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        lora.main(["export", str(checkpoint), "--adapter", str(tmp_path / "c"), "--trainable-only"])
    assert exit_.value.code == 2
    assert "--trainable-only is an option of the plain export" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
    with pytest.raises(SystemExit) as exit_:
        lora.main(["export", "--help"])
    assert exit_.value.code == 0
    shown = capsys.readouterr().out
    assert "--trainable-only" in shown and "--adapter DIR" in shown and "--merged FILE" in shown


def test_init_from_a_checkpoint_of_another_shape_names_the_weight(base, tmp_path):
    """strict holds for the base weights: a LoRA model of another shape is refused."""
    from dream_trainer.errors import CheckpointError

    base_checkpoint, _ = base
    args = [*SMALL, "--root-dir", str(tmp_path), "--run-name", "wide", "--steps", "1", "--d-model", "32",
            "--init-from", str(base_checkpoint), "--resume", "None"]
    with pytest.raises(CheckpointError, match=r"tok_emb\.weight"):
        load("lora").main(args)

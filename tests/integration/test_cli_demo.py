"""The command line on the GPT demo: every subcommand ends with a useful output; resume
vs --init-from; the run record and the resume comparison; export of a checkpoint."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dream_trainer import Callback, StopTraining
from dream_trainer.errors import CheckpointError
from tests.demos import SMALL, full_state, load

DEMO = Path(__file__).resolve().parents[2] / "examples" / "gpt" / "train.py"
QUIET = ["--val-batches", "2", "--resume", "None"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 6-step run checkpointed at steps 3 and 6, both validation steps."""
    root = tmp_path_factory.mktemp("cli")
    demo = load("gpt")
    trainer = demo.main([*SMALL, "--root-dir", str(root), "--run-name", "base", "--steps", "6", "--val-every", "3",
                         "--val-batches", "2", "--checkpoint-every", "3", "--async-checkpoint", "off"])
    return demo, root, trainer, full_state(trainer.model)


def test_train_records_config_commit_and_versions(trained):
    demo, root, trainer, _ = trained
    record = json.loads((root / "gpt" / "base" / "run.json").read_text())
    assert record["config"]["training_parameters"]["max_steps"] == 6
    assert record["config"]["model"]["d_model"] == 64 and "callbacks" not in record["config"]
    assert record["versions"]["torch"] == torch.__version__
    assert record["config_class"].endswith("GPTRunConfig")
    repo = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pytest.skip(f"{repo} is not a git checkout (or git is missing): no commit to compare the record's with")
    assert record["git"] is not None, "the run record has no git commit, in a git checkout"
    assert record["git"]["commit"] == head


def test_resume_continues_with_the_recorded_config_and_warns_changes(trained, caplog, capsys):
    demo, root, _, _ = trained
    with caplog.at_level(logging.WARNING, logger="dream_trainer.callbacks.run_record"):
        trainer = demo.main(["resume", str(root / "gpt" / "base"), "--steps", "9", "--checkpoint-every", "None"])
    assert trainer.callbacks["CheckpointCallback"].resumed_from.name == "step_000000006"
    assert trainer.global_step == 9 and trainer.config.model.d_model == 64  # the record's shape, not the default 128
    assert any("max_steps: 6 -> 9" in r.getMessage() for r in caplog.records)
    record = json.loads((root / "gpt" / "base" / "run.json").read_text())
    assert len(record["history"]) == 1 and record["config"]["training_parameters"]["max_steps"] == 9
    with pytest.raises(CheckpointError, match=r"model.d_model: 64 -> 32"):
        demo.main(["resume", "base", "--root-dir", str(root), "--model.d_model", "32"])
    with pytest.raises(SystemExit):
        demo.main(["resume", "no-such-run", "--root-dir", str(root)])
    assert "no run record" in capsys.readouterr().err


class _Weights(Callback):
    order = 950  # after InitFromCheckpointCallback (900), before any resume (1000)

    def post_configure(self) -> None:
        self.state = full_state(self.trainer.model)
        raise StopTraining("weights read")


def test_init_from_loads_weights_only(trained, tmp_path):
    demo, root, _, final = trained
    ckpt = root / "gpt" / "base" / "checkpoints" / "step_000000006"
    weights = _Weights()
    trainer = demo.main([*SMALL, *QUIET, "--root-dir", str(tmp_path), "--run-name", "tuned", "--steps", "2",
                         "--init-from", str(ckpt)], callbacks=[weights])
    assert trainer.global_step == 0 and trainer.callbacks["CheckpointCallback"].resumed_from is None
    for name, tensor in final.items():
        if not name.startswith("_"):
            torch.testing.assert_close(weights.state[name], tensor, msg=name)
    fresh = _Weights()
    demo.main([*SMALL, *QUIET, "--root-dir", str(tmp_path), "--run-name", "fresh", "--steps", "2"], callbacks=[fresh])
    assert not torch.equal(fresh.state["tok_emb.weight"], final["tok_emb.weight"])
    with pytest.raises(CheckpointError, match="shape"):
        demo.main([*SMALL, *QUIET, "--root-dir", str(tmp_path), "--run-name", "wide", "--d-model", "32",
                   "--init-from", str(ckpt)])


def test_export_writes_the_checkpoint_model_as_safetensors(trained, tmp_path, capsys):
    from safetensors.torch import load_file

    demo, root, _, final = trained
    ckpt = root / "gpt" / "base" / "checkpoints" / "step_000000006"  # the trained model's last state
    out = demo.main(["export", str(ckpt), "--output", str(tmp_path / "m.safetensors")])
    assert f"to {out}" in capsys.readouterr().out
    model = demo.GPT(demo.GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, d_model=64))
    model.load_state_dict(load_file(str(out)), strict=True)  # every key of the model, none other
    trained_state = {name: tensor for name, tensor in final.items() if not name.startswith("_")}
    assert set(model.state_dict()) == set(trained_state)
    for name, tensor in model.state_dict().items():  # the trained values, bit for bit
        torch.testing.assert_close(tensor, trained_state[name], rtol=0, atol=0, msg=name)
    half = demo.main(["export", str(ckpt), "--output", str(tmp_path / "h.safetensors"), "--dtype", "bfloat16"])
    tensors = load_file(str(half))
    assert set(tensors) == set(trained_state)
    for name, tensor in tensors.items():
        assert tensor.dtype is torch.bfloat16, name
        assert torch.equal(tensor, trained_state[name].to(torch.bfloat16)), name


def test_print_config_trains_nothing(tmp_path, capsys):
    demo = load("gpt")
    assert demo.main(["--print-config", "--root-dir", str(tmp_path), "--parallel", "fsdp"]) is None
    data = json.loads(capsys.readouterr().out)
    assert data["device_parameters"]["dp_shard"] == "auto" and data["device_parameters"]["dp_replicate"] == 1
    assert not any(tmp_path.iterdir())


def test_diagnostic_subcommands_end_with_their_output(tmp_path, capsys):
    demo = load("gpt")
    common = [*SMALL, "--root-dir", str(tmp_path)]
    summary = demo.main(["summarize", *common])
    out = capsys.readouterr().out
    model = demo.GPT(demo.GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, d_model=64))
    assert summary["parameters"] == sum(p.numel() for p in model.parameters())
    assert f"parameters: {summary['parameters']:,}" in out and "optim MB" in out
    assert summary["per_rank"][0]["optimizer_bytes"] == 2 * 4 * summary["parameters"]  # AdamW: two fp32 moments

    trainer = demo.main(["profile", *common, "--active", "2"])
    out = capsys.readouterr().out
    assert "Self CPU time total" in out and "trace:" in out
    assert any(p.name.endswith(".pt.trace.json") for p in (trainer.run_dir / "profile").iterdir())
    assert not (trainer.run_dir / "checkpoints").exists()  # a diagnostic run saves nothing

    trainer = demo.main(["find-graph-breaks", *common])
    out = capsys.readouterr().out
    assert "model:" in out and "break(s)" in out and (trainer.run_dir / "graph_breaks.txt").is_file()  # one region

    result = demo.main(["benchmark", *common, "--bench-steps", "4", "--bench-warmup", "1", "--bench-rounds", "2"])
    out = capsys.readouterr().out
    tokens_per_step = 32 * 32  # the demo's global batch x SMALL's block size
    for variant in ("eager", "compiled"):
        for run in result[variant]["rounds"]:  # tokens/s and the step time come from one window: they agree
            assert run["tokens_per_s"] * run["step_s"] == pytest.approx(tokens_per_step)
    ratios = [c["tokens_per_s"] / e["tokens_per_s"] for e, c in zip(result["eager"]["rounds"], result["compiled"]["rounds"])]
    assert result["speedup_rounds"] == pytest.approx(ratios) and len(ratios) == 2
    assert "compiled / eager" in out and "spread" in out


def test_summarize_on_two_ranks_and_a_refused_resume_on_two_ranks(trained, tmp_path):
    """Two spawned ranks: summarize gathers each rank's shards; a resume that changes the
    model shape is refused on both ranks (rank 0 decides) and the launch exits promptly."""
    _, root, _, _ = trained
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cmd = [sys.executable, str(DEMO), "summarize", "--nproc", "2", *SMALL, "--parallel", "fsdp", "--root-dir",
           str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dp_shard=2" in proc.stdout and "\n   1 " in proc.stdout
    cmd = [sys.executable, str(DEMO), "resume", str(root / "gpt" / "base"), "--nproc", "2", "--n-layer", "3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode != 0 and "model.n_layer: 2 -> 3" in proc.stderr

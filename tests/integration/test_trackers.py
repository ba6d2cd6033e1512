"""W&B (offline) and MLflow (a local file store) on the GPT demo: the same metric stream as
metrics.jsonl, the resolved config as hyperparameters, and the same tracker run continued
after a resume (its id kept in the checkpoint). Both read back from their files."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.demos import SMALL, load

ARGS = [*SMALL, "--val-batches", "2", "--val-every", "2", "--checkpoint-every", "2", "--async-checkpoint", "off",
        "--trackers", "wandb", "mlflow"]


def _wandb_records(path: Path):
    """The records of a W&B ``.wandb`` file: a 7-byte header, then LevelDB-log chunks in
    32 KiB blocks (7-byte chunk header: crc32, little-endian length, type; FULL=1,
    FIRST=2, MIDDLE=3, LAST=4), each record a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, pending = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def _wandb_history(run_dirs: list[Path]) -> tuple[dict[str, dict[int, float]], dict[str, str]]:
    history: dict[str, dict[int, float]] = {}
    config: dict[str, str] = {}
    for run_dir in run_dirs:
        for record in _wandb_records(next(run_dir.glob("run-*.wandb"))):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
                step = record.history.step.num
                for key, value in items.items():
                    if not key.startswith("_"):
                        history.setdefault(key, {})[step] = json.loads(value)
            elif kind == "config" or (kind == "run" and record.run.config.update):
                updates = record.config.update if kind == "config" else record.run.config.update
                config.update({u.key: u.value_json for u in updates})
    return history, config


def _jsonl(run_dir: Path) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for key, value in row.items():
            if key not in ("step", "time"):
                out.setdefault(key, {})[row["step"]] = value
    return out


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None or importlib.util.find_spec("mlflow") is None,
                    reason="the wandb and mlflow extras")
def test_trackers_get_the_metric_stream_the_config_and_continue_after_resume(tmp_path):
    demo = load("gpt")
    first = demo.main([*ARGS, "--root-dir", str(tmp_path), "--run-name", "tracked", "--steps", "2"])
    trackers = {type(cb).__name__: cb for cb in first.callbacks if "LoggerCallback" in type(cb).__name__}
    ids = {name: cb.run_id for name, cb in trackers.items() if name != "LoggerCallback"}
    assert all(ids.values()) and set(ids) == {"WandbLoggerCallback", "MLflowLoggerCallback"}
    second = demo.main([*ARGS, "--root-dir", str(tmp_path), "--run-name", "tracked", "--steps", "4"])
    assert second.callbacks["CheckpointCallback"].resumed_from.name == "step_000000002"
    for name, run_id in ids.items():
        assert second.callbacks[name].run_id == run_id  # the same tracker run, from the checkpoint

    run_dir = tmp_path / "gpt" / "tracked"
    expected = _jsonl(run_dir)
    assert sorted(expected["train/loss"]) == [1, 2, 3, 4] and sorted(expected["val/loss"]) == [2, 4]

    # W&B offline: two segments of one run id, the same values at the same steps
    segments = sorted((run_dir / "wandb").glob(f"offline-run-*-{ids['WandbLoggerCallback']}"))
    assert len(segments) == 2
    history, config = _wandb_history(segments)
    for key in ("train/loss", "val/loss", "train/lr"):
        assert history[key] == pytest.approx(expected[key]), key
    assert json.loads(config["model.d_model"]) == {"value": 64} or json.loads(config["model.d_model"]) == 64
    assert "training_parameters.max_steps" in config

    # MLflow file store under root_dir/mlruns: one run, every logged value, the config as params
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    run = client.get_run(ids["MLflowLoggerCallback"])
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    # MLflow params cannot change: they are the first start's (run.json records every start)
    assert run.data.params["model.d_model"] == "64" and run.data.params["training_parameters.max_steps"] == "2"
    for key in ("train/loss", "val/loss"):
        logged = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert logged == pytest.approx(expected[key]), key
    runs = client.search_runs([client.get_experiment_by_name("gpt").experiment_id])
    assert [r.info.run_id for r in runs] == [run.info.run_id]


def test_a_missing_tracker_package_is_named_with_its_extra(monkeypatch):
    from dream_trainer.callbacks import MLflowLoggerCallback, WandbLoggerCallback

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "mlflow") else real(name, *a))
    with pytest.raises(ImportError, match=r"dream-trainer\[wandb\]"):
        WandbLoggerCallback()
    with pytest.raises(ImportError, match=r"dream-trainer\[mlflow\]"):
        MLflowLoggerCallback()
    with pytest.raises(ValueError, match="mode='cloud'"):
        monkeypatch.undo()
        WandbLoggerCallback(mode="cloud")

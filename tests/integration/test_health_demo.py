"""All six health callbacks on the GPT demo: their metrics reach TensorBoard with plausible
values (read back from the event files)."""

from pathlib import Path

DEMO = Path(__file__).resolve().parents[2] / "examples" / "gpt" / "train.py"


def _scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_health_monitors_on_the_demo(tmp_path):
    from dream_trainer.callbacks import health_callbacks

    from tests.demos import load

    demo = load("gpt")
    every = {"log_interval": 5}
    monitors = health_callbacks(gradient={**every, "min_history": 5}, memory=every, throughput={**every, "warmup_steps": 5},
                                loss={**every, "min_history": 5}, anomaly=every, dashboard=False)
    trainer = demo.main(["--steps", "30", "--val-every", "15", "--val-batches", "2", "--n-chars", "60000",
                         "--checkpoint-every", "None", "--resume", "None", "--log-every", "10", "--root-dir", str(tmp_path),
                         "--run-name", "health"], callbacks=monitors)
    s = {tag: dict(values) for tag, values in _scalars(trainer.run_dir / "logs").items()}
    for tag in ("train/grad_norm", "train/grad_norm_avg", "train/clip_rate", "train/memory_current_mb", "train/memory_peak_mb",
                "train/step_time", "train/loss_avg"):
        assert sorted(s[tag]) == [5, 10, 15, 20, 25, 30], tag
    assert all(0 < v < 100 for v in s["train/grad_norm"].values())
    assert all(0 <= v <= 1 for v in s["train/clip_rate"].values())  # the demo clips at 1.0
    assert all(s["train/memory_peak_mb"][k] >= s["train/memory_current_mb"][k] > 50 for k in s["train/memory_peak_mb"])
    assert all(v > 0 for v in s["train/tokens_per_sec"].values()) and sorted(s["train/tokens_per_sec"]) == [10, 15, 20, 25, 30]
    assert sorted(s["train/progress_pct"]) == [10, 15, 20, 25, 30]  # after the 5 warm-up steps
    assert s["train/progress_pct"][15] == 50.0 and s["train/progress_pct"][30] == 100.0 and s["train/eta"][30] == 0.0
    assert s["train/eta"][15] > 0
    losses = s["train/loss_avg"]
    assert losses[30] < losses[5]  # the smoothed loss falls
    assert {"epoch/memory_start_mb", "epoch/memory_peak_mb"} <= set(s) and trainer.display_fields["mem"].startswith("rss:")

"""How values logged from `on_log` are dispatched: under the same step, right after the
dispatch under way (training log steps, a callback's own log steps, validation), bounded to
one nested round; and what a callback may put into the `on_log` dict."""

import json
import logging
import time
import types

import pytest
import torch

from dream_trainer import Callback, DeviceParameters, LoggingParameters, TrainerConfig, TrainingParameters
from dream_trainer.callbacks.logger import LoggerCallback
from dream_trainer.testing import RecordingCallback, ToyTrainer
from dream_trainer.trainer import LogRecursionError

MAX_ON_LOG_CALLS = 500  # far more than a 4-step run dispatches: more means a runaway


class _Runaway(BaseException):
    """Not an Exception: the callback collection does not catch it, so a re-dispatch without
    end fails the test instead of hanging it."""


def make(callbacks, tmp_path, log_every_n_steps=1, **training):
    params = dict(n_epochs=1, num_sanity_val_steps=0)
    params.update(training)
    config = TrainerConfig(
        run_name="r",
        root_dir=str(tmp_path),
        training_parameters=TrainingParameters(**params),
        logging_parameters=LoggingParameters(log_every_n_steps=log_every_n_steps),
        device_parameters=DeviceParameters.SINGLE_DEVICE(),
        callbacks=list(callbacks),
    )
    return ToyTrainer(config, n_samples=64, batch_size=16)  # 3 steps an epoch (48 training samples)


class Deriver(Callback):
    """Logs a value derived from a metric it sees in `on_log`."""

    def __init__(self, source, target):
        super().__init__()
        self.source, self.target = source, target

    def on_log(self, metrics, step):
        if self.source in metrics:
            self.trainer.log_scalar(self.target, 2.0 * metrics[self.source])


def _assert_follows(logs, source, target):
    """Every payload with `source` is followed at once by one with `target` (= 2 * source),
    under the same step; `target` never arrives otherwise."""
    with_source = [i for i, (_, metrics) in enumerate(logs) if source in metrics]
    assert with_source, logs
    for i in with_source:
        step, metrics = logs[i]
        assert i + 1 < len(logs), logs
        next_step, nested = logs[i + 1]
        assert (next_step, sorted(nested)) == (step, [target]), logs
        assert nested[target] == pytest.approx(2.0 * metrics[source])
    assert sum(target in metrics for _, metrics in logs) == len(with_source), logs


def test_a_value_logged_from_on_log_on_a_training_log_step_keeps_its_step(tmp_path):
    rec = RecordingCallback()
    trainer = make([Deriver("train/loss", "derived/x"), rec], tmp_path, log_every_n_steps=2, n_epochs=2)
    trainer.fit()
    train_steps = [step for step, metrics in rec.logs if "train/loss" in metrics]
    assert train_steps == [2, 4, 6]
    _assert_follows(rec.logs, "train/loss", "derived/x")
    assert trainer.logged_metrics["derived/x"] == pytest.approx(2.0 * trainer.logged_metrics["train/loss"])


def test_a_value_logged_from_on_log_on_a_callbacks_own_log_step_keeps_its_step(tmp_path):
    class Own(Callback):
        log_every_n_steps = 2  # its own interval (the trainer's is 1000), not at an epoch's end

        def post_train_step(self, result, batch_idx):
            if self.trainer.is_log_step:
                self.trainer.log_scalar("cb/a", float(self.trainer.global_step))

    rec = RecordingCallback()
    trainer = make([Own(), Deriver("cb/a", "derived/y"), rec], tmp_path, log_every_n_steps=1000, n_epochs=2)
    trainer.fit()
    assert [step for step, metrics in rec.logs if "cb/a" in metrics] == [2, 4, 6]
    _assert_follows(rec.logs, "cb/a", "derived/y")


def test_a_value_logged_from_on_log_after_validation_keeps_its_step(tmp_path):
    rec = RecordingCallback()
    trainer = make([Deriver("val/loss", "derived/v"), rec], tmp_path, log_every_n_steps=1000, val_every_n_steps=2,
                   n_epochs=2)
    trainer.fit()
    assert [step for step, metrics in rec.logs if "val/loss" in metrics] == [2, 3, 4, 6]
    _assert_follows(rec.logs, "val/loss", "derived/v")


class Chatty(Callback):
    """Logs from every `on_log` (a bug: each of its logs causes another one)."""

    def __init__(self, critical):
        super().__init__()
        self.critical = critical
        self.calls = 0

    def on_log(self, metrics, step):
        self.calls += 1
        if self.calls > MAX_ON_LOG_CALLS:
            raise _Runaway(f"{self.calls} on_log calls: re-dispatched without end")
        self.trainer.log_scalar("chatty/calls", float(self.calls))


def test_logging_from_every_on_log_of_a_critical_callback_fails_the_run_naming_it(tmp_path):
    rec = RecordingCallback()
    trainer = make([rec, Chatty(critical=True)], tmp_path)  # rec first: it sees the nested round
    started = time.monotonic()
    with pytest.raises(LogRecursionError, match=r"callback 'Chatty' \(Chatty\) logged \['chatty/calls'\]"):
        trainer.fit()
    assert time.monotonic() - started < 60
    assert trainer.status == "failed"
    # the first round of its logs was dispatched, under the step that caused it
    assert [(step, sorted(m)) for step, m in rec.logs][-1] == (1, ["chatty/calls"])


def test_logging_from_every_on_log_of_a_non_critical_callback_ends_and_disables_it(tmp_path, caplog):
    chatty, rec = Chatty(critical=False), RecordingCallback()
    trainer = make([chatty, rec], tmp_path, n_epochs=2)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        trainer.fit()
    assert time.monotonic() - started < 60
    assert trainer.status == "completed" and trainer.global_step == 6
    assert "Chatty" not in trainer.callbacks  # disabled after max_consecutive_failures steps
    assert chatty.calls <= 2 * Chatty.max_consecutive_failures
    errors = [r for r in caplog.records if r.exc_info and isinstance(r.exc_info[1], LogRecursionError)]
    assert errors and "callback 'Chatty' (Chatty) logged ['chatty/calls']" in str(errors[0].exc_info[1])
    assert any("disabling callback 'Chatty'" in r.getMessage() for r in caplog.records)
    # while it ran, its first-round logs kept the step of the train metrics that caused them
    for i, (step, metrics) in enumerate(rec.logs[:-1]):
        if "train/loss" in metrics and rec.logs[i + 1][1].keys() == {"chatty/calls"}:
            assert rec.logs[i + 1][0] == step


# ---------------------------------------------------------------- the on_log dict
class Editor(Callback):
    """Puts `value` under `key` into the metrics dict of every on_log with train/loss."""

    def __init__(self, key, value, critical=True, how="setitem"):
        super().__init__()
        self.key, self.value, self.critical, self.how = key, value, critical, how

    def on_log(self, metrics, step):
        if "train/loss" not in metrics:
            return
        value = self.value(metrics) if callable(self.value) else self.value
        if self.how == "setitem":
            metrics[self.key] = value
        elif self.how == "update":
            metrics.update({self.key: value})
        else:
            metrics |= {self.key: value}


def test_an_entry_added_to_the_on_log_dict_is_seen_by_later_callbacks_and_kept(tmp_path):
    rec = RecordingCallback()
    trainer = make([Editor("derived/z", lambda m: torch.tensor(m["train/loss"] + 1.0)), rec], tmp_path)
    trainer.fit()
    train = [metrics for _, metrics in rec.logs if "train/loss" in metrics]
    assert len(train) == 3
    for metrics in train:
        assert type(metrics["derived/z"]) is float  # a tensor put there is stored as a float
        assert metrics["derived/z"] == pytest.approx(metrics["train/loss"] + 1.0)
    assert trainer.logged_metrics["derived/z"] == pytest.approx(trainer.logged_metrics["train/loss"] + 1.0)


@pytest.mark.parametrize("how", ["setitem", "update", "ior"])
def test_a_non_number_put_into_the_on_log_dict_raises_naming_the_callback_and_the_key(tmp_path, how):
    rec = RecordingCallback()
    trainer = make([Editor("bad/text", "oops", how=how), rec], tmp_path)
    with pytest.raises(TypeError, match=r"callback 'Editor' \(Editor\).*metric 'bad/text'='oops' \(str\)"):
        trainer.fit()
    assert not any("bad/text" in metrics for _, metrics in rec.logs)
    assert "bad/text" not in trainer.logged_metrics


def test_a_non_number_from_a_non_critical_callback_never_reaches_the_sinks(tmp_path, caplog):
    logger_cb = LoggerCallback(tensorboard=True, jsonl=True)
    trainer = make([Editor("bad/vec", torch.ones(3), critical=False), logger_cb], tmp_path)
    with caplog.at_level(logging.WARNING):
        trainer.fit()
    assert trainer.status == "completed"
    assert "LoggerCallback" in trainer.callbacks  # the sink kept working
    errors = [r for r in caplog.records if r.exc_info and isinstance(r.exc_info[1], TypeError)]
    assert errors and "callback 'Editor' (Editor)" in str(errors[0].exc_info[1])
    assert "'bad/vec'" in str(errors[0].exc_info[1])
    records = [json.loads(line) for line in (trainer.run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/loss" in r] == [1, 2, 3]
    assert not any("bad/vec" in r for r in records)


def test_the_logger_writes_the_numbers_of_a_call_and_warns_once_per_non_number(tmp_path, caplog):
    sink = LoggerCallback(tensorboard=True, jsonl=True)
    sink.trainer = types.SimpleNamespace(run_dir=tmp_path, global_step=0, resumed=False)
    with caplog.at_level(logging.WARNING, logger="dream_trainer.callbacks.logger"):
        for step, bad in enumerate(["text", torch.ones(3), None, "text"], start=1):
            sink.on_log({"a": float(step), "t": torch.tensor(0.5), "bad": bad}, step)
    sink.close()
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["a"], r["t"]) for r in records] == [(s, float(s), 0.5) for s in (1, 2, 3, 4)]
    assert not any("bad" in r for r in records)
    warnings = [r.getMessage() for r in caplog.records if "'bad'" in r.getMessage()]
    assert len(warnings) == 1 and "not a number" in warnings[0]


def test_values_logged_by_two_callbacks_from_one_on_log_are_each_sent_under_its_step(tmp_path):
    rec = RecordingCallback()
    make([Deriver("train/loss", "derived/a"), Deriver("train/loss", "derived/a_again"), rec], tmp_path).fit()
    train = [i for i, (_, metrics) in enumerate(rec.logs) if "train/loss" in metrics]
    assert len(train) == 3
    for i in train:
        step = rec.logs[i][0]
        nested = [(s, sorted(m)) for s, m in rec.logs[i + 1:i + 3]]
        assert nested == [(step, ["derived/a"]), (step, ["derived/a_again"])]

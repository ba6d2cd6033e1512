"""`MetricLog` on its own: no trainer, a list as the `on_log` sink."""

import pytest
import torch

from dream_trainer import Callback

from dream_trainer.trainer.metric_log import LogRecursionError, MetricLog, OnLogMetrics, check_metrics


class Sink:
    """Records what was sent; optionally logs back into the log from its 'on_log'."""

    def __init__(self):
        self.sent: list[dict[str, float]] = []
        self.reply = None  # called with (log, metrics) on every send

    def __call__(self, metrics):
        assert isinstance(metrics, OnLogMetrics)
        self.sent.append(dict(metrics))
        if self.reply is not None:
            self.reply(self.log, metrics)


def make():
    sink = Sink()
    log = MetricLog(sink)
    sink.log = log
    return log, sink


def test_outside_a_step_a_value_is_sent_at_once_as_a_float():
    log, sink = make()
    log.log({"a": torch.tensor(2.0), "b": 3})
    assert sink.sent == [{"a": 2.0, "b": 3.0}] and log.logged == {"a": 2.0, "b": 3.0}


def test_inside_a_step_values_wait_for_the_log_step_then_go_with_its_own():
    log, sink = make()
    log.gate = False  # a step that is not a log step
    log.log({"x": 1.0})
    log.log({"x": 2.0})  # the latest per name is kept
    assert sink.sent == [] and log.pending == {"x": 2.0}
    log.gate = True
    log.log({"y": 5.0})
    log.send_step({"train/loss": torch.tensor(0.5)})
    assert sink.sent == [{"train/loss": 0.5, "x": 2.0, "y": 5.0}] and log.pending == {}


def test_the_end_of_an_epoch_flushes_what_was_kept():
    log, sink = make()
    log.gate = False
    log.log({"kept": 1.0})
    log.gate = None
    log.flush()
    log.flush()  # nothing left: no empty dispatch
    assert sink.sent == [{"kept": 1.0}]


def test_a_value_logged_from_on_log_goes_right_after_under_one_nested_round():
    log, sink = make()
    sink.reply = lambda log, m: log.log({"derived": m["loss"] * 2}) if "loss" in m else None
    log.log({"loss": 1.5})
    assert sink.sent == [{"loss": 1.5}, {"derived": 3.0}] and log.logged["derived"] == 3.0


def test_logging_from_the_nested_round_raises():
    log, sink = make()
    sink.reply = lambda log, m: log.log({"again": 1.0})
    with pytest.raises(LogRecursionError, match=r"logged \['again'\] from on_log"):
        log.log({"loss": 1.0})
    sink.reply = None
    log.log({"after": 1.0})  # the log is usable afterwards (the round was reset)
    assert sink.sent[-1] == {"after": 1.0}


def test_an_entry_edited_in_on_log_lands_in_logged_and_a_non_number_is_refused():
    log, sink = make()

    def edit(log, metrics):
        metrics["added"] = torch.tensor(7.0)
        with pytest.raises(TypeError, match="cannot be logged"):
            metrics["bad"] = "text"

    sink.reply = edit
    log.log({"loss": 1.0})
    assert log.logged == {"loss": 1.0, "added": 7.0}


def test_validation_means_over_batches():
    class OneRank:
        device = torch.device("cpu")

        def all_reduce(self, tensor, op="sum"):
            return tensor

    log, sink = make()
    log.start_validation()
    for value in (1.0, 2.0, torch.tensor(6.0)):
        log.log({"val/loss": value}, validating=True)
    assert sink.sent == []
    means = log.validation_means(OneRank())
    assert {k: float(v) for k, v in means.items()} == {"val/loss": 3.0}
    log.start_validation()
    assert log.validation_means(OneRank()) == {}


def test_check_metrics_names_the_bad_value():
    with pytest.raises(TypeError, match=r"metric 'm'=\[1\] \(list\)"):
        check_metrics({"m": [1]})
    with pytest.raises(TypeError, match="shape"):
        check_metrics({"m": torch.ones(2)})
    with pytest.raises(TypeError, match="names are strings"):
        check_metrics({1: 1.0})


def test_the_trainers_log_sends_to_the_callbacks_under_the_step_at_the_send():
    class Owner:
        global_step = 3

        class callbacks:  # noqa: N801 - stands in for the trainer's callback collection
            sent: list = []

            @classmethod
            def on_log(cls, metrics, step):
                cls.sent.append((dict(metrics), step))

            @staticmethod
            def listens(hook):
                return hook == "on_log"

    owner = Owner()
    log = MetricLog.for_trainer(owner)
    log.log({"a": 1})
    owner.global_step = 4
    log.log({"b": torch.tensor(2.0)})
    assert Owner.callbacks.sent == [({"a": 1.0}, 3), ({"b": 2.0}, 4)]


def test_the_kind_of_a_log_step():
    assert MetricLog.step_kind(10, every=5, intervals=[3]) == 2  # the trainer's: its own metrics too
    assert MetricLog.step_kind(9, every=5, intervals=[3]) == 1  # a callback's interval: what was logged
    assert MetricLog.step_kind(7, every=5, intervals=[3]) == 0
    assert MetricLog.step_kind(9, every=5, intervals=[]) == 0


def test_the_trainers_own_step_metrics_on_one_rank():
    from dream_trainer.trainer.telemetry import StepStats

    class OneRank:
        device, dp_size, world_size = torch.device("cpu"), 1, 1

        def all_reduce(self, tensor, op="sum"):
            raise AssertionError("one rank: no collective")

    stats = StepStats(lr={"opt": 0.1}, grad_norm={"a": torch.tensor(1.0), "b": torch.tensor(2.0)},
                      total_samples=12, total_tokens=48)
    result = {"loss": torch.tensor(0.5), "logits": torch.ones(3), "note": "x"}
    own = MetricLog(lambda m: None).own_step_metrics(result, stats, OneRank(), epoch=2, log_lr=True,
                                                     log_grad_norm=True)
    assert set(own) == {"train/loss", "train/epoch", "train/lr", "train/grad_norm/a", "train/grad_norm/b"}
    assert own["train/epoch"] == 2.0 and own["train/lr"] == 0.1
    assert (stats.world_samples, stats.world_tokens) == (12, 48)
    quiet = MetricLog(lambda m: None).own_step_metrics(result, stats, OneRank(), epoch=0, log_lr=False,
                                                       log_grad_norm=False)
    assert set(quiet) == {"train/loss", "train/epoch"}


def test_values_nobody_listens_to_are_read_only_when_logged_is_read():
    from dream_trainer.testing import HostReadCounter

    sink, listening = Sink(), [False]
    log = MetricLog(sink, lambda: listening[0])
    loss = torch.tensor(2.0)
    with HostReadCounter() as counter:
        log.log({"loss": loss, "epoch": 1})
        loss.add_(5.0)  # changed after it was logged: the logged value stays
        log.log({"loss": torch.tensor(3.0), "lr": 0.1})  # the latest per name is kept
    assert counter.counts() == {} and sink.sent == []  # no host read, nothing sent
    with HostReadCounter() as counter:
        assert log.logged == {"loss": 3.0, "epoch": 1.0, "lr": 0.1}
    assert counter.counts() == {"float": 1}  # the one tensor, read once
    assert log.logged == {"loss": 3.0, "epoch": 1.0, "lr": 0.1}  # and not again
    log.log({"stale": torch.tensor(1.0)})
    listening[0] = True  # a listener arrives: it gets what is sent from now on
    log.log({"loss": torch.tensor(4.0)})
    assert sink.sent == [{"loss": 4.0}]
    assert log.logged == {"loss": 4.0, "epoch": 1.0, "lr": 0.1, "stale": 1.0}  # the unread one, in order


def test_a_run_without_on_log_listeners_makes_no_host_read_on_its_log_steps():
    """The trainer's own metrics (loss, lr) on its log steps are telemetry: with no
    `on_log` hook and no tracker nothing reads them, so no log step syncs; the values
    are still in ``logged_metrics`` when it is read."""
    from dream_trainer import DeviceParameters, LoggingParameters, TrainerConfig, TrainingParameters
    from dream_trainer.testing import HostReadCounter, StepReads, ToyTrainer

    def run(callbacks):
        counter = HostReadCounter()
        steps = StepReads(counter)
        cfg = TrainerConfig(run_name="r", device_parameters=DeviceParameters.SINGLE_DEVICE(),
                            training_parameters=TrainingParameters(n_epochs=1, num_sanity_val_steps=0),
                            logging_parameters=LoggingParameters(log_every_n_steps=2), callbacks=[steps, *callbacks])
        trainer = ToyTrainer(cfg, n_samples=64, batch_size=16, with_validation=False)
        with counter:
            trainer.fit()
        return trainer, {s: steps.kinds(s) for s in steps.steps}

    class Listener(Callback):
        def __init__(self):
            self.losses = []

        def on_log(self, metrics, step):
            if "train/loss" in metrics:
                self.losses.append((step, metrics["train/loss"]))

    quiet, quiet_reads = run([])
    listener = Listener()
    heard, heard_reads = run([listener])
    assert quiet.global_step == heard.global_step >= 2
    log_steps = list(range(2, heard.global_step + 1, 2))
    assert [s for s, _ in listener.losses] == log_steps
    assert all(("float", "<genexpr>") in heard_reads[s] for s in log_steps)  # to_floats' read, listened to
    assert all(quiet_reads[s] == [] for s in range(1, quiet.global_step + 1))  # nobody listened: no read at all
    # the same run, the same values, read when asked for
    assert quiet.logged_metrics["train/loss"] == pytest.approx(listener.losses[-1][1], abs=0)
    assert quiet.logged_metrics["train/epoch"] == 0.0


def test_a_log_step_nobody_listens_to_keeps_its_values_and_what_waited_for_it():
    """The trainer's log step with no `on_log` listener: its own metrics and the values kept
    since the last log step land in ``logged`` (copies: a tensor changed in place afterwards,
    or one that requires grad, reads as it was logged), and nothing is sent."""
    sink, listening = Sink(), [False]
    log = MetricLog(sink, lambda: listening[0])
    weight = torch.tensor(3.0, requires_grad=True)
    log.gate = False
    log.log({"user/scaled": weight * 2})  # kept until the log step
    loss = torch.tensor(0.25)
    log.gate = True
    log.send_step({"train/loss": loss, "train/lr": 0.1})
    log.gate = None
    loss.add_(1.0)
    with torch.no_grad():
        weight.add_(1.0)
    assert sink.sent == [] and log.pending == {}
    assert log.logged == {"train/loss": 0.25, "train/lr": 0.1, "user/scaled": 6.0}


def test_world_token_totals_stay_exact_past_float32s_integers():
    """The totals ride in the metrics' all-reduce in float64: 2**24 + 1 tokens a rank (past
    float32's last exact integer) sum exactly; the averaged metrics come back float32."""
    from dream_trainer.trainer.telemetry import StepStats

    class TwoSameRanks:  # the peer holds what this rank holds: the sum doubles each entry
        device, dp_size, world_size = torch.device("cpu"), 2, 2

        def all_reduce(self, tensor, op="sum"):
            assert op == "sum" and tensor.dtype == torch.float64
            tensor.mul_(2)

    stats = StepStats(total_samples=2**24 + 1, total_tokens=2**30 + 3)
    own = MetricLog(lambda m: None).own_step_metrics({"loss": torch.tensor(0.25)}, stats, TwoSameRanks(), epoch=0,
                                                     log_lr=False, log_grad_norm=False)
    assert (stats.world_samples, stats.world_tokens) == (2 * (2**24 + 1), 2 * (2**30 + 3))
    assert own["train/loss"].dtype == torch.float32 and float(own["train/loss"]) == 0.25

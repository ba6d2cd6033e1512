"""Performance callbacks on real runs: ProfileCallback (traces that parse, tables with real
ops, the profiler stopped after its window), FindGraphBreaksCallback (exact breaks with
file:line, fullgraph failures, nothing patched), CompileMonitorCallback (compiles and recompiles per
region) and PerformanceReportCallback (the dataloader named when it is the bottleneck)."""

import inspect
import json
import logging
import time

import pytest
import torch
from torch import nn

from dream_trainer import DeviceParameters, LoggingParameters, TrainerConfig, TrainingParameters
from dream_trainer.callbacks import CompileMonitorCallback, FindGraphBreaksCallback, PerformanceReportCallback, ProfileCallback
from dream_trainer.testing import ToyTrainer


def config(callbacks=(), compile_model=False, log_every=1000, **training):
    params = dict(n_epochs=1, num_sanity_val_steps=0)
    params.update(training)
    return TrainerConfig(
        run_name="r",
        training_parameters=TrainingParameters(**params),
        logging_parameters=LoggingParameters(log_every_n_steps=log_every),
        device_parameters=DeviceParameters.SINGLE_DEVICE(compile_model=compile_model),
        callbacks=list(callbacks),
    )


# -------------------------------------------------------------------- ProfileCallback
def test_profile_exports_a_trace_and_a_table_then_stops(tmp_path):
    prof = ProfileCallback(wait=1, warmup=1, active=2, output_dir=tmp_path / "prof")
    steps_after = []

    class After(ToyTrainer):
        def training_step(self, batch, batch_idx):
            if not prof.running and prof.exported:
                steps_after.append(torch.autograd._profiler_enabled())
            return super().training_step(batch, batch_idx)

    trainer = After(config([prof], n_epochs=2))
    trainer.fit()
    trace, table, stacks = prof.exported
    assert trace.name == "rank0.step4.pt.trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "aten::addmm" for e in events)  # the Linear layers' real op
    assert "aten::addmm" in table.read_text() and "Self CPU" in table.read_text()
    assert stacks.stat().st_size > 0
    assert trainer.global_step == 24 and len(steps_after) == 20 and not any(steps_after)  # kept training, profiler off


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_tables_metric_is_one_torch_exports_for_each_device(tmp_path, device):
    """The table and the folded stacks are sorted by a metric torch accepts on either device
    (on CUDA the callback asked for "self_device_time_total", which export_stacks refuses)."""
    from dream_trainer.callbacks.profile import TABLE_METRIC

    with torch.profiler.profile(with_stack=True) as prof:
        torch.ones(64, 64) @ torch.ones(64, 64)
    prof.export_stacks(str(tmp_path / "stacks.txt"), metric=TABLE_METRIC[device])
    assert "aten::mm" in prof.key_averages().table(sort_by=TABLE_METRIC[device], row_limit=-1)


def test_profile_can_end_the_run_and_checks_its_arguments(tmp_path):
    prof = ProfileCallback(wait=0, warmup=1, active=1, output_dir=tmp_path, stop_training=True)
    trainer = ToyTrainer(config([prof]))
    trainer.fit()
    assert trainer.status == "stopped" and trainer.stop_reason == "profiling finished" and trainer.global_step == 2
    with pytest.raises(ValueError, match=r"ProfileCallback\(active=0\) is invalid"):
        ProfileCallback(active=0)
    with pytest.raises(ValueError, match="its schedule never ends"):
        ProfileCallback(torch.profiler.profile())


def test_a_users_profiler_is_stopped_when_the_run_fails(tmp_path):
    user = torch.profiler.profile(schedule=torch.profiler.schedule(wait=0, warmup=1, active=100, repeat=1))
    prof = ProfileCallback(user, output_dir=tmp_path)

    class Fails(ToyTrainer):
        def training_step(self, batch, batch_idx):
            if batch_idx == 3:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    with pytest.raises(RuntimeError, match="boom"):
        Fails(config([prof])).fit()
    assert not prof.running and not torch.autograd._profiler_enabled()


def _users_profiler(on_trace_ready, **kwargs):
    """A profiler as users build it: two cycles of 2 recorded steps, their own handler."""
    schedule = torch.profiler.schedule(wait=1, warmup=1, active=2, repeat=2)
    return torch.profiler.profile(schedule=schedule, on_trace_ready=on_trace_ready, **kwargs)


def test_a_users_tensorboard_handler_and_the_callbacks_files_coexist(tmp_path, caplog, recwarn):
    caplog.set_level(logging.INFO, logger="dream_trainer")
    handler = torch.profiler.tensorboard_trace_handler(str(tmp_path / "tb"))
    user = _users_profiler(handler, with_stack=True)
    prof = ProfileCallback(user, output_dir=tmp_path / "prof")
    trainer = ToyTrainer(config([prof]))
    trainer.fit()
    user_traces = sorted((tmp_path / "tb").glob("*.pt.trace.json"))
    assert len(user_traces) == 2  # the handler's trace, every cycle
    for trace in user_traces:
        assert any(e.get("name") == "aten::addmm" for e in json.loads(trace.read_text())["traceEvents"])
    tables = sorted((tmp_path / "prof").glob("key_averages.*.txt"))
    assert [t.name for t in tables] == ["key_averages.rank0.step4.txt", "key_averages.rank0.step8.txt"]
    assert all("aten::addmm" in t.read_text() for t in tables)
    assert len(list((tmp_path / "prof").glob("stacks.*.txt"))) == 2
    assert not list((tmp_path / "prof").glob("*.pt.trace.json"))  # no second copy: the handler's trace is it
    assert sorted(p for p in prof.exported if p.name.endswith(".pt.trace.json")) == user_traces
    text = caplog.text + " ".join(str(w.message) for w in recwarn)
    assert "already saved" not in text and "failed" not in text.lower()
    assert text.count("its own on_trace_ready") == 1  # said once, at the start
    assert trainer.status == "completed" and user.on_trace_ready is handler and not prof.running  # given back


def test_a_users_handler_that_saves_no_trace_gets_the_callbacks_trace(tmp_path, caplog):
    seen = []
    user = _users_profiler(lambda p: seen.append({e.key for e in p.key_averages()}))
    prof = ProfileCallback(user, output_dir=tmp_path)
    ToyTrainer(config([prof])).fit()
    assert len(seen) == 2 and all("aten::addmm" in ops for ops in seen)  # the user's handler ran each cycle
    traces = sorted(tmp_path.glob("*.pt.trace.json"))
    assert [t.name for t in traces] == ["rank0.step4.pt.trace.json", "rank0.step8.pt.trace.json"]
    assert not list(tmp_path.glob("stacks.*"))  # the user's profiler records no stacks: none written
    assert "already saved" not in caplog.text and "failed" not in caplog.text


def test_a_failing_users_handler_costs_no_other_file(tmp_path, caplog):
    def handler(prof):
        raise OSError("disk full")

    prof = ProfileCallback(_users_profiler(handler), output_dir=tmp_path)
    trainer = ToyTrainer(config([prof]))
    trainer.fit()
    assert trainer.status == "completed" and "disk full" in caplog.text  # logged, training went on
    assert sorted(p.name for p in prof.exported) == ["key_averages.rank0.step4.txt", "key_averages.rank0.step8.txt",
                                                     "rank0.step4.pt.trace.json", "rank0.step8.pt.trace.json"]
    assert all(p.exists() for p in prof.exported) and not prof.running


# -------------------------------------------------------------------- graph breaks
class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 1)

    def forward(self, x):
        y = self.layer(x)
        if y.sum() > 0:  # BRANCH: a data-dependent jump
            y = y * 2
        return y


class Printy(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 1)

    def forward(self, x):
        y = self.layer(x)
        print("debug")  # PRINT
        return torch.tanh(y)


class Clean(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 1)

    def forward(self, x):
        return torch.tanh(self.layer(x))


def _line(cls, marker):
    lines, start = inspect.getsourcelines(cls.forward)
    return start + next(i for i, text in enumerate(lines) if marker in text)


def _with_model(cls, compiled=False):
    class Trainer(ToyTrainer):
        def configure_models(self):
            self.model = cls()

        def apply_compile(self):
            self.compile_module(self.model, backend="eager")

    Trainer.__name__ = f"With{cls.__name__}"
    return Trainer


@pytest.mark.parametrize("cls, marker, reason", [(Branchy, "BRANCH", "generic_jump"),
                                                 (Printy, "PRINT", "Failed to trace builtin operator")])
def test_graph_breaks_are_reported_with_their_file_and_line(tmp_path, cls, marker, reason):
    original = torch.compile
    finder = FindGraphBreaksCallback(tmp_path / "breaks.txt", skip=2)
    trainer = _with_model(cls)(config([finder]))
    trainer.fit()
    assert trainer.status == "stopped" and trainer.global_step == 3  # analysed after step 3, then stopped
    (region,) = finder.report["regions"].values()
    assert region["breaks"] == 1
    (found,) = region["break_reasons"]
    assert found["file"] == __file__ and found["line"] == _line(cls, marker) and reason in found["reason"]
    assert json.loads((tmp_path / "breaks.json").read_text()) == finder.report
    assert f"{__file__}:{_line(cls, marker)}" in (tmp_path / "breaks.txt").read_text()
    assert torch.compile is original and type(trainer.model) is cls  # nothing patched or replaced


def test_a_break_free_compiled_region_reports_zero_and_fullgraph_names_the_failing_one(tmp_path):
    clean = FindGraphBreaksCallback(tmp_path / "clean.txt", stop=False)
    trainer = _with_model(Clean)(config([clean], compile_model=True, max_steps=3, n_epochs=None))
    trainer.fit()
    assert list(clean.report["regions"]) == ["model"] and clean.report["regions"]["model"]["breaks"] == 0
    assert trainer.global_step == 3 and trainer.status == "completed"  # stop=False: training went on
    strict = FindGraphBreaksCallback(tmp_path / "strict.txt", fullgraph=True)
    _with_model(Branchy)(config([strict])).fit()
    region = strict.report["regions"]["model"]
    assert region["ok"] is False and "Unsupported" in region["error"]


# -------------------------------------------------------------------- CompileMonitorCallback
class Block(nn.Module):
    def __init__(self, n_in, n_out):
        super().__init__()
        self.layer = nn.Linear(n_in, n_out)

    def forward(self, x):
        return torch.tanh(self.layer(x))


class Ragged(ToyTrainer):
    """Two compiled blocks (dynamo eager backend: fast); batch sizes change every step."""

    def configure_models(self):
        self.model = nn.Sequential(Block(8, 16), Block(16, 1))

    def apply_compile(self):
        for block in self.model:
            self.compile_module(block, backend="eager", dynamic=False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        n = 8 - batch_idx % 4
        return super().training_step((x[:n], y[:n]), batch_idx)


def test_compile_monitor_counts_compiles_and_recompiles_per_region(caplog, tmp_path):
    monitor = CompileMonitorCallback(warn_after=2)
    torch._logging.set_logs(recompiles=True)
    try:
        trainer = Ragged(config([monitor, PerformanceReportCallback(output_dir=tmp_path, warmup_steps=0)], compile_model=True,
                                log_every=4))
        trainer.fit()
    finally:
        torch._logging.set_logs()
    summary = monitor.summary()
    for name in ("model.0", "model.1"):
        region = summary["regions"][name]
        assert region["graphs"] == 4 and region["recompiles"] == 3 and region["time_s"] > 0  # 4 batch sizes
    assert summary["recompiles"] == 6 and any("size mismatch" in r for r in summary["regions"]["model.0"]["reasons"])
    assert "compiled region 'model.0' recompiled" in caplog.text
    assert trainer.logged_metrics["compile/model.0/recompiles"] == 3
    # The compile time is a record of the trainer (trainer.build) that the report reads,
    # not a field of the monitor the report would have to find.
    assert trainer.build.compile_time_s == pytest.approx({n: r["time_s"] for n, r in summary["regions"].items()})
    report = json.loads((tmp_path / "performance_report.json").read_text())
    assert report["compile_time_s"] == pytest.approx(summary["time_s"]) and summary["time_s"] > 0
    # ... and the goodput ledger counts it as compile, out of the steps it ran in.
    assert trainer.goodput.parts()["compile"] == pytest.approx(summary["time_s"])


# -------------------------------------------------------------------- PerformanceReportCallback
class Loaders(ToyTrainer):
    """Pre-made batches (a fast loader), or each batch late by 20 ms or three times the
    last step's compute, whichever is longer (a slow one, also on a busy machine)."""

    def __init__(self, cfg, slow):
        super().__init__(cfg, in_features=64, hidden=512, batch_size=64, n_samples=64 * 24)
        self.slow = slow

    def configure_dataloaders(self):
        train, _ = super().configure_dataloaders()
        batches = list(train)
        if not self.slow:
            return batches, None

        stats = self.step_stats

        class Slow:
            def __iter__(self):
                for batch in batches:
                    time.sleep(max(0.02, 3 * stats.compute_s))  # the step just measured
                    yield batch

            def __len__(self):
                return len(batches)

        return Slow(), None


@pytest.mark.parametrize("slow", [True, False])
def test_performance_report_names_the_dataloader_only_when_it_is_slow(tmp_path, slow):
    report = PerformanceReportCallback(output_dir=tmp_path)
    Loaders(config([report]), slow).fit()
    written = json.loads((tmp_path / "performance_report.json").read_text())
    assert written == report.report and (tmp_path / "performance_report.md").read_text().startswith("# Performance report")
    findings = " ".join(written["findings"])
    assert ("dataloader-bound" in findings) is slow
    assert written["steps_measured"] == 18 and written["throughput"]["samples_per_s"] > 0
    assert (written["shares"]["data"] > 0.5) is slow
    assert abs(sum(written["shares"].values()) - 1) < 1e-6


# -------------------------------------------------------------------- StepWindowCallback
def test_the_step_window_times_steps_after_warmup_and_its_rates_agree_with_its_step_time():
    from dream_trainer.callbacks import StepWindowCallback
    from dream_trainer.callbacks.step_window import spread, verdict

    window = StepWindowCallback(warmup=2, parts=3, last=11)  # steps 3..11, in windows of 3
    trainer = ToyTrainer(config([window], n_epochs=None, max_steps=12))
    trainer.fit()
    assert trainer.global_step == 12 and window.steps == 9 and len(window.part_step_s) == 3
    assert window.step_s == pytest.approx(sum(window.part_step_s) / 3)  # equal parts: the mean of their means
    assert window.samples_per_s * window.step_s == pytest.approx(16)  # a batch of 16 per step, from the same span
    assert window.tokens_per_s is None and window.first_step_s > 0  # float features: no tokens
    assert spread([1.0, 1.2, 0.9]) == pytest.approx(0.3) and spread([2.0]) == 0.0
    assert verdict([1.0, 1.02]) == "ok" and "too wide" in verdict([1.0, 1.3]) and "no spread" in verdict([1.0])
    with pytest.raises(ValueError, match=r"StepWindowCallback\(parts=0\) is invalid"):
        StepWindowCallback(parts=0)
    with pytest.raises(ValueError, match=r"needs TrainingParameters.max_steps >= 5 \(got None\)"):
        ToyTrainer(config([StepWindowCallback(warmup=2, parts=3)])).fit()

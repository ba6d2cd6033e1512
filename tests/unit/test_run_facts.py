"""The run's facts that monitors read instead of working them out: ``trainer.total_steps``
(the planned optimizer steps), ``trainer.model_flops_per_token`` / ``model_flops_per_sample``
(FLOP/s and MFU) and ``world.memory_status()`` / ``reset_peak_memory()``; on real runs, with
the shipped callbacks that use them."""

import importlib.util
import json
import logging
import os
import resource
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from dream_trainer import BaseTrainer, Callback, DistributedWorld, LoggingParameters, TrainerConfig, TrainingParameters
from dream_trainer.callbacks import PerformanceReportCallback
from dream_trainer.callbacks.monitors import MemoryMonitorCallback, ThroughputMonitorCallback
from dream_trainer.testing import ToyTrainer
from dream_trainer.trainer.model_facts import dense_flops_per_token
from dream_trainer.world.memory import MB, MemoryStatus

TOY_FLOPS = 6.0 * (8 * 16 + 16 + 16 * 1 + 1)  # ToyTrainer's MLP: 8 -> 16 -> 1


def config(callbacks=(), log_every=1000, **training):
    params = dict(n_epochs=1, num_sanity_val_steps=0)
    params.update(training)
    return TrainerConfig(run_name="r", training_parameters=TrainingParameters(**params),
                         logging_parameters=LoggingParameters(log_every_n_steps=log_every), callbacks=list(callbacks))


class Facts(Callback):
    """What the trainer says at each point of the lifecycle."""

    def __init__(self):
        self.seen = {}

    def _record(self, hook):
        self.seen[hook] = (self.trainer.total_steps, self.trainer.model_flops_per_token)

    def pre_setup(self):
        self._record("pre_setup")

    def post_setup(self):
        self._record("post_setup")

    def post_fit(self):
        self._record("post_fit")


# -------------------------------------------------------------------- total_steps
# ToyTrainer: 192 training samples; batch 16 -> 12 batches per epoch on one rank.
@pytest.mark.parametrize("training, expected", [
    ({"n_epochs": 2}, 24),
    ({"n_epochs": 2, "gradient_accumulation_steps": 5}, 6),  # 12 batches: groups of 5, 5, 2
    ({"n_epochs": None, "max_steps": 7}, 7),
    ({"n_epochs": 2, "max_steps": 5}, 5),
    ({"n_epochs": 3, "max_steps": 50}, 36),
    ({"n_epochs": 2, "train_steps_per_epoch": 7, "gradient_accumulation_steps": 2}, 8),
    ({"n_epochs": 2, "train_steps_per_epoch": 50}, 24),  # the loader runs out at 12
    ({"n_epochs": 2, "train_steps_per_epoch_hint": 99}, 24),  # a hint is for loaders without a length
])
def test_total_steps_is_the_number_of_optimizer_steps_the_run_takes(training, expected):
    facts = Facts()
    trainer = ToyTrainer(config([facts], **training), with_validation=False)
    trainer.fit()
    assert facts.seen["post_setup"][0] == facts.seen["post_fit"][0] == expected
    assert trainer.global_step == expected


@pytest.mark.parametrize("training, expected", [
    ({}, None),  # a stream bounded by epochs, no hint: unknown
    ({"train_steps_per_epoch_hint": 12}, 12),
    ({"n_epochs": 2, "train_steps_per_epoch_hint": 12, "gradient_accumulation_steps": 5}, 6),
    ({"n_epochs": 2, "train_steps_per_epoch": 5}, 10),
    ({"n_epochs": None, "max_steps": 9}, 9),
])
def test_total_steps_of_a_loader_without_a_length(training, expected):
    facts = Facts()
    trainer = ToyTrainer(config([facts], **training), iterable=True, with_validation=False)
    trainer.fit()
    assert facts.seen["post_setup"][0] == expected
    assert trainer.global_step == (expected or 12)  # the hint was right: 12 batches


def test_total_steps_before_setup_is_only_what_max_steps_says():
    facts, bounded = Facts(), Facts()
    ToyTrainer(config([facts], n_epochs=2), with_validation=False).fit()
    ToyTrainer(config([bounded], n_epochs=None, max_steps=3), with_validation=False).fit()
    assert facts.seen["pre_setup"] == (None, TOY_FLOPS)  # the models are configured, the epoch length not agreed
    assert facts.seen["post_setup"] == (24, TOY_FLOPS)
    assert bounded.seen["pre_setup"][0] == 3


def test_a_bad_hint_names_the_field():
    with pytest.raises(ValueError, match=r"TrainingParameters\.train_steps_per_epoch_hint=0 is invalid: expected an int >= 1"):
        TrainingParameters(train_steps_per_epoch_hint=0)


def test_the_throughput_monitor_shows_progress_from_total_steps():
    # A stream: progress and ETA only when the trainer knows the run's length (a hint).
    runs = {}
    for hint in (None, 12):
        monitor = ThroughputMonitorCallback(log_interval=4, warmup_steps=0)
        trainer = ToyTrainer(config([monitor], n_epochs=2, train_steps_per_epoch_hint=hint), iterable=True,
                             with_validation=False)
        trainer.fit()
        runs[hint] = trainer.logged_metrics
    assert "train/progress_pct" not in runs[None] and "train/eta" not in runs[None]
    assert runs[12]["train/progress_pct"] == 100.0 and runs[12]["train/eta"] == 0.0  # step 24 of 24


# -------------------------------------------------------------------- model FLOPs
class TinyLM(BaseTrainer):
    """A token model with an embedding tied to its output layer: batches of integer ids."""

    vocab, d, seq = 11, 6, 5

    def configure(self):
        embed = nn.Embedding(self.vocab, self.d)
        head = nn.Linear(self.d, self.vocab, bias=False)
        head.weight = embed.weight  # tied: counted once, as the output layer's
        self.model = nn.ModuleDict({"embed": embed, "mix": nn.Linear(self.d, self.d), "head": head})
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        ids = torch.randint(0, self.vocab, (64, self.seq + 1), generator=torch.Generator().manual_seed(0))
        self.train_dataloader = DataLoader(ids, batch_size=4)

    def training_step(self, batch, batch_idx):
        m = self.model
        logits = m["head"](torch.tanh(m["mix"](m["embed"](batch[:, :-1]))))
        loss = nn.functional.cross_entropy(logits.reshape(-1, self.vocab), batch[:, 1:].reshape(-1))
        self.backward(loss)
        self.step(self.optimizer)
        return {"loss": loss}


LM_FLOPS = 6.0 * (6 * 6 + 6 + 11 * 6)  # mix weight and bias, the tied head; no embedding lookup


def test_flops_per_token_leaves_out_embedding_lookups_and_counts_a_tied_weight_once():
    facts = Facts()
    trainer = TinyLM(config([facts]))
    trainer.fit()
    assert facts.seen["post_setup"][1] == trainer.model_flops_per_token == LM_FLOPS
    untied = nn.ModuleDict({"embed": nn.Embedding(11, 6), "head": nn.Linear(6, 11, bias=False)})
    assert dense_flops_per_token([untied]) == 6.0 * 66


def test_flops_per_token_of_the_demo_gpt_is_six_times_its_non_embedding_parameters(monkeypatch):
    path = Path(__file__).resolve().parents[2] / "examples" / "gpt" / "model.py"
    spec = importlib.util.spec_from_file_location("gpt_model_for_flops", path)
    gpt = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, gpt)  # its dataclass looks its module up
    spec.loader.exec_module(gpt)
    model = gpt.GPT(gpt.GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, d_model=32))
    embeddings = model.tok_emb.weight.numel() + model.pos_emb.weight.numel()
    assert dense_flops_per_token([model]) == 6 * (model.num_parameters() - embeddings)


def test_the_throughput_monitor_uses_the_trainers_flops_for_mfu():
    monitor = ThroughputMonitorCallback(log_interval=4, peak_flops=1e9)
    logged = []

    class Rates(Callback):
        def on_log(self, metrics, step):
            if "train/mfu" in metrics:
                logged.append(metrics)

    trainer = TinyLM(config([monitor, Rates()]))
    trainer.fit()
    assert len(logged) == 3  # steps 8, 12, 16 (4 has no rate yet)
    for m in logged:
        assert m["train/mfu"] == pytest.approx(m["train/tokens_per_sec"] * LM_FLOPS / 1e9)
        assert m["train/tflops_per_device"] == pytest.approx(m["train/tokens_per_sec"] * LM_FLOPS / 1e12)


class SetFlops(ToyTrainer):
    def configure(self):
        super().configure()
        self.model_flops_per_sample = 2e6  # no tokens in these batches: FLOPs per sample


class Estimated(ToyTrainer):
    def estimate_model_flops_per_token(self):
        return 123.0


def test_flops_set_by_the_user_or_estimated_by_an_override():
    trainer = Estimated(config())
    trainer.fit()
    assert trainer.model_flops_per_token == 123.0
    trainer.model_flops_per_token = 7e3
    assert trainer.model_flops_per_token == 7e3
    trainer.model_flops_per_token = None  # unknown: no MFU
    assert trainer.model_flops_per_token is None
    for bad in (0, -1.0, float("inf"), "1e9", True):
        with pytest.raises(ValueError, match=r"model_flops_per_sample=.* is invalid: expected FLOPs as a finite number > 0"):
            trainer.model_flops_per_sample = bad


def test_flops_per_sample_give_flops_and_mfu_where_batches_have_no_tokens(tmp_path):
    monitor = ThroughputMonitorCallback(log_interval=4, peak_flops=1e12)
    report = PerformanceReportCallback(output_dir=tmp_path, peak_flops=1e12)
    trainer = SetFlops(config([monitor, report], n_epochs=2), with_validation=False)
    trainer.fit()
    m = trainer.logged_metrics
    assert "train/tokens_per_sec" not in m
    assert m["train/tflops_per_device"] == pytest.approx(m["train/samples_per_sec"] * 2e6 / 1e12)
    assert m["train/mfu"] == pytest.approx(m["train/samples_per_sec"] * 2e6 / 1e12)
    flops = json.loads((tmp_path / "performance_report.json").read_text())["flops"]
    samples_per_s = report.report["throughput"]["samples_per_s"]
    assert flops["model_flops_per_token"] == TOY_FLOPS and flops["model_flops_per_sample"] == 2e6
    assert flops["tflops_per_device"] == pytest.approx(samples_per_s * 2e6 / 1e12)
    assert flops["mfu"] == pytest.approx(samples_per_s * 2e6 / 1e12) and flops["peak_tflops_per_device"] == 1.0
    assert "TFLOP/s per device, MFU" in (tmp_path / "performance_report.md").read_text()


def test_the_performance_report_gives_model_flops_of_a_token_model(tmp_path):
    report = PerformanceReportCallback(output_dir=tmp_path)
    TinyLM(config([report])).fit()
    flops, throughput = report.report["flops"], report.report["throughput"]
    assert flops["model_flops_per_token"] == LM_FLOPS and flops["mfu"] is None  # no peak known for a CPU
    assert flops["tflops_per_device"] == pytest.approx(throughput["tokens_per_s"] * LM_FLOPS / 1e12)
    with pytest.raises(ValueError, match=r"PerformanceReportCallback\(peak_flops=0\) is invalid"):
        PerformanceReportCallback(peak_flops=0)


# -------------------------------------------------------------------- memory status
def _proc_status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def test_memory_status_on_cpu_is_the_processes_resident_set_and_its_peak():
    world = DistributedWorld()
    assert world.device.type == "cpu"  # CUDA is hidden from the tests (the cuda lane has the CUDA case)
    before = world.memory_status(device="cpu")
    assert isinstance(before, MemoryStatus) and before.device == torch.device("cpu")
    assert before.allocated == before.reserved == before.rss > 50 * MB and before.total and before.total > before.rss
    assert before.peak_allocated == before.peak_rss >= before.rss and before.fragmentation == 0.0
    block = torch.ones(128 * MB // 4)  # 128 MiB, touched
    grown = world.memory_status(device="cpu")
    assert grown.rss - before.rss > 100 * MB and grown.peak_rss >= grown.rss
    if os.path.exists("/proc/self/status"):  # the same numbers as the kernel's
        assert abs(grown.rss / 1024 - _proc_status_kib("VmRSS:")) < 8 * 1024
    assert abs(world.memory_allocated() - grown.allocated) < 8 * MB  # the sample alone: the same number
    del block
    freed = world.memory_status(device="cpu")
    # The peak remembers (the kernel's counters lag by a few pages: per-thread caches).
    assert freed.rss < grown.rss - 100 * MB and freed.peak_rss > grown.rss - 4 * MB
    assert freed.mb()["peak_rss_mb"] == freed.peak_rss / MB and set(freed.mb()) >= {"allocated_mb", "total_mb"}
    if world.reset_peak_memory():  # Linux: the process's peak starts again from now
        after = world.memory_status(device="cpu")
        assert after.peak_rss < grown.rss - 100 * MB
        assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 < grown.rss - 100 * MB


class CountingWorld(DistributedWorld):
    """A world whose memory readings are recorded (a world that reports other memory, e.g.
    of an accelerator torch has no allocator counters for, plugs in the same way)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.statuses = []

    def memory_status(self, device=None):
        status = super().memory_status(device)
        self.statuses.append(status)
        return status


class UseCountingWorld(Callback):
    def pre_launch(self):
        self.trainer.set_world(CountingWorld(self.trainer.world.device_parameters))


def test_the_memory_monitor_reports_the_worlds_memory_status():
    seen = []

    class Last(Callback):
        def on_log(self, metrics, step):
            if "train/memory_current_mb" in metrics:
                seen.append((metrics, trainer.world.statuses[-1]))

    monitor = MemoryMonitorCallback(log_interval=4, sample_every=4)
    trainer = ToyTrainer(config([UseCountingWorld(), monitor, Last()]), with_validation=False)
    trainer.fit()
    assert len(seen) == 3  # steps 4, 8, 12
    for metrics, status in seen:
        assert metrics["train/memory_current_mb"] == status.allocated / MB
        assert metrics["train/memory_peak_mb"] == status.peak_allocated / MB
        assert metrics["train/memory_rss_mb"] == status.rss / MB
    assert trainer.display_fields["mem"] == f"rss: {seen[-1][1].rss / MB / 1024:.2f}GB"
    assert trainer.logged_metrics["epoch/memory_peak_mb"] >= trainer.logged_metrics["epoch/memory_start_mb"] > 50


class LeakingWorld(DistributedWorld):
    """A world whose allocated memory grows by `growth` MiB at each frequent sample; its full
    status (log steps) is counted."""

    def __init__(self, growth, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.growth, self.samples, self.statuses = growth, 0, 0

    def memory_allocated(self):
        self.samples += 1
        return 500 * MB + int(self.samples * self.growth * MB)

    def memory_status(self, device=None):
        self.statuses += 1
        return super().memory_status(device)


@pytest.mark.parametrize("growth", [2.0, 0.0])
def test_the_memory_monitor_samples_the_worlds_allocated_memory_and_warns_once_of_a_leak(growth, caplog):
    class UseLeakingWorld(Callback):
        def pre_launch(self):
            self.trainer.set_world(LeakingWorld(growth, self.trainer.world.device_parameters))

    monitor = MemoryMonitorCallback(log_interval=1000, sample_every=1, leak_window=5, leak_min_mb=1.0)
    trainer = ToyTrainer(config([UseLeakingWorld(), monitor]), with_validation=False)
    with caplog.at_level(logging.WARNING, logger="dream_trainer.callbacks.monitors.memory"):
        trainer.fit()
    world = trainer.world
    assert world.samples >= trainer.global_step == 12  # every step sampled (and each epoch's edges)
    assert world.statuses == 0  # no log step: the full status is never read
    warnings = [r.getMessage() for r in caplog.records if "memory keeps rising" in r.getMessage()]
    if growth:
        assert len(warnings) == 1 and monitor.leak is not None  # once, with the growth rate per step
        assert monitor.leak[1] == pytest.approx(growth) and "2.000 MB per step" in warnings[0]
    else:
        assert not warnings and monitor.leak is None


def test_the_performance_report_gives_the_peak_of_the_training_not_of_the_setup(tmp_path):
    world = DistributedWorld()
    if not world.reset_peak_memory():
        pytest.skip("the process's peak cannot be reset here")
    block = torch.ones(256 * MB // 4)  # a peak before fit(): not the training's
    del block
    setup_peak = world.memory_status().peak_rss
    report = PerformanceReportCallback(output_dir=tmp_path)
    ToyTrainer(config([report]), with_validation=False).fit()
    assert report.report["memory_kind"] == "process RSS"
    assert 50 < report.report["peak_memory_mb"] < setup_peak / MB - 200


def test_a_throughput_monitor_attached_mid_run_asks_for_counts_and_rates_from_then_on():
    """Nothing asked for batch counts before it: the monitor added at step 3 asks itself
    (its first step only asks) and logs samples/s from counts, not from a None."""
    monitor = ThroughputMonitorCallback(log_interval=4, warmup_steps=0, peak_flops=1e12)

    class AttachLate(Callback):
        def on_step_end(self, step):
            if step == 3:
                assert self.trainer.step_stats.total_samples is None  # nobody asked yet
                self.trainer.callbacks.add(monitor)

    trainer = SetFlops(config([AttachLate()], n_epochs=2), with_validation=False)
    trainer.fit()
    stats, m = trainer.step_stats, trainer.logged_metrics
    assert stats.total_samples is not None and stats.total_samples > 0
    assert m["train/samples_per_sec"] > 0

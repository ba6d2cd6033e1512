"""The custom performance callbacks of docs/performance.md, run as written (the files under
examples/callbacks, which the page includes) on the GPT demo."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "callbacks"


def _load(name):
    sys.path.insert(0, str(EXAMPLES))
    try:
        spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(EXAMPLES))


def _run(name, tmp_path, *extra):
    module = _load(name)
    sys.path.insert(0, str(EXAMPLES))
    try:
        return module.main(["--root-dir", str(tmp_path), "--run-name", name, *extra])
    finally:
        sys.path.remove(str(EXAMPLES))


def test_throughput_monitor(tmp_path):
    trainer, monitor = _run("throughput_monitor", tmp_path)
    assert len(monitor.history) == 5  # log steps 10, 15, ..., 30 (the first window starts at 5)
    assert all(m["train/tokens_per_sec"] > 0 and m["train/samples_per_sec"] > 0 for m in monitor.history)
    assert trainer.logged_metrics["train/tokens_per_sec"] == monitor.history[-1]["train/tokens_per_sec"]


def test_compilation_monitor(tmp_path):
    import torch._dynamo.callback as dynamo

    trainer, monitor = _run("compilation_monitor", tmp_path, "--compile", "--n-layer", "1", "--d-model", "32", "--n-head", "2")
    assert monitor.trainer_regions == ["model"] and monitor.events  # one device: the whole model is one region and all(s > 0 for _, s in monitor.events)
    assert monitor.events[0][0] == 0  # the first compile, at the first call: seen (registered before it)
    assert trainer.logged_metrics["compile/events"] == len(monitor.events)
    assert monitor._start not in dynamo.callback_handler.start_callbacks  # removed at teardown


def test_memory_profiler(tmp_path):
    trainer, profiler = _run("memory_profiler", tmp_path)
    assert [s for s, _ in profiler.peaks] == [5, 10, 15, 20, 25, 30] and all(mb > 50 for _, mb in profiler.peaks)
    assert trainer.logged_metrics["train/memory_window_peak_mb"] == profiler.peaks[-1][1]
    assert profiler.snapshot is None and not profiler._recording  # no snapshot asked (and none on CPU)


def test_performance_reporter(tmp_path):
    trainer, reporter = _run("performance_reporter", tmp_path)
    text = reporter.path.read_text()
    assert reporter.path == trainer.run_dir / "perf_summary.md" and "steps measured: 28" in text and ": completed" in text


@pytest.mark.parametrize("delay_ms", [0, 150])
def test_auto_analyzer_finds_a_slow_dataloader(tmp_path, delay_ms):
    trainer, analyzer = _run("auto_analyzer", tmp_path, "--data-delay-ms", str(delay_ms))
    assert len(analyzer.recent) == analyzer.window and trainer.global_step == 30
    assert ("dataloader_bound" in analyzer.findings) is (delay_ms > 0)
    if delay_ms:
        assert trainer.logged_metrics["perf/dataloader_bound"] == 1.0


@pytest.mark.parametrize("name", ["throughput_monitor", "compilation_monitor", "memory_profiler",
                                  "performance_reporter", "auto_analyzer"])
def test_each_example_runs_as_a_script(tmp_path, name):
    """``python examples/callbacks/<name>.py`` (a few steps): the script's own entry point."""
    argv = ["--steps", "6", "--val-every", "3", "--log-every", "2", "--root-dir", str(tmp_path), "--run-name", name]
    done = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), *argv], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "validation loss by step" in done.stdout and "Traceback" not in done.stderr

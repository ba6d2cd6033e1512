"""The peak FLOP/s behind MFU is said once with its source: device, training dtype (float8
when `Fp8QuantizationCallback` converted the model), user-given or from the table; an unknown
device says that MFU is not computed and how to set the peak. This machine has no GPU: the
device name lookup is patched to a GPU's name (the edge of the machine), the runs are real."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from dream_trainer import DeviceParameters, TrainerConfig, TrainingParameters
from dream_trainer.callbacks import PerformanceReportCallback, ThroughputMonitorCallback
from dream_trainer.callbacks import peak_flops
from dream_trainer.testing import ToyTrainer

H100 = "NVIDIA H100 80GB HBM3"


def _config(callbacks, root, **device):
    return TrainerConfig(run_name="peak", root_dir=str(root), callbacks=list(callbacks),
                         device_parameters=DeviceParameters.SINGLE_DEVICE(**device),
                         training_parameters=TrainingParameters(n_epochs=None, max_steps=4, num_sanity_val_steps=0))


def _fit(trainer_cls, root, caplog, *extra, **device):
    monitor, report = ThroughputMonitorCallback(log_interval=2), PerformanceReportCallback(output_dir=root)
    with caplog.at_level(logging.INFO):
        trainer = trainer_cls(_config([*extra, monitor, report], root, **device))
        trainer.fit()
    return trainer, monitor, json.loads((root / "performance_report.json").read_text())["flops"]


def test_float8_runs_use_the_float8_peak_and_say_so(tmp_path, caplog, monkeypatch):
    pytest.importorskip("torchao")
    from dream_trainer.callbacks import Fp8QuantizationCallback
    from tests.unit.test_fp8 import Float8Toy

    monkeypatch.setattr(peak_flops, "device_name", lambda device: H100)
    trainer, monitor, flops = _fit(Float8Toy, tmp_path, caplog, Fp8QuantizationCallback({"model": "tensorwise"}))
    assert trainer.float8 == {"model": "tensorwise"}
    assert monitor.peak == peak_flops.PeakFlops(1979e12, H100, "float8", "table")
    said = [r.getMessage() for r in caplog.records if "MFU peak" in r.getMessage()]
    assert said and all("1,979.0 TFLOP/s" in m and "float8" in m and H100 in m and "table" in m for m in said)
    assert flops["peak"] == {"value": 1979e12, "device": H100, "dtype": "float8", "source": "table"}
    assert flops["peak_tflops_per_device"] == pytest.approx(1979.0)
    assert monitor.peak_flops == 1979e12  # train/mfu divides by it


def test_bf16_fp32_and_a_user_peak(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(peak_flops, "device_name", lambda device: H100)
    _, monitor, flops = _fit(ToyTrainer, tmp_path / "bf16", caplog, autocast_dtype=torch.bfloat16)
    assert (monitor.peak.value, monitor.peak.dtype) == (989e12, "bf16") and flops["peak"]["dtype"] == "bf16"
    _, monitor, _ = _fit(ToyTrainer, tmp_path / "fp32", caplog)
    assert (monitor.peak.value, monitor.peak.dtype, monitor.peak.source) == (67e12, "fp32", "table")
    given = ThroughputMonitorCallback(log_interval=2, peak_flops=5e14)
    ToyTrainer(_config([given], tmp_path / "user")).fit()
    assert given.peak == peak_flops.PeakFlops(5e14, H100, "fp32", "user")
    assert "given by the user" in given.peak.describe()


def test_an_unknown_device_says_mfu_is_not_computed_and_how_to_set_the_peak(tmp_path, caplog):
    _, monitor, flops = _fit(ToyTrainer, tmp_path, caplog)  # a CPU: no peak in the table
    assert monitor.peak.value is None and monitor.peak.source == "unknown" and flops["mfu"] is None
    said = [r.getMessage() for r in caplog.records if "MFU is not computed" in r.getMessage()]
    assert said and "cpu" in said[0] and "peak_flops=" in said[0]
    assert "MFU is not computed" in (tmp_path / "performance_report.md").read_text()
    assert all("train/mfu" not in m for m in [r.getMessage() for r in caplog.records])
    with pytest.raises(ValueError, match=r"ThroughputMonitorCallback\(peak_flops=-1\) is invalid"):
        ThroughputMonitorCallback(peak_flops=-1)


def test_the_table_matches_by_name_and_dtype():
    assert peak_flops.lookup_peak("NVIDIA H100 PCIe", "bf16") == 756e12
    assert peak_flops.lookup_peak("NVIDIA A100-SXM4-80GB", "float8") is None  # no float8 tensor cores
    assert peak_flops.lookup_peak("NVIDIA A10", "bf16") == 125e12

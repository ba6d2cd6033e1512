"""Fp8QuantizationCallback in one process: which layers convert (default filter, the user's and the
trainer's), which hardware multiplies in float8 and what torchao is told where it does not,
a model with nothing to convert, the summary a user sees, bad arguments, a float8 model
through a checkpoint round trip and export."""

import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from dream_trainer import (
    CheckpointCallback,
    CheckpointParameters,
    DeviceParameters,
    TrainerConfig,
    TrainingParameters,
    export_model,
)
from dream_trainer.callbacks import Fp8QuantizationCallback
from dream_trainer.callbacks import fp8 as fp8_module
from dream_trainer.callbacks.fp8 import Float8Hardware, float8_hardware
from dream_trainer.testing import ToyTrainer

pytest.importorskip("torchao")


class Net(nn.Module):
    """One layer that converts, and one of each reason not to."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(64, 128)  # converts
        self.mid = nn.Linear(128, 128)  # excluded by the user's filter
        self.extra = nn.Linear(128, 128)  # excluded by the trainer's filter
        self.odd = nn.Linear(128, 100)  # 100 is not a multiple of 16
        self.squeeze = nn.Linear(100, 16)  # neither is 100
        self.tiny = nn.Linear(16, 16)  # 256 weights
        self.head = nn.Linear(16, 16)  # the output head

    def forward(self, x):
        for layer in (self.stem, self.mid, self.extra, self.odd, self.squeeze, self.tiny, self.head):
            x = torch.tanh(layer(x))
        return x.mean(dim=1, keepdim=True)


class NotExtra:
    """A trainer filter (dream-trainer style): callable, with validate()."""

    def __init__(self):
        self.seen, self.validated = set(), False

    def __call__(self, module, fqn):
        self.seen.add(fqn)
        return fqn != "extra"

    def validate(self):
        self.validated = "extra" in self.seen


class Float8Toy(ToyTrainer):
    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, in_features=64, **kwargs)
        self.filter = NotExtra()

    def configure_models(self):
        self.model = Net()

    def quantize_module_filters(self):
        return {"model": self.filter}


class Conv1D(nn.Module):
    """GPT-2's linear layer (``transformers.pytorch_utils.Conv1D``): ``x @ weight + bias``,
    the weight stored (in, out). Not an ``nn.Linear``: torchao does not convert it."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).reshape(*x.shape[:-1], self.nf)


class Gpt2Mlp(nn.Module):
    """GPT-2's MLP (``c_fc``, ``c_proj``: Conv1D of float8-friendly sizes), one output."""

    def __init__(self, width=64):
        super().__init__()
        self.c_fc, self.c_proj = Conv1D(4 * width, width), Conv1D(width, 4 * width)

    def forward(self, x):
        return self.c_proj(torch.tanh(self.c_fc(x))).mean(dim=-1, keepdim=True)


class Gpt2Toy(ToyTrainer):
    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, in_features=64, **kwargs)

    def configure_models(self):
        self.model = Gpt2Mlp()


def float8_layers(model):
    from torchao.float8.float8_linear import Float8Linear

    return [m for m in model.modules() if isinstance(m, Float8Linear)]


def config(callbacks, root=None, **training):
    params = dict(n_epochs=1, num_sanity_val_steps=0)
    params.update(training)
    return TrainerConfig(run_name="r", root_dir=str(root or "runs"), device_parameters=DeviceParameters.SINGLE_DEVICE(),
                         training_parameters=TrainingParameters(**params), callbacks=list(callbacks))


def test_conversion_and_filters(caplog):
    from torchao.float8.float8_linear import Float8Linear

    fp8 = Fp8QuantizationCallback({"model": "tensorwise"}, module_filter_fn=lambda module, fqn: fqn != "mid")
    with caplog.at_level(logging.INFO):
        trainer = Float8Toy(config([fp8], max_steps=3, n_epochs=None))
        trainer.fit()
    assert fp8.converted == {"model": ["stem"]} and type(trainer.model.stem) is Float8Linear
    assert fp8.skipped["model"] == {
        "mid": "excluded by a filter", "extra": "excluded by a filter",
        "odd": "dimensions 128x100 are not multiples of 16", "squeeze": "dimensions 100x16 are not multiples of 16",
        "tiny": "tiny (256 < 4096 weights)", "head": "the output head",
    }
    assert trainer.filter.validated and trainer.float8 == {"model": "tensorwise"}
    assert ("model: 1 of 7 nn.Linear layer(s) converted to float8 (tensorwise, float8 matmuls emulated): stem; "
            "skipped: mid, extra (excluded by a filter); odd (dimensions 128x100") in caplog.text
    assert trainer.global_step == 3 and all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_without_float8_matmuls_torchao_is_told_to_emulate(caplog, monkeypatch):
    """This CPU has no float8 matmul: the config torchao gets says emulate=True, and the
    warning says so. Where the hardware has them (an H100: the decision mocked, the
    machine lacks one), torchao multiplies in float8 (on a CPU: torch._scaled_mm's CPU
    kernel) and nothing warns."""
    fp8 = Fp8QuantizationCallback("rowwise")
    with caplog.at_level(logging.INFO):
        trainer = Float8Toy(config([fp8], max_steps=2, n_epochs=None))
        trainer.fit()
    layers = float8_layers(trainer.model)
    assert fp8.hardware == Float8Hardware(False, "this CPU") and len(layers) == 2  # stem and mid
    for layer in layers:
        mm = layer.linear_mm_config
        assert layer.config.emulate and mm.output.emulate and mm.grad_input.emulate and mm.grad_weight.emulate
        assert layer.config.round_scales_to_power_of_2  # still the rowwise recipe
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith("Fp8QuantizationCallback: this CPU has no float8 matmul, so torchao emulates it "
                              "(Float8LinearConfig(emulate=True))")

    caplog.clear()
    monkeypatch.setattr(fp8_module, "float8_hardware", lambda device: Float8Hardware(True, "NVIDIA H100"))
    # tensorwise: the CPU kernel of torch._scaled_mm takes only per-tensor scales before torch 2.13
    fp8 = Fp8QuantizationCallback("tensorwise")
    with caplog.at_level(logging.INFO):
        trainer = Float8Toy(config([fp8], max_steps=2, n_epochs=None))
        trainer.fit()
    layers = float8_layers(trainer.model)
    assert len(layers) == 2 and not any(m.config.emulate or m.linear_mm_config.output.emulate for m in layers)
    assert "(tensorwise, native float8 matmuls)" in caplog.text and "emulate" not in caplog.text
    assert trainer.global_step == 2 and all(torch.isfinite(p).all() for p in trainer.model.parameters())
    mm = layers[0].linear_mm_config  # torchao's recipe: fast accumulation in the forward's matmul only
    assert mm.output.use_fast_accum and not mm.grad_input.use_fast_accum and not mm.grad_weight.use_fast_accum

    fp8 = Fp8QuantizationCallback("tensorwise", fast_accum=True, display=False)  # and in the backward's too
    trainer = Float8Toy(config([fp8], max_steps=2, n_epochs=None))
    trainer.fit()
    layers = float8_layers(trainer.model)
    assert len(layers) == 2 and all(m.linear_mm_config.grad_input.use_fast_accum and
                                    m.linear_mm_config.grad_weight.use_fast_accum for m in layers)
    assert trainer.global_step == 2 and all(torch.isfinite(p).all() for p in trainer.model.parameters())


@pytest.mark.parametrize(("capability", "native"), [
    ((7, 5), False), ((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True), ((10, 0), True),
])
def test_which_nvidia_gpus_have_float8_matmuls(monkeypatch, capability, native):
    """Compute capability 8.9 (Ada) and later: native; A100 (8.0), A10 (8.6), T4 (7.5):
    emulated. Mocked: this machine has no GPU."""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU")
    name = f"GPU (compute capability {capability[0]}.{capability[1]})"
    assert float8_hardware(torch.device("cuda", 0)) == Float8Hardware(native, name)


@pytest.mark.parametrize(("arch", "native"), [("gfx942:sramecc+:xnack-", True), ("gfx950", True), ("gfx90a", False)])
def test_which_amd_gpus_have_float8_matmuls(monkeypatch, arch, native):
    """MI300 (gfx942) and MI350 (gfx950): native; MI250 (gfx90a): emulated. Mocked: a ROCm
    build with a GPU, which this machine is not."""
    monkeypatch.setattr(torch.version, "hip", "6.4")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "AMD Instinct")
    properties = types.SimpleNamespace(gcnArchName=arch)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: properties)
    assert float8_hardware("cuda") == Float8Hardware(native, f"AMD Instinct ({arch})")


def test_other_devices_are_refused():
    assert float8_hardware("cpu") == Float8Hardware(False, "this CPU")
    with pytest.raises(ValueError, match=r"float8 training on device 'mps' is not supported: torchao's float8 runs on "
                                         r"NVIDIA GPUs \(native from compute capability 8.9, emulated before\)"):
        float8_hardware("mps")


def test_a_model_without_nn_linear_layers_converts_nothing_and_says_why(caplog):
    """GPT-2's Conv1D layers are not nn.Linear: "0 layers converted", why, no float8 claimed."""
    fp8 = Fp8QuantizationCallback()
    with caplog.at_level(logging.INFO):
        trainer = Gpt2Toy(config([fp8], max_steps=2, n_epochs=None))
        trainer.fit()
    assert fp8.converted == {"model": []} and trainer.float8 == {} and not float8_layers(trainer.model)
    why = "Conv1D, not an nn.Linear: torchao converts only nn.Linear"
    assert fp8.skipped == {"model": {"c_fc": why, "c_proj": why}}
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warning == (f"Fp8QuantizationCallback: model: 0 layers converted to float8: it has no nn.Linear layers; "
                       f"not converted: c_fc, c_proj ({why}). It trains in high precision, as without Fp8QuantizationCallback")
    assert "emulate" not in caplog.text and "float8 numerics" not in caplog.text  # nothing in float8 to emulate

    caplog.clear()
    fp8 = Fp8QuantizationCallback()
    with caplog.at_level(logging.INFO):
        plain = ToyTrainer(config([fp8], max_steps=1, n_epochs=None))  # Linear(8, 16), Linear(16, 1): both skipped
        plain.fit()
    assert fp8.converted == {"model": []} and plain.float8 == {}
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warning.startswith("Fp8QuantizationCallback: model: 0 layers converted to float8: its 2 nn.Linear layer(s) were all "
                              "skipped; not converted: 0 (dimensions 8x16 are not multiples of 16); 2 (dimensions 16x1")


SEEN_WITHOUT_LOGGING = """
from dream_trainer.callbacks import Fp8QuantizationCallback
from tests.unit.test_fp8 import Float8Toy, Gpt2Toy, config

for trainer in (Float8Toy, Gpt2Toy):
    trainer(config([Fp8QuantizationCallback()], max_steps=1, n_epochs=None)).fit()
"""


def test_the_summary_shows_without_logging_configured(tmp_path):
    """A script that sets up no logging (Python's default: warnings to stderr, nothing else)
    shows what was converted (stdout) and what was not, and the emulation (stderr)."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}  # tiny models: one thread is fastest, the more so on a busy machine
    run = subprocess.run([sys.executable, "-c", SEEN_WITHOUT_LOGGING], cwd=tmp_path, env=env, capture_output=True,
                         text=True, check=False)
    assert run.returncode == 0, run.stderr
    assert ("Fp8QuantizationCallback: model: 2 of 7 nn.Linear layer(s) converted to float8 (tensorwise, float8 matmuls "
            "emulated): stem, mid; skipped: extra (excluded by a filter); odd (dimensions 128x100") in run.stdout
    assert "this CPU has no float8 matmul, so torchao emulates it" in run.stderr
    assert ("Fp8QuantizationCallback: model: 0 layers converted to float8: it has no nn.Linear layers; not converted: c_fc, "
            "c_proj (Conv1D, not an nn.Linear") in run.stderr


def test_disabled_and_bad_arguments(capsys):
    fp8 = Fp8QuantizationCallback(enabled=True, display=False)  # dream-trainer's spelling; display=False: nothing printed
    trainer = Float8Toy(config([fp8], max_steps=1, n_epochs=None))
    trainer.fit()
    assert trainer.float8 == {"model": "tensorwise"} and "Fp8QuantizationCallback" not in capsys.readouterr().out
    off = Float8Toy(config([Fp8QuantizationCallback(enabled=False)], max_steps=1, n_epochs=None))
    off.fit()
    assert off.float8 == {} and type(off.model.stem) is nn.Linear
    with pytest.raises(TypeError, match=r"Fp8QuantizationCallback\(display='no'\): expected True or False"):
        Fp8QuantizationCallback(display="no")
    with pytest.raises(TypeError, match=r"Fp8QuantizationCallback\(fast_accum=1\): expected True or False"):
        Fp8QuantizationCallback(fast_accum=1)
    with pytest.raises(ValueError, match=r"recipe 'delayed' is not one of \['tensorwise', 'rowwise', 'rowwise_with_gw_hp'\]"):
        Fp8QuantizationCallback({"model": "delayed"})
    with pytest.raises(TypeError, match=r"amax_history_len=.*delayed scaling was removed from torchao; use the dynamic 'tensorwise'"):
        Fp8QuantizationCallback(amax_history_len=16, amax_compute_algo="max")
    with pytest.raises(KeyError, match=r"no model named \['encoder'\]"):
        Float8Toy(config([Fp8QuantizationCallback({"encoder": "rowwise"})], max_steps=1, n_epochs=None)).fit()


def test_a_float8_model_resumes_exactly_and_exports_plain(tmp_path):
    def fit(root, max_steps):
        saver = CheckpointCallback(CheckpointParameters(root_dir=str(root), every_n_steps=4, every_n_epochs=None))
        trainer = Float8Toy(config([Fp8QuantizationCallback(), saver], root=tmp_path / "runs", max_steps=max_steps, n_epochs=2),
                            dropout=0.1)
        trainer.fit()
        return trainer, saver

    full, _ = fit(tmp_path / "full", None)
    first, _ = fit(tmp_path / "cut", 8)
    second, saver = fit(tmp_path / "cut", None)
    assert saver.resumed_from.name == "step_000000008"
    assert [x.item() for x in first.step_losses + second.step_losses] == [x.item() for x in full.step_losses]
    from safetensors.torch import load_file

    out = export_model(saver.saved[-1], tmp_path / "plain.safetensors")
    plain = Net()
    plain.load_state_dict(load_file(str(out)))  # strict: the unconverted model's keys
    for (name, exported), (_, trained) in zip(plain.state_dict().items(), second.model.state_dict().items()):
        assert exported.dtype == torch.float32 and torch.equal(exported, trained), name

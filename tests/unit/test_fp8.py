"""Fp8Quantization in one process: which layers convert (default filter, the user's and the
trainer's), bad arguments, a float8 model through a checkpoint round trip and export."""

import logging

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
from dream_trainer.callbacks import Fp8Quantization
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


def config(callbacks, root=None, **training):
    params = dict(n_epochs=1, num_sanity_val_steps=0)
    params.update(training)
    return TrainerConfig(run_name="r", root_dir=str(root or "runs"), device_parameters=DeviceParameters.SINGLE_DEVICE(),
                         training_parameters=TrainingParameters(**params), callbacks=list(callbacks))


def test_conversion_and_filters(caplog):
    from torchao.float8.float8_linear import Float8Linear

    fp8 = Fp8Quantization({"model": "tensorwise"}, module_filter_fn=lambda module, fqn: fqn != "mid")
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
    assert "converted 1 Linear layer(s) ['stem']" in caplog.text and "emulates it" in caplog.text
    assert trainer.global_step == 3 and all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_disabled_and_bad_arguments():
    trainer = Float8Toy(config([Fp8Quantization(enabled=True)], max_steps=1, n_epochs=None))  # dream-trainer's spelling
    trainer.fit()
    assert trainer.float8 == {"model": "tensorwise"}
    off = Float8Toy(config([Fp8Quantization(enabled=False)], max_steps=1, n_epochs=None))
    off.fit()
    assert off.float8 == {} and type(off.model.stem) is nn.Linear
    with pytest.raises(ValueError, match=r"recipe 'delayed' is not one of \['tensorwise', 'rowwise', 'rowwise_with_gw_hp'\]"):
        Fp8Quantization({"model": "delayed"})
    with pytest.raises(TypeError, match=r"amax_history_len=.*delayed scaling was removed from torchao; use the dynamic 'tensorwise'"):
        Fp8Quantization(amax_history_len=16, amax_compute_algo="max")
    with pytest.raises(KeyError, match=r"no model named \['encoder'\]"):
        Float8Toy(config([Fp8Quantization({"encoder": "rowwise"})], max_steps=1, n_epochs=None)).fit()


def test_a_float8_model_resumes_exactly_and_exports_plain(tmp_path):
    def fit(root, max_steps):
        saver = CheckpointCallback(CheckpointParameters(root_dir=str(root), every_n_steps=4, every_n_epochs=None))
        trainer = Float8Toy(config([Fp8Quantization(), saver], root=tmp_path / "runs", max_steps=max_steps, n_epochs=2),
                            dropout=0.1)
        trainer.fit()
        return trainer, saver

    full, _ = fit(tmp_path / "full", None)
    first, _ = fit(tmp_path / "cut", 8)
    second, saver = fit(tmp_path / "cut", None)
    assert saver.resumed_from.name == "step_000000008"
    assert [x.item() for x in first.step_losses + second.step_losses] == [x.item() for x in full.step_losses]
    out = export_model(saver.saved[-1], tmp_path / "plain.pt")
    plain = Net()
    plain.load_state_dict(torch.load(out, weights_only=True))  # strict: the unconverted model's keys
    for (name, exported), (_, trained) in zip(plain.state_dict().items(), second.model.state_dict().items()):
        assert exported.dtype == torch.float32 and torch.equal(exported, trained), name

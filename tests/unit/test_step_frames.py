"""The step path you can follow: six frames from ``fit()`` to ``optimizer.step()``, and a
batch traced through one step never re-enters a module it called out of (no A -> B -> A on
the stack)."""

import sys

import torch

from dream_trainer import Callback, DeviceParameters, LoggingParameters, TrainerConfig, TrainingParameters
from dream_trainer.testing import ToyTrainer


def _trainer(tmp_path, callbacks=(), **training):
    params = dict(n_epochs=1, max_steps=4, num_sanity_val_steps=0, gradient_clip_val=1.0)
    params.update(training)
    return ToyTrainer(TrainerConfig(
        root_dir=str(tmp_path), device_parameters=DeviceParameters.SINGLE_DEVICE(),
        training_parameters=TrainingParameters(**params), logging_parameters=LoggingParameters(log_every_n_steps=2),
        callbacks=list(callbacks)), with_validation=False)


def _stack_between(frame, outer: str):
    """(module, function) of the frames from `frame` out to the first one named `outer`."""
    names = []
    while frame is not None:
        names.append((frame.f_globals.get("__name__", "?"), frame.f_code.co_name))
        if frame.f_code.co_name == outer:
            return names
        frame = frame.f_back
    raise AssertionError(f"no {outer}() frame on the stack: {names}")


def test_six_frames_from_fit_to_the_optimizer_step(tmp_path):
    seen = []
    trainer = _trainer(tmp_path)
    original = torch.optim.SGD.step

    def step(self, *args, **kwargs):
        seen.append(_stack_between(sys._getframe(1), "fit"))
        return original(self, *args, **kwargs)

    torch.optim.SGD.step = step
    try:
        trainer.fit()
    finally:
        torch.optim.SGD.step = original
    assert len(seen) == 4
    chain = [name for module, name in reversed(seen[-1]) if not module.startswith("torch")]  # torch's step wrapper
    assert chain == ["fit", "_run", "_train_epoch", "_train_on", "training_step", "step"], chain  # then optimizer.step


def _framework(module: str) -> bool:
    """The framework's own modules (the test kit's trainer is user code)."""
    return module.startswith("dream_trainer") and not module.startswith("dream_trainer.testing")


class _Probe(Callback):
    """Traces every call the framework makes from the end of step `first` - 1 to the start of
    step `last` + 1: batch fetches, steps, a log step, the control points."""

    def __init__(self, first: int, last: int):
        self.first, self.last, self.stacks = first, last, []

    def on_step_end(self, step):
        if step == self.first - 1:
            sys.setprofile(self._trace)

    def on_step_begin(self, step):
        if step == self.last + 1:
            sys.setprofile(None)

    def _trace(self, frame, event, arg):
        if event == "call" and _framework(frame.f_globals.get("__name__", "")):
            self.stacks.append(_stack_between(frame, "_train_epoch"))


def test_a_step_never_calls_back_into_a_module_it_called_out_of(tmp_path):
    """At every call the trainer's code makes during a step, the framework modules on the stack
    (from `_train_epoch` in) form runs that never repeat: a module that called out is not
    entered again until that call returns (the batch does not bounce between modules)."""
    probe = _Probe(first=3, last=4)  # step 4 logs
    _trainer(tmp_path, [probe], max_steps=6).fit()
    assert probe.stacks, "the probe traced nothing"
    bounces = set()
    for stack in probe.stacks:
        modules = [m for m, _ in reversed(stack) if _framework(m)]
        runs = [m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m]
        if len(runs) != len(set(runs)):
            bounces.add(" -> ".join(f"{m}.{f}" for m, f in reversed(stack) if _framework(m)))
    assert not bounces, "\n".join(sorted(bounces))

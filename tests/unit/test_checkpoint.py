"""CheckpointCallback in one process: exact resume (mid-epoch, epoch end, accumulation,
async), preemption, keep-last-K / keep-best, bad checkpoints, callback state, export."""

import logging
import os
import signal
import time

import pytest
import torch
from torch import nn

from dream_trainer import (
    EXIT_PREEMPTED,
    Callback,
    CheckpointCallback,
    CheckpointError,
    CheckpointParameters,
    DeviceParameters,
    TrainerConfig,
    TrainingParameters,
    export_model,
    list_checkpoints,
)
from dream_trainer.checkpoint import CheckpointInfo, to_remove
from dream_trainer.testing import ToyTrainer

ROOT = "ckpt"


class Counter(Callback):
    """A callback with state: counts optimizer steps (must survive resume)."""

    def __init__(self):
        self.count = 0

    def post_optimizer_step(self, model, optimizer):
        self.count += 1

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def run(max_steps=None, n_epochs=2, accumulation=1, callbacks=(), hidden=16, **checkpoint):
    checkpoint.setdefault("root_dir", ROOT)
    cb = CheckpointCallback(CheckpointParameters(**checkpoint))
    config = TrainerConfig(
        root_dir="runs",
        run_name="r",
        device_parameters=DeviceParameters.SINGLE_DEVICE(),
        training_parameters=TrainingParameters(
            n_epochs=n_epochs, max_steps=max_steps, gradient_accumulation_steps=accumulation,
            val_every_n_steps=4, num_sanity_val_steps=1,
        ),
        callbacks=[*callbacks, cb],
    )
    # Shuffled data and input dropout: a resumed run must restore the data position and the RNG.
    trainer = ToyTrainer(config, shuffle=True, dropout=0.2, hidden=hidden)
    trainer.fit()
    return trainer, cb


def losses(trainer):
    return [x.item() for x in trainer.step_losses]


@pytest.mark.parametrize(
    "cut, accumulation, async_mode",
    [
        (dict(max_steps=7), 1, "off"),  # mid-epoch, right after a validation-free step
        (dict(max_steps=8), 1, "async"),  # a step with validation (every 4), async save
        (dict(max_steps=12), 1, "async_pinned"),  # the last batch of epoch 0
        (dict(n_epochs=1), 1, "off"),  # a finished epoch (saved after its end hooks)
        (dict(max_steps=3), 2, "off"),  # accumulation: micro-batches 6 of 12
    ],
)
def test_resume_continues_exactly(cut, accumulation, async_mode):
    full, _ = run(accumulation=accumulation, root_dir="full", async_mode=async_mode, every_n_steps=5)
    first, saver = run(accumulation=accumulation, async_mode=async_mode, every_n_steps=5, **cut)
    assert saver.saved and saver.blocked_s
    second, loader = run(accumulation=accumulation, async_mode=async_mode, every_n_steps=5)
    assert loader.resumed_from == saver.saved[-1] and second.resumed
    assert losses(first) + losses(second) == losses(full)  # bitwise, step by step
    for a, b in zip(full.model.parameters(), second.model.parameters()):
        assert torch.equal(a, b)
    assert second.global_step == full.global_step == 24 // accumulation


def test_async_pinned_saves_again_where_torchs_stager_closes_itself(monkeypatch):
    """torch 2.11's DefaultStager closes itself at the end of each stage (pytorch#183413): a
    second async_pinned save with it failed with KeyError: <class 'type'>. The same run as
    above (four saves) with the stager behaving so resumes exactly."""
    from torch.distributed.checkpoint.staging import DefaultStager

    import dream_trainer.checkpoint_staging as checkpoint_module

    stage = DefaultStager._stage

    def closing_stage(self, state_dict, **kwargs):  # what torch 2.11 does
        staged = stage(self, state_dict, **kwargs)
        self._state_dict_stager.close()
        return staged

    monkeypatch.setattr(DefaultStager, "_stage", closing_stage)
    monkeypatch.setattr(checkpoint_module, "_REUSABLE", [])  # asked again, of the stager as patched
    assert not checkpoint_module.stager_reusable()
    full, _ = run(root_dir="full", async_mode="async_pinned", every_n_steps=5)
    first, saver = run(async_mode="async_pinned", every_n_steps=5, max_steps=12)
    second, loader = run(async_mode="async_pinned", every_n_steps=5)
    assert len(saver.saved) == 3 and loader.resumed_from == saver.saved[-1]  # steps 5, 10 and 12
    assert losses(first) + losses(second) == losses(full)


def test_callback_state_survives_resume():
    counter = Counter()
    run(max_steps=5, callbacks=[counter])
    assert counter.count == 5
    resumed = Counter()
    run(callbacks=[resumed])
    assert resumed.count == 24  # 5 restored + 19 more


class ValScores(Callback):
    def __init__(self):
        self.scores = {}

    def on_log(self, metrics, step):
        if "val/loss" in metrics:
            self.scores[step] = metrics["val/loss"]


def test_keep_last_and_best():
    scores = ValScores()
    _, cb = run(callbacks=[scores], every_n_steps=2, keep_last=2, monitor="val/loss", keep_best=1, mode="min")
    infos = list_checkpoints(cb.root)
    assert [i.step for i in infos][-2:] == [22, 24] and len(infos) <= 3
    best_step = min(scores.scores, key=scores.scores.get)  # validation every 4 steps
    best = [i for i in infos if i.step == best_step]
    assert best and best[0].score == pytest.approx(scores.scores[best_step])
    _, again = run(resume_mode="best", monitor="val/loss", every_n_steps=2)
    assert again.resumed_from == best[0].path


def test_pruning_rules():
    infos = [CheckpointInfo(path=f"p{s}", step=s, epoch=0, score=sc) for s, sc in [(1, 0.5), (2, 0.1), (3, 0.9), (4, None)]]
    removed = lambda **kw: [i.step for i in to_remove(infos, **kw)]  # noqa: E731
    assert removed(keep_last=2, keep_best=1, mode="min", monitor=None) == [1, 2]
    assert removed(keep_last=1, keep_best=1, mode="min", monitor="m") == [1, 3]
    assert removed(keep_last=1, keep_best=2, mode="max", monitor="m") == [2]
    assert removed(keep_last=None, keep_best=1, mode="min", monitor=None) == []
    assert removed(keep_last=1, keep_best=1, mode="min", monitor=None) == [1, 2, 3]  # never the newest


def test_preemption_saves_at_the_step_boundary_and_resumes():
    class Terminate(Callback):
        def pre_train_step(self, batch, batch_idx):
            if self.trainer.global_step == 5:
                os.kill(os.getpid(), signal.SIGTERM)

    full, _ = run(root_dir="full")
    first, saver = run(callbacks=[Terminate()], every_n_steps=None, every_n_epochs=None, at_fit_end=False)
    assert first.status == "preempted" and first.exit_code == EXIT_PREEMPTED
    assert [p.name for p in saver.saved] == ["step_000000006"]
    second, loader = run()
    assert loader.resumed_from == saver.saved[0] and second.status == "completed"
    assert losses(first) + losses(second) == losses(full)


def test_incomplete_checkpoints_are_ignored_and_removed(caplog):
    run(max_steps=5, every_n_steps=2)  # step_2, step_4, step_5
    root = os.path.abspath(ROOT)
    os.rename(os.path.join(root, "step_000000005"), os.path.join(root, ".staging-step_000000005"))
    os.makedirs(os.path.join(root, "step_000000009"))  # no metadata: not a checkpoint
    with caplog.at_level(logging.WARNING):
        _, cb = run(max_steps=6)
    assert cb.resumed_from.name == "step_000000004"
    assert not os.path.exists(os.path.join(root, ".staging-step_000000005"))
    assert "removed incomplete checkpoint" in caplog.text


def test_bad_checkpoints_fail_with_the_path_and_key(caplog):
    with pytest.raises(CheckpointError, match=r"resume_mode='nowhere'.*no checkpoint at"):
        run(resume_mode="nowhere")
    _, saver = run(max_steps=2)
    path = saver.saved[-1]
    # other model shapes: the first mismatched key, then strict=False skips with a warning
    with pytest.raises(CheckpointError, match=rf"{path}.*first mismatched key: 'models\.model\.0\.weight' has shape \(16, 8\) in the checkpoint, \(32, 8\)"):
        run(hidden=32, resume_mode=str(path))
    with caplog.at_level(logging.WARNING):
        trainer, cb = run(hidden=32, resume_mode=str(path), strict=False, max_steps=3, at_fit_end=False)
    assert cb.resumed_from == path and trainer.global_step == 3
    assert "skipped" in caplog.text and "models.model.0.weight" in caplog.text
    # a truncated data file
    data = max((f for f in os.listdir(path) if f.endswith(".distcp")), key=lambda f: os.path.getsize(path / f))
    with open(path / data, "r+b") as handle:
        handle.truncate(os.path.getsize(path / data) // 2)
    with pytest.raises(CheckpointError, match=rf"cannot load checkpoint {path}: it is damaged: __0_0\.distcp: truncated"):
        run(resume_mode=str(path))  # found by the verification against the manifest, before loading
    with pytest.raises(CheckpointError, match=rf"cannot load checkpoint {path}"):
        run(resume_mode=str(path), verify="off")  # found by DCP's load
    # damaged metadata
    (path / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match=rf"cannot load checkpoint {path}: it is damaged: \.metadata: truncated"):
        run(resume_mode=str(path))
    with pytest.raises(CheckpointError, match=rf"cannot read checkpoint {path}"):
        run(resume_mode=str(path), verify="off")


def test_optimizer_state_keyed_by_index_names_what_strict_false_loses(monkeypatch):
    """A checkpoint whose optimizer state is keyed by parameter index (what an FSDP2 run left
    unsharded by a validation used to save) is refused, and the error says that
    ``strict=False`` would drop the optimizer state, instead of advising it."""
    def with_momentum(self):
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.lr, momentum=0.9)  # state per parameter

    monkeypatch.setattr(ToyTrainer, "configure_optimizers", with_momentum)
    with monkeypatch.context() as patch:
        patch.setattr(ToyTrainer, "model_for", lambda self, optimizer: None)  # no model found: saved by index
        _, saver = run(max_steps=2)
    with pytest.raises(CheckpointError) as error:
        run(resume_mode=str(saver.saved[-1]))
    message = str(error.value)
    assert "'optimizers.optimizer.state.0.weight.momentum_buffer' is not in the checkpoint" in message
    assert "by parameter index, not by parameter name" in message
    assert "would drop the state of optimizer 'optimizer' for 4 tensor(s)" in message
    assert "to skip mismatched keys" not in message


def test_background_save_error_surfaces_on_the_next_step(monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    def broken(self, plan, planner):
        raise OSError("disk full (injected)")

    monkeypatch.setattr(FileSystemWriter, "write_data", broken)
    seen = []

    class When(Callback):
        def pre_train_step(self, batch, batch_idx):
            if self.trainer.global_step == 4:
                time.sleep(0.5)  # the background save fails meanwhile

        def on_interrupt(self, error):
            seen.append(self.trainer.global_step)

    with pytest.raises(CheckpointError, match="(?s)background checkpoint save to .*step_000000004 failed: rank 0: OSError: disk full"):
        run(callbacks=[When()], every_n_steps=4, async_mode="async", max_steps=10)
    assert seen == [5]  # raised at the end of the next step, not lost
    assert not list_checkpoints(ROOT)


def test_export_model_is_a_plain_state_dict(tmp_path):
    from safetensors.torch import load_file

    trainer, saver = run(max_steps=4)
    with pytest.raises(ValueError, match=r"export_model\(output='.*model\.pt'\): .*safetensors only.*'\.safetensors'"):
        export_model(saver.saved[-1], tmp_path / "model.pt")  # a pickle: refused, before any work
    assert not (tmp_path / "model.pt").exists()
    state = load_file(str(export_model(saver.saved[-1], tmp_path / "model.safetensors")))
    plain = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    plain.load_state_dict(state)  # strict: same keys, no dream_trainer needed
    x = torch.randn(5, 8)
    torch.testing.assert_close(plain(x), trainer.model(x), rtol=0, atol=0)
    with pytest.raises(CheckpointError, match=r"no model named 'ema'; it has: \['model'\]"):
        export_model(saver.saved[-1], tmp_path / "x.safetensors", model="ema")


def test_checkpoint_parameters_errors():
    for kwargs, match in [
        (dict(every_n_steps=0), r"every_n_steps=0"),
        (dict(mode="best"), r"mode='best' is invalid"),
        (dict(async_mode="yes"), r"async_mode='yes' is invalid: expected 'off', 'async' or 'async_pinned'"),
        (dict(resume_mode="best"), r"needs a monitor"),
        (dict(resume_mode=""), r"resume_mode='' is invalid"),
        (dict(keep_last=0), r"keep_last=0"),
        (dict(verify="yes"), r"verify='yes' is invalid: expected 'all', 'sampled' or 'off'"),
    ]:
        with pytest.raises(ValueError, match=match):
            CheckpointParameters(**kwargs)
    with pytest.raises(TypeError, match="takes a CheckpointParameters"):
        CheckpointCallback({"every_n_steps": 1})


class StatefulToy(ToyTrainer):
    """ToyTrainer on torchdata's StatefulDataLoader: the loader saves its own position."""

    def _loader(self, x, y):
        from torchdata.stateful_dataloader import StatefulDataLoader

        plain = super()._loader(x, y)
        if self.iterable:  # no __len__: the loop looks one batch ahead
            return StatefulDataLoader(plain.dataset, batch_size=self.batch_size)
        return StatefulDataLoader(plain.dataset, batch_size=self.batch_size, sampler=plain.sampler)


@pytest.mark.parametrize("iterable", [False, True])
def test_resume_with_a_stateful_dataloader(iterable, caplog):
    pytest.importorskip("torchdata.stateful_dataloader")

    def fit(max_steps=None, root=ROOT):
        cb = CheckpointCallback(CheckpointParameters(root_dir=root, every_n_steps=5))
        config = TrainerConfig(
            run_name="r", device_parameters=DeviceParameters.SINGLE_DEVICE(), callbacks=[cb],
            training_parameters=TrainingParameters(n_epochs=2, max_steps=max_steps, num_sanity_val_steps=0),
        )
        trainer = StatefulToy(config, shuffle=True, dropout=0.2, iterable=iterable, with_validation=False)
        trainer.fit()
        return trainer, cb

    full, _ = fit(root="full")
    first, _ = fit(max_steps=7)
    with caplog.at_level(logging.INFO, logger="dream_trainer.trainer.base"):
        second, cb = fit()
    assert cb.resumed_from.name == "step_000000007"
    assert "skipped" not in caplog.text  # the loader resumed itself: no fast-forward
    assert losses(first) + losses(second) == losses(full)

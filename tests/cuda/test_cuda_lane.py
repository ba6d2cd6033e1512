"""The cuda lane: the paths that only a GPU takes, each test's body in a fresh process that
sees the machine's GPUs (`tests.cuda_lane.on_cuda`). Skipped where there is no CUDA GPU;
``pytest -m cuda`` runs the lane alone (scripts/gpu_check.sh does)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dream_trainer import (
    Callback,
    CheckpointCallback,
    CheckpointParameters,
    DeviceParameters,
    DreamTrainer,
    TrainerConfig,
    TrainingParameters,
)
from dream_trainer.testing import ToyTrainer
from tests.cuda_lane import gpu_count, on_cuda
from tests.demos import load

pytestmark = pytest.mark.cuda

# The demo, small, on the GPU: 40 steps (of an epoch of 87), logs/validation/checkpoint every 20.
# Checkpoints are written in the step that saves them (not async): sync-debug mode is global to
# the process, and DCP's writer thread synchronizes its own copy stream while the next steps
# run (seen on an H200: harmless to the training thread, but it would trip the check).
DEMO = ["--n-chars", "200000", "--d-model", "64", "--n-layer", "2", "--n-head", "4", "--block-size", "64",
        "--warmup", "2", "--steps", "40", "--log-every", "20", "--val-every", "20", "--checkpoint-every", "20",
        "--async-checkpoint", "off", "--val-batches", "2", "--resume", "None"]


class NoSyncBetweenLogs(Callback[Any]):
    """Puts CUDA into sync-debug "error" mode for the optimizer steps that neither log,
    validate nor checkpoint (from step 3: the first steps warm up), from the step's begin
    (its batch's copy to the GPU included) to its end: any host-device sync there raises."""

    def __init__(self, every: int):
        self.every, self.quiet_steps = every, 0

    def on_step_begin(self, step: int) -> None:
        if step > 2 and step % self.every != 0:
            torch.cuda.set_sync_debug_mode("error")
            self.quiet_steps += 1

    def on_step_end(self, step: int) -> None:
        torch.cuda.set_sync_debug_mode("default")


class StepLosses(Callback[Any]):
    """Each optimizer step's loss (this rank's), kept on the device and read when fit ends:
    recording it costs no host-device sync."""

    def __init__(self) -> None:
        self.kept: dict[int, torch.Tensor] = {}
        self.losses: dict[int, float] = {}

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        if not self.trainer.is_accumulating_gradients:
            self.kept[self.trainer.global_step] = result["loss"].detach()

    def post_fit(self) -> None:
        self.losses = {step: float(loss) for step, loss in self.kept.items()}


def _demo(argv: list[str]) -> dict[str, Any]:
    record, guard = StepLosses(), NoSyncBetweenLogs(every=20)
    trainer = load("gpt").main(argv, callbacks=[record, guard])
    assert trainer.status == "completed" and trainer.world.device.type == "cuda"
    transfer = trainer.world.transfer
    return {"losses": record.losses, "quiet_steps": guard.quiet_steps, "copies": transfer.copies,
            "pageable_bytes": transfer.pageable_bytes, "fused": [g["fused"] for g in trainer.optimizer.param_groups],
            "compiled": {name: c.options for name, c in trainer.compiled_modules.items()}, "checkpoints": sorted(p.name for p in
                                                                              (trainer.run_dir / "checkpoints").iterdir())}


def test_the_demo_trains_on_cuda_with_pinned_batches_fused_adamw_and_no_host_sync_between_logs():
    (run,) = on_cuda(_demo, [*DEMO, "--root-dir", "eager"])
    losses = run["losses"]
    assert losses[40] < 0.8 * losses[1], losses  # it learns
    assert run["quiet_steps"] == 36  # steps 3..39 but 20: no host-device sync in any of them
    assert run["copies"] >= 80 and run["pageable_bytes"] == 0  # every batch arrived pinned
    assert run["fused"] == [True, True]  # AdamW built without fused/foreach runs fused on CUDA
    assert run["checkpoints"] == ["step_000000020", "step_000000040"] and run["compiled"] == {}


def test_the_compiled_demo_on_cuda_trains_like_the_eager_one():
    eager, compiled = (on_cuda(_demo, [*DEMO, "--root-dir", name, *flags])[0]
                       for name, flags in (("eager", []), ("compiled", ["--compile"])))
    assert compiled["compiled"] == {"model": {"mode": "reduce-overhead"}}  # one GPU: the region as CUDA graphs
    assert compiled["quiet_steps"] == 36
    first = torch.tensor([eager["losses"][1], compiled["losses"][1]])
    assert torch.allclose(first[0], first[1], rtol=1e-3), first  # the same weights and batch
    assert compiled["losses"][40] < 0.8 * compiled["losses"][1]
    assert abs(compiled["losses"][40] - eager["losses"][40]) < 0.05 * eager["losses"][40]


# ------------------------------------------------------------------ checkpoints
def _toy(root: str, async_mode: str, **training: Any) -> tuple[list[float], Any]:
    cb = CheckpointCallback(CheckpointParameters(root_dir="ckpt", every_n_steps=5, async_mode=async_mode))
    config = TrainerConfig(root_dir=root, run_name="r", device_parameters=DeviceParameters.SINGLE_DEVICE(),
                           training_parameters=TrainingParameters(n_epochs=2, val_every_n_steps=4, num_sanity_val_steps=1,
                                                                  **training),
                           callbacks=[cb])
    trainer = ToyTrainer(config, shuffle=True, dropout=0.2, hidden=16)
    trainer.fit()
    assert trainer.world.device.type == "cuda"
    return [x.item() for x in trainer.step_losses], cb


def _resume_async_pinned() -> dict[str, Any]:
    full, _ = _toy("full", "async_pinned")
    Path("ckpt").rename("ckpt_full")
    first, saver = _toy("cut", "async_pinned", max_steps=12)
    second, loader = _toy("cut", "async_pinned")
    return {"full": full, "resumed": first + second, "saves": len(saver.saved), "from": str(loader.resumed_from)}


def test_async_pinned_checkpoints_save_repeatedly_and_resume_exactly_on_cuda():
    (out,) = on_cuda(_resume_async_pinned)
    assert out["saves"] >= 2  # the stager is used again after its first save
    assert out["from"].endswith("step_000000012")
    assert out["resumed"] == out["full"]  # bitwise, step by step


# ------------------------------------------------------------------ profiler and memory
def _profile() -> dict[str, Any]:
    from dream_trainer.callbacks import ProfileCallback

    profiler = ProfileCallback(wait=1, warmup=1, active=2, profile_memory=True, with_stack=True, output_dir="prof")
    config = TrainerConfig(root_dir="runs", device_parameters=DeviceParameters.SINGLE_DEVICE(),
                           training_parameters=TrainingParameters(n_epochs=1, num_sanity_val_steps=0),
                           callbacks=[profiler])
    ToyTrainer(config, hidden=64).fit()
    names = sorted(p.name.split(".")[0] for p in profiler.exported)
    table = next(p for p in profiler.exported if p.name.startswith("key_averages")).read_text()
    return {"names": names, "header": table.splitlines()[1], "sizes": [p.stat().st_size for p in profiler.exported]}


def test_the_profiler_exports_its_table_stacks_trace_and_memory_timeline_on_cuda():
    (out,) = on_cuda(_profile)
    assert out["names"] == ["key_averages", "memory_timeline", "rank0", "stacks"], out
    assert "CUDA" in out["header"] or "Device" in out["header"], out["header"]  # sorted by device time
    assert min(out["sizes"]) > 0


def _memory() -> None:
    from dream_trainer.world import DistributedWorld

    mb = 2**20
    world = DistributedWorld()
    device = torch.device("cuda", torch.cuda.current_device())
    world.reset_peak_memory()
    before = world.memory_status(device)
    block = torch.empty(256 * mb, dtype=torch.uint8, device=device)
    during = world.memory_status(device)
    assert during.allocated - before.allocated == 256 * mb == torch.cuda.memory_allocated(device) - before.allocated
    assert world.memory_allocated() == during.allocated  # the monitor's frequent sample: the same counter
    assert during.reserved >= during.allocated and during.peak_allocated >= during.allocated
    assert during.total == torch.cuda.get_device_properties(device).total_memory and during.rss > 0
    del block
    after = world.memory_status(device)
    assert after.allocated == before.allocated and after.peak_allocated == during.peak_allocated
    world.reset_peak_memory()
    assert world.memory_status(device).peak_allocated < during.peak_allocated


def test_memory_status_on_cuda_is_the_allocators():
    on_cuda(_memory)


def _anomaly_skip(root: str, device_type: str = "cuda") -> dict[str, Any]:
    """A NaN batch under the anomaly detector's skip policy, the memory monitor sampling every
    step: the update is skipped on the device's flag, read once a step (at the trainer's
    agreement), and nothing else reads the device on a step."""
    from dream_trainer.callbacks import AnomalyDetectorCallback, MemoryMonitorCallback
    from dream_trainer.testing import HostReadCounter, StepReads

    class NaNAt(ToyTrainer):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            if self.current_epoch == 0 and batch_idx == 5:
                x = x * float("nan")
            return super().training_step((x, y), batch_idx)

    detector, memory = AnomalyDetectorCallback("skip"), MemoryMonitorCallback(log_interval=1000, sample_every=1)
    counter = HostReadCounter(device=device_type)
    reads = StepReads(counter)
    cfg = TrainerConfig(root_dir=root, run_name="anomaly", device_parameters=DeviceParameters.SINGLE_DEVICE(),
                        training_parameters=TrainingParameters(n_epochs=1, num_sanity_val_steps=0,
                                                               validate_at_epoch_end=False),
                        callbacks=[detector, memory, reads])
    trainer = NaNAt(cfg, with_validation=False)
    with counter:
        trainer.fit()
    return {"device": next(trainer.model.parameters()).device.type, "skipped": detector.skipped_steps,
            "events": detector.events, "steps": trainer.global_step, "samples": len(memory.samples),
            "finite": all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters()),
            "reads": {s: reads.kinds(s) for s in range(1, trainer.global_step)}}  # the last step: the epoch's end


def check_anomaly_skip(result: dict[str, Any], device_type: str) -> None:
    assert result["device"] == device_type and result["finite"]
    steps = result["steps"]  # the epoch's batches less the skipped one
    assert result["skipped"] == 1 and result["events"] == [(6, 5)] and steps >= 10
    assert result["samples"] == 10  # the leak window, sampled every step (world.memory_allocated)
    flag = [("bool", "take_veto")]  # one read a step; step 6 ran twice (skipped, then taken)
    assert result["reads"] == {s: flag * (2 if s == 6 else 1) for s in range(1, steps)}, result["reads"]


def test_the_anomaly_detector_skips_on_its_device_flag_with_one_read_a_step_on_cuda(tmp_path: Path) -> None:
    [result] = on_cuda(_anomaly_skip, str(tmp_path))
    check_anomaly_skip(result, "cuda")


# ------------------------------------------------------------------ the device path
def _transfer_and_fused() -> dict[str, Any]:
    from dream_trainer.trainer.fused import prefer_fused
    from dream_trainer.world.transfer import BatchTransfer

    transfer = BatchTransfer()
    transfer.start(torch.device("cuda", 0))
    pinned = {"x": torch.arange(12.0).reshape(3, 4).pin_memory(), "ids": [torch.arange(5).pin_memory(), 7]}
    moved = transfer(pinned)
    same = torch.equal(moved["x"].cpu(), pinned["x"]) and torch.equal(moved["ids"][0].cpu(), pinned["ids"][0])
    pinned_only = transfer.pageable_bytes
    transfer({"big": torch.zeros(2**19)})  # 2 MB of pageable memory: copied, and warned about once
    results = {}
    for fused in (True, False):
        torch.manual_seed(0)
        model = nn.Linear(64, 64, device="cuda")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        results[fused] = prefer_fused(opt) if fused else False
        for _ in range(3):
            model(torch.ones(8, 64, device="cuda")).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        results[f"weight_{fused}"] = model.weight.detach().cpu()
    chosen = torch.optim.AdamW(nn.Linear(4, 4, device="cuda").parameters(), foreach=True)
    return {"same": same, "structure": moved["ids"][1], "pinned_only": pinned_only, "pageable": transfer.pageable_bytes,
            "warned": transfer._warned, "fused": results[True], "kept_choice": prefer_fused(chosen),
            "close": torch.allclose(results["weight_True"], results["weight_False"], atol=1e-6)}


def test_batches_cross_on_a_side_stream_and_optimizers_run_fused_on_cuda():
    (out,) = on_cuda(_transfer_and_fused)
    assert out["same"] and out["structure"] == 7 and out["pinned_only"] == 0
    assert out["pageable"] == 2**21 and out["warned"]
    assert out["fused"] and not out["kept_choice"] and out["close"]


# ------------------------------------------------------------------ float8
class _Linears(DreamTrainer):
    def configure_models(self) -> None:
        self.model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256), nn.GELU(), nn.Linear(256, 16))

    def apply_compile(self) -> None:
        self.compile_module(self.model)

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def configure_dataloaders(self) -> tuple[Any, None]:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(512, 256, generator=g)
        return [(x[i:i + 128], x[i:i + 128, :16]) for i in range(0, 512, 128)] * 5, None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        loss = nn.functional.mse_loss(self.model(x).float(), y)
        self.backward(loss)
        self.step(self.optimizer)
        return {"loss": loss}


def _float8(compiled: bool) -> dict[str, Any]:
    from dream_trainer.callbacks import Fp8QuantizationCallback

    logging.getLogger("dream_trainer.callbacks.fp8").setLevel(logging.ERROR)  # in this lane process only

    fp8, record = Fp8QuantizationCallback("tensorwise", display=False), _Losses()
    config = TrainerConfig(root_dir="runs", device_parameters=DeviceParameters.SINGLE_DEVICE(
        compile_model=compiled, autocast_dtype=torch.bfloat16),
        training_parameters=TrainingParameters(n_epochs=1, num_sanity_val_steps=0), callbacks=[fp8, record])
    _Linears(config).fit()
    return {"native": fp8.hardware.native, "converted": fp8.converted["model"], "losses": record.losses}


class _Losses(Callback[Any]):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        self.losses.append(float(result["loss"]))


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability(0)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_float8_runs_native_on_a_float8_gpu(compiled):
    (capability,) = on_cuda(_capability)
    if capability < (8, 9):
        pytest.skip(f"compute capability {capability}: no native float8 matmul (needs 8.9+)")
    (out,) = on_cuda(_float8, compiled)
    assert out["native"] and out["converted"] == ["0", "2"]  # the head (16 wide) stays high precision
    losses = out["losses"]
    assert all(torch.isfinite(torch.tensor(losses))) and sum(losses[-4:]) < sum(losses[:4])


# ------------------------------------------------------------------ NCCL (2+ GPUs)
def _nccl_demo(parallel: str) -> dict[int, float]:
    record = StepLosses()
    load("gpt").main([*DEMO, "--steps", "10", "--parallel", parallel, "--root-dir", "runs", "--checkpoint-every",
                      "None"], callbacks=[record])
    return record.losses


def _needs_two_gpus() -> None:
    if gpu_count() < 2:  # at run time, in the test process: lane processes import this module too
        pytest.skip("NCCL needs 2 CUDA GPUs")


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_nccl_data_parallel_tracks_one_gpu(parallel):
    _needs_two_gpus()
    (single,) = on_cuda(_nccl_demo, "single")
    ranks = on_cuda(_nccl_demo, parallel, world_size=2)
    for step in range(1, 11):  # each rank's half of the global batch: their mean is one GPU's loss
        assert abs((ranks[0][step] + ranks[1][step]) / 2 - single[step]) <= 1e-3 * single[step], step



def _single_initial() -> dict[str, Any]:
    from tests.distributed.test_weight_init import _initial

    return {example: _initial(example, "single", "single") for example in ("gpt", "llama")}


def test_nccl_layouts_start_from_the_single_process_weights():
    _needs_two_gpus()
    from tests.distributed.test_weight_init import LAYOUTS_2, _check, _ranks

    (reference,) = on_cuda(_single_initial)
    _check(on_cuda(_ranks, LAYOUTS_2, "nccl", world_size=2), LAYOUTS_2, reference)

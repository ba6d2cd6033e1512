"""`ProfileCallback`: ``torch.profiler`` over a window of optimizer steps, exported for
Perfetto/Chrome, TensorBoard, a key-averages table and flame graphs; then stopped."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from dream_trainer.protocol.base import Callback
from dream_trainer.protocol.trainers import Accumulates, Counters, InWorld, RunDirectory, Stops

logger = logging.getLogger(__name__)

TABLE_METRIC = {"cpu": "self_cpu_time_total", "cuda": "self_cuda_time_total"}
"""What the ops table and the folded stacks are sorted by: the names every torch since 2.0
accepts for both (``export_stacks`` takes only these; ``table`` maps "cuda" to the device's
own name), so the CUDA export works on torch 2.11 as on 2.13."""


@runtime_checkable
class ProfiledTrainer(Accumulates, Counters, InWorld, RunDirectory, Stops, Protocol):
    """What `ProfileCallback` needs of a trainer (any trainer with these pieces)."""


class ProfileCallback(Callback[ProfiledTrainer]):
    """Profile a window of optimizer steps, export what was recorded, stop the profiler.

    The profiler starts at the first training step and is stepped once per optimizer step
    (not per micro-batch). Its schedule is ``skip_first`` steps, then `repeat` cycles of
    `wait` + `warmup` + `active` steps; each cycle's `active` steps are recorded and
    exported when the cycle ends, into ``output_dir`` (default ``<run_dir>/profile``), per
    rank:

    - ``rank<R>.step<N>.pt.trace.json``: the trace, for Perfetto (ui.perfetto.dev),
      ``chrome://tracing`` and TensorBoard's profiler plugin (the file name is its format);
    - ``key_averages.rank<R>.step<N>.txt``: the ops table, sorted by self CPU time on CPU
      and self device time on CUDA;
    - ``stacks.rank<R>.step<N>.txt`` (with ``with_stack``): folded stacks for a flame graph
      (``flamegraph.pl``, speedscope);
    - on CUDA, ``memory_timeline.rank<R>.step<N>.html`` (with ``profile_memory``) and, with
      ``memory_snapshot=True``, ``memory_snapshot.rank<R>.pickle`` for
      pytorch.org/memory_viz.

    When the last cycle is exported the profiler is stopped and released, so a long run
    does not keep growing memory; training goes on, or ends with `StopTraining` when
    ``stop_training=True``. The profiler is stopped on every other path too (`on_teardown`).
    Pass your own ``torch.profiler.profile`` as `profiler` to choose everything yourself:
    give it a finite ``schedule`` (with ``repeat`` > 0). Its ``on_trace_ready`` (e.g.
    ``tensorboard_trace_handler(dir)``) still runs every cycle, and the callback writes its
    table after it (and stacks / memory timeline where that profiler records them). torch
    saves a cycle's trace only once, so a trace your handler saves is that cycle's trace
    (listed in `exported`) and the callback writes its own ``.pt.trace.json`` only when your
    handler saved none; this is logged once, when profiling starts. Not critical: a failing
    export is logged, never stops training.

    Attributes:
        exported: the files written, in order.
        output_dir: where they go (known once profiling starts).
    """

    critical = False

    def __init__(
        self,
        profiler: torch.profiler.profile | None = None,
        *,
        wait: int = 1,
        warmup: int = 1,
        active: int = 3,
        repeat: int = 1,
        skip_first: int = 0,
        output_dir: str | Path | None = None,
        record_shapes: bool = True,
        profile_memory: bool = False,
        with_stack: bool = True,
        memory_snapshot: bool = False,
        row_limit: int = 40,
        stop_training: bool = False,
    ):
        for name, value, lowest in (("wait", wait, 0), ("warmup", warmup, 0), ("active", active, 1),
                                    ("repeat", repeat, 1), ("skip_first", skip_first, 0), ("row_limit", row_limit, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
                raise ValueError(f"ProfileCallback({name}={value!r}) is invalid: expected an int >= {lowest}")
        if profiler is not None and not isinstance(profiler, torch.profiler.profile):
            raise TypeError(f"ProfileCallback(profiler=...) takes a torch.profiler.profile, got {type(profiler).__name__}")
        if profiler is not None and not _schedule_length(profiler):
            raise ValueError(
                "ProfileCallback(profiler=...): its schedule never ends (no schedule, or repeat=0); give it "
                "torch.profiler.schedule(wait=..., warmup=..., active=..., repeat=N) with N >= 1"
            )
        self.with_stack, self.profile_memory, self.record_shapes = with_stack, profile_memory, record_shapes
        self.memory_snapshot, self.row_limit, self.stop_training = memory_snapshot, row_limit, stop_training
        self.output_dir: Path | None = Path(output_dir) if output_dir is not None else None
        self.exported: list[Path] = []
        self._schedule = (wait, warmup, active, repeat, skip_first)
        self._profiler = profiler
        self._user_given = profiler is not None
        self._user_ready: Callable[..., Any] | None = None
        self._steps = 0
        self._total_steps = skip_first + repeat * (wait + warmup + active)
        self._running = False
        self._done = False

    # ------------------------------------------------------------------ lifecycle
    def pre_train_step(self, batch: Any, batch_idx: int) -> None:
        if not self._running and not self._done:
            self._start()

    def post_train_step(self, result: dict[str, Any], batch_idx: int) -> None:
        if not self._running or self.trainer.is_accumulating_gradients:
            return
        self._steps += 1
        self._profiler.step()  # type: ignore[union-attr]
        if self._steps >= self._total_steps:
            self._stop()
            logger.info("profiling done after %d steps: %d file(s) in %s", self._steps, len(self.exported), self.output_dir)
            if self.stop_training:
                self.trainer.request_stop("profiling finished")

    def on_teardown(self, status: str) -> None:
        self._stop()

    @property
    def running(self) -> bool:
        """Whether the profiler is recording (or waiting in its schedule) now."""
        return self._running

    # ------------------------------------------------------------------ profiler
    def _start(self) -> None:
        if self.output_dir is None:
            self.output_dir = Path(self.trainer.run_dir) / "profile"
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if self._profiler is None:
            from torch.profiler import ProfilerActivity, schedule

            wait, warmup, active, repeat, skip_first = self._schedule
            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available() and self.trainer.world.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(
                activities=activities,
                schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=repeat, skip_first=skip_first),
                on_trace_ready=self._export,
                record_shapes=self.record_shapes or self.profile_memory,
                profile_memory=self.profile_memory,
                with_stack=self.with_stack or self.profile_memory,
                # verbose: the Python stacks reach the exported events (else export_stacks is empty)
                experimental_config=torch._C._profiler._ExperimentalConfig(verbose=True) if self.with_stack else None,
            )
        else:
            self._take_users_profiler(self._profiler)
        if self.memory_snapshot and self._on_cuda():
            torch.cuda.memory._record_memory_history()
        self._profiler.start()
        self._running = True

    def _stop(self) -> None:
        if not self._running:
            return
        self._running, self._done = False, True
        try:
            self._profiler.stop()  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - stopping must not fail the run
            logger.exception("stopping the profiler failed")
        if self.memory_snapshot and self._on_cuda():
            path = self._path("memory_snapshot", "pickle", step=False)
            try:
                torch.cuda.memory._dump_snapshot(str(path))
                self.exported.append(path)
            finally:
                torch.cuda.memory._record_memory_history(enabled=None)
        if self._user_given:  # the user's profiler gets its own handler back
            self._profiler.on_trace_ready = self._user_ready  # type: ignore[union-attr]
        self._profiler = None  # the recorded events go with it

    def _take_users_profiler(self, prof: torch.profiler.profile) -> None:
        """Route a user's profiler through `_export`, keeping its ``on_trace_ready``."""
        self._user_ready = prof.on_trace_ready
        prof.on_trace_ready = self._export
        self._total_steps = _schedule_length(prof)  # type: ignore[assignment]  (checked in __init__)
        if self._user_ready is not None:
            logger.info(
                "ProfileCallback: the profiler passed in has its own on_trace_ready (%s); it runs every cycle and "
                "the callback writes its table%s into %s after it. torch saves a cycle's trace once, so the trace "
                "your handler saves is that cycle's trace (listed in ProfileCallback.exported): the callback writes "
                "its own rank<R>.step<N>.pt.trace.json only when your handler saved none.",
                getattr(self._user_ready, "__qualname__", type(self._user_ready).__name__),
                " and stacks" if prof.with_stack else "", self.output_dir,
            )

    def _export(self, prof: torch.profiler.profile) -> None:
        """``on_trace_ready``: the user's handler, if any, and this cycle's trace unless that
        handler saved it; then the tables (saving the trace leaves the events readable). One
        failing part does not skip the other; the first error is raised after both ran."""
        errors: list[Exception] = []
        for part in (self._export_traces, self._export_tables):
            try:
                part(prof)
            except Exception as error:  # noqa: BLE001 - raised below, after the other part
                errors.append(error)
        if errors:
            raise errors[0]

    def _export_traces(self, prof: torch.profiler.profile) -> None:
        saved: list[Path] = []
        try:
            if self._user_ready is not None:
                saved = _call_recording_traces(self._user_ready, prof)
                self.exported.extend(saved)
        finally:  # also when the user's handler failed: this cycle's trace is not lost
            if not saved:
                self._export_trace(prof)

    def _export_tables(self, prof: torch.profiler.profile) -> None:
        cuda = self._on_cuda()
        metric = TABLE_METRIC["cuda" if cuda else "cpu"]
        table = self._path("key_averages", "txt")
        table.write_text(prof.key_averages().table(sort_by=metric, row_limit=self.row_limit))
        self.exported.append(table)
        # a user's profiler decides what it records: only export what it has
        with_stack = prof.with_stack if self._user_given else self.with_stack
        if with_stack:
            stacks = self._path("stacks", "txt")
            prof.export_stacks(str(stacks), metric=metric)
            self.exported.append(stacks)
        if cuda and prof.profile_memory and prof.record_shapes and prof.with_stack:  # what the timeline needs
            timeline = self._path("memory_timeline", "html")
            prof.export_memory_timeline(str(timeline), device=str(self.trainer.world.device))
            self.exported.append(timeline)

    def _export_trace(self, prof: torch.profiler.profile) -> None:
        trace = self._path("", "pt.trace.json")
        try:
            prof.export_chrome_trace(str(trace))
        except RuntimeError as error:
            if "already saved" not in str(error):
                raise
            # the user's handler saved it without going through prof.export_chrome_trace
            logger.debug("this cycle's trace was saved by the profiler's own on_trace_ready: %s", error)
            return
        self.exported.append(trace)

    def _on_cuda(self) -> bool:
        return torch.cuda.is_available() and self.trainer.world.device.type == "cuda"

    def _path(self, kind: str, suffix: str, step: bool = True) -> Path:
        assert self.output_dir is not None
        name = f"rank{self.trainer.world.rank}" + (f".step{self.trainer.global_step}" if step else "")
        return self.output_dir / (f"{kind}.{name}.{suffix}" if kind else f"{name}.{suffix}")


def _call_recording_traces(handler: Callable[..., Any], prof: torch.profiler.profile) -> list[Path]:
    """Call a user's ``on_trace_ready`` and return the trace files it exported (through
    ``prof.export_chrome_trace``, as torch's handlers do)."""
    saved: list[Path] = []
    export = prof.export_chrome_trace

    def recording(path: str, *args: Any, **kwargs: Any) -> Any:
        result = export(path, *args, **kwargs)
        saved.append(Path(path))
        return result

    prof.export_chrome_trace = recording  # type: ignore[method-assign]  (this instance, this call only)
    try:
        handler(prof)
    finally:
        del prof.export_chrome_trace  # the class's method again
    return saved


def _schedule_length(profiler: torch.profiler.profile) -> int | None:
    """How many ``step()`` calls a profiler's schedule needs to record and export everything
    (None: it records without end within 20,000 steps)."""
    from torch.profiler import ProfilerAction

    fn = profiler.schedule
    last = -1
    for step in range(20_000):
        if fn(step) != ProfilerAction.NONE:
            last = step
        elif step - last > 1_000:
            return last + 1
    return None

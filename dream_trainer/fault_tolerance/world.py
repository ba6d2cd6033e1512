"""`FaultTolerantWorld`: a `DistributedWorld` whose data-parallel replicas are torchft
replica groups that may leave and join while training goes on.

Inside a group everything is the ordinary world (its ranks, its mesh: FSDP2 over
``dp_shard``, TP, DDP over an in-group ``dp_replicate``). Across groups the replicate
dimension is torchft's: a `Manager` per rank, a lighthouse that forms a quorum of the live
groups before every optimizer step, gradients averaged over the quorum's participants, and
the step applied only when the quorum commits it. Per step:

1. `before_batch` (first micro-batch, before its data is fetched): the quorum. It is
   synchronous: a group that is behind (new, restarted, or one that missed a commit) heals
   here, from a live peer, while its own main thread waits (never during a backward pass).
2. the gradients averaged across the groups (this rank's local shards: FSDP2/TP layouts
   match across groups), in buckets started during the last micro-batch's backward as their
   gradients become ready (`GradientBuckets`); `sync_gradients` (in ``trainer.step``, before
   clipping) starts the rest and waits. A peer that dies mid-collective is an error reported
   to the Manager, never raised, and logged as one warning line.
3. `agree_on_step`: torchft's commit vote. Not committed (a peer died, too few groups, a
   veto of this group's trainer): the trainer skips the step (no update, gradients dropped).

torchft is imported only when a fault-tolerant world is made (``pip install torchft``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from dream_trainer.configs import DeviceParameters, FaultToleranceParameters
from dream_trainer.errors import FaultToleranceError
from dream_trainer.fault_tolerance.addresses import (
    check_heartbeat,
    check_lighthouse,
    host_port,
    lighthouse_address,
    resolve_hostname,
)
from dream_trainer.fault_tolerance.gradients import GradientBuckets
from dream_trainer.fault_tolerance.history import group_roots
from dream_trainer.world.world import DistributedWorld, _env_int

logger = logging.getLogger(__name__)

_HANDLED = ("got exception waiting for work", "got exception in future", "got exception in all reduce", "got exception in pg configure")


def _refused_heal(record: logging.LogRecord) -> bool:
    """A record of torchft's for a heal refused as unsafe or damaged (the world raises it)."""
    from dream_trainer.checkpoint import CheckpointError

    return "got exception in recovery" in record.getMessage() and record.exc_info is not None and \
        isinstance(record.exc_info[1], CheckpointError)


class _DropNoise(logging.Filter):
    """torchft warns at every reconfiguration that it cannot reset NCCL's flight recorder
    (also on CPU, where there is none). And it logs a full traceback at ERROR for a failed
    collective of a dream_trainer group, which it reports to its Manager: the world handles
    that error (the step is not committed) and logs it as one warning line; the traceback
    goes to this module's logger at DEBUG. So does its traceback of a refused heal, which
    the world raises (`FaultTolerantWorld.begin_step`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "flight recorder" in message:
            return False
        if message.startswith("[dream_trainer_") and (any(h in message for h in _HANDLED) or _refused_heal(record)):
            logger.debug("torchft: %s", message, exc_info=record.exc_info)
            return False
        return True


def quiet_torchft() -> None:
    """torchft's Rust side logs every quorum at info level: warnings only, unless the user
    set ``RUST_LOG``. Call before its servers start. Also drops two messages that say
    nothing on this path (see `_DropNoise`; a heal's read-only receive buffer)."""
    os.environ.setdefault("RUST_LOG", "warn")
    manager_logger = logging.getLogger("torchft.manager")
    if not any(isinstance(f, _DropNoise) for f in manager_logger.filters):
        manager_logger.addFilter(_DropNoise())
    warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
    warnings.filterwarnings("ignore", message="The 'warn' method is deprecated", category=DeprecationWarning,
                            module="torchft")


def _one_line(exc: BaseException) -> str:
    """An error as one short line: gloo's source location and advice dropped."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = re.sub(r"^\[[^\]]*:\d+\] ", "", text).split(" This is typically caused")[0]
    return f"{type(exc).__name__}: {text[:200]}"


def _group_id(params: FaultToleranceParameters) -> int:
    if params.replica_group_id is not None:
        return params.replica_group_id
    if "REPLICA_GROUP_ID" not in os.environ:
        raise FaultToleranceError(
            "no replica group id: set FaultToleranceParameters(replica_group_id=N) or REPLICA_GROUP_ID "
            "(distinct per group, the same when a group restarts)"
        )
    group = _env_int("REPLICA_GROUP_ID", -1)  # not an int: a ValueError naming the variable
    if group < 0:
        raise FaultToleranceError(f"REPLICA_GROUP_ID={group} is invalid: expected an int >= 0")
    return group


class FaultTolerantWorld(DistributedWorld):
    """A `DistributedWorld` for one torchft replica group (see the module docstring).

    Attributes:
        group_id: this replica group's id.
        manager: the torchft ``Manager`` (after `launch`).
        participants: groups taking part in the current step (1 when alone).
        replica_rank: this group's rank among them.
        replica_losses: groups lost since the start (a participant missing from the next quorum).
        on_event: called with each event, a dict with ``event`` (``"quorum"``, ``"heal"``,
            ``"heal_sent"``, ``"not_committed"``, ``"replica_lost"``), ``step``, ``time`` and
            details (`FaultToleranceCallback` writes them to ``fault_tolerance.jsonl``);
            ``heal_sent`` comes from torchft's quorum thread.
        progress: what this run's files say about the steps taken before this process
            started, ``(committed, finished, where)``: the most committed steps recorded,
            the step at which a group finished the run (None: none did) and where that was
            read. Set by `FaultToleranceCallback` before training; the first quorum checks
            this group against it (`dream_trainer.fault_tolerance.history.check_progress`).
        gradients: the bucketed cross-group gradient all-reduce (after `launch`).
        bind_host, addresses: the address this rank's servers listen on, and their URLs (``heal``; ``manager``
            on group rank 0), after `launch` (`ft_transport`).
    """

    announces_batches = True
    bucket_mb = 25.0
    """The size of a bucket of the cross-group gradient all-reduce (`GradientBuckets`)."""

    def __init__(self, device_parameters: DeviceParameters | None, params: FaultToleranceParameters):
        if not isinstance(params, FaultToleranceParameters):
            raise TypeError(f"FaultTolerantWorld takes a FaultToleranceParameters, got {type(params).__name__}")
        super().__init__(device_parameters)
        self.ft = params
        self.group_id = _group_id(params)
        self.run_subdirectory, self.checkpoint_interval = f"replica_group_{self.group_id}", params.checkpoint_interval
        self.lighthouse = lighthouse_address(params)
        check_heartbeat(params, self.lighthouse)
        self.hostname = resolve_hostname(params.hostname, self.lighthouse)
        self.bind_host: str | None = None
        self.addresses: dict[str, str] = {}
        self.manager: Any = None
        self.participants = 0
        self.replica_rank: int | None = None
        self.replica_losses = 0
        self.on_event: Callable[[dict[str, Any]], None] | None = None
        self._store: Any = None
        self._replica_pg: Any = None  # the process group across groups (torchft reconfigures it per quorum)
        self._state_fns: tuple[Callable[[], Any], Callable[[Any], None], Callable[[], list[Any]]] | None = None
        self._step_open = False
        self._attempt = 0  # steps begun in this process
        self._micro = 0
        self._token = 0  # committed steps when the current step began
        self._in_quorum = False
        self._healed_s: float | None = None
        self._failure: tuple[int, str] | None = None  # (step, error) of a step an error kept from committing
        self.progress: tuple[int, int | None, str] | None = None
        self.gradients: Any = None  # a GradientBuckets
        self._accumulating: Callable[[], bool] | None = None

    # ------------------------------------------------------------------ launch
    def launch(self) -> None:
        """Check the lighthouse (fail fast), launch the in-group world, start the Manager."""
        if self.launched:
            return
        check_lighthouse(self.lighthouse, self.ft.connect_timeout_s)
        super().launch()
        try:
            self._start_manager()
        except BaseException:
            self.teardown(abort=True)
            raise

    def _start_manager(self) -> None:
        quiet_torchft()
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        from dream_trainer.fault_tolerance.transport import HealTransport, bound_store, listen_address, manager_bound_to

        params, timeout = self.ft, timedelta(seconds=self.ft.timeout_s)
        self.bind_host, self.hostname = listen_address(self.hostname, host_port(self.lighthouse)[0])
        if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            store_addr, store_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        else:  # one process without a launcher: its own store, reachable by peers (only there)
            self._store = bound_store(self.bind_host, self.hostname)
            store_addr, store_port = self.hostname, self._store.port
        transport = HealTransport(timeout, host=self.bind_host, advertised=self.hostname)
        pg = ProcessGroupNCCL(timeout=timeout) if self.device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        self._replica_pg = pg
        try:
            with manager_bound_to(self.bind_host) if self.rank == 0 else contextlib.nullcontext():  # its server
                self.manager = Manager(
                    pg=pg,
                    load_state_dict=None,
                    state_dict=None,
                    min_replica_size=params.min_replica_size,
                    use_async_quorum=False,  # heal before the step: never a state_dict() during a backward (FSDP2)
                    timeout=timeout,
                    quorum_timeout=timedelta(seconds=params.quorum_timeout_s),
                    connect_timeout=timedelta(seconds=params.connect_timeout_s),
                    rank=self.rank,
                    world_size=self.world_size,
                    store_addr=store_addr,
                    store_port=store_port,
                    lighthouse_addr=self.lighthouse,
                    replica_id=f"dream_trainer_{self.group_id}",
                    hostname=self.hostname,
                    heartbeat_interval=timedelta(seconds=params.heartbeat_interval),
                    checkpoint_transport=transport,
                    init_sync=params.init_sync,
                )
        except BaseException:
            transport.shutdown()
            raise
        server = getattr(self.manager, "_manager", None)  # group rank 0's gRPC server
        self.addresses = {"heal": transport.address(), **({"manager": server.address()} if server else {})}
        logger.debug("replica group %d rank %d listens at %s", self.group_id, self.rank, self.addresses)
        manager = self.manager
        self.gradients = GradientBuckets(lambda t: manager.allreduce(t), manager.report_error, self._final_gradients,
                                         self.bucket_mb)

    def attach(self, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None],
               parameters: Callable[[], list[Any]], accumulating: Callable[[], bool] | None = None) -> None:
        """What a heal sends and applies (the trainer's whole state) and the parameters whose
        gradients are averaged (hooked, so that their all-reduce starts during backward;
        also to release the peers of a step that ended without an update). `accumulating`:
        whether the current backward is an accumulation micro-step (its gradients are not
        final: nothing starts; None: nothing ever starts during backward)."""
        self._state_fns = (state_dict, load_state_dict, parameters)
        self.manager.register_state_dict_fn("trainer", self._load, self._save)
        self._accumulating = accumulating
        self.gradients.bind(parameters())

    def _final_gradients(self) -> bool:
        """Whether a gradient ready now is final for this step (its bucket may start)."""
        return self._step_open and self._accumulating is not None and not self._accumulating()

    def _save(self) -> Any:
        # torchft calls this in its quorum thread; the main thread waits in the quorum.
        self._event("heal_sent", main_thread_in_quorum=self._in_quorum)
        return self._state_fns[0]()  # type: ignore[index]

    def _load(self, state: Any) -> None:
        started = time.perf_counter()
        self._state_fns[1](state)  # type: ignore[index]
        self._healed_s = time.perf_counter() - started

    # ------------------------------------------------------------------ the step
    def before_batch(self, starts_step: bool) -> None:
        if not starts_step:
            self._micro += 1
            return
        if self._step_open:  # the last step ended without trainer.step (a skipped batch)
            self._release_peers()
        self.begin_step()

    def begin_step(self) -> None:
        """Form the quorum for the next step (healing this group if it is behind)."""
        manager, previous = self.manager, self.participants
        started = time.perf_counter()
        self._healed_s = None
        self._in_quorum = True
        try:
            manager.start_quorum()
            if self._attempt == 0:
                started = self._wait_for_start_groups() or started  # the quorum (and heal) that counts
        finally:
            self._in_quorum = False
        quorum_s = time.perf_counter() - started
        from dream_trainer.fault_tolerance.transport import raise_refused_heal
        raise_refused_heal(manager, self.group_id)  # not applied, and would be retried at every step
        self.participants, self.replica_rank = manager.num_participants(), manager.participating_rank()
        self._token = manager.current_step()
        self._step_open, self._micro = True, 0
        self._attempt += 1
        self.gradients.reset()
        if self._healed_s is not None:
            self._event("heal", seconds=quorum_s, load_s=self._healed_s, participants=self.participants)
            logger.warning("replica group %d healed from a peer at step %d (%.2f s)", self.group_id, self._token, quorum_s)
        if self._attempt == 1 and self.progress is not None:
            from dream_trainer.fault_tolerance.history import check_progress

            check_progress(self.progress, self._token, self.participants, self.group_id)
        if self.participants != previous:
            self._event("quorum", participants=self.participants, replica_rank=self.replica_rank, seconds=quorum_s)
        self._report_losses(previous, quorum_s)

    def _wait_for_start_groups(self) -> float | None:
        """At a fresh run's first step, form quorums again until `start_groups` groups are
        in one (every rank of a group sees the same quorum, so all decide alike); returns
        when the last quorum began, None when none was formed again."""
        manager, wanted, started = self.manager, self.ft.start_groups, None
        deadline = time.monotonic() + self.ft.quorum_timeout_s
        if manager.num_participants() < wanted and manager.current_step() == 0:
            self._event("waiting_for_groups", participants=manager.num_participants(), wanted=wanted)
            logger.info("replica group %d: waiting for start_groups=%d groups (%d in the quorum)", self.group_id, wanted,
                        manager.num_participants())
        while manager.num_participants() < wanted and manager.current_step() == 0:
            if time.monotonic() > deadline:
                raise FaultToleranceError(
                    f"replica group {self.group_id}: {manager.num_participants()} of start_groups={wanted} groups joined "
                    f"within quorum_timeout_s={self.ft.quorum_timeout_s:g} s; start the others, or lower "
                    "FaultToleranceParameters.start_groups")
            time.sleep(0.05)
            started = time.perf_counter()
            manager.start_quorum()
        return started

    def _report_losses(self, previous: int, quorum_s: float) -> None:
        """One warning line for groups lost since the last quorum, with the error that kept
        the last step from committing, if any (or for that error alone); `max_failures`."""
        failure, self._failure = self._failure, None
        lost = previous - self.participants if previous else 0
        if failure is not None and lost <= 0:
            logger.warning("replica group %d: step %d was not committed (%s); retried", self.group_id, failure[0] + 1,
                           failure[1])
        if lost <= 0:
            return
        self.replica_losses += lost
        self._event("replica_lost", lost=lost, participants=self.participants, seconds=quorum_s)
        logger.warning("replica group %d: %d group(s) lost, training on with %d%s", self.group_id, lost,
                       self.participants, f" (step {failure[0] + 1} was not committed: {failure[1]})" if failure else "")
        limit = self.ft.max_failures
        if limit is not None and self.replica_losses > limit:
            raise FaultToleranceError(
                f"{self.replica_losses} replica group failure(s) so far, more than max_failures={limit}: halting "
                f"(replica group {self.group_id}, step {self._token})"
            )

    def step_slot(self) -> tuple[int, int, int, int, int]:
        """``(attempt, committed, participants, replica_rank, micro)`` of the step being
        fetched: what `FaultTolerantSampler` assigns data from."""
        if not self._step_open:
            raise RuntimeError(
                "a training batch was requested outside a step's quorum: FaultTolerantSampler needs "
                "DataLoader(num_workers=0) (workers prefetch indices ahead of the quorum)"
            )
        return self._attempt, self._token, self.participants, self.replica_rank or 0, self._micro

    def sync_gradients(self, parameters: list[Any]) -> None:
        """Average this rank's gradients (local shards) over the quorum's participants: the
        buckets backward did not start are started here, then all are waited for. A missing
        gradient counts as zeros. An error (a peer died) goes to the Manager, never raised:
        the step will not be committed (its gradients are dropped)."""
        self.gradients.finish(parameters, healthy=lambda: self.manager.errored() is None)

    def agree_on_step(self, skip_reason: str | None) -> str | None:
        """torchft's commit vote (every rank of every group takes part once per step). A
        veto of this group's trainer makes this group vote no."""
        manager = self.manager
        if skip_reason is not None:
            manager.report_error(RuntimeError(f"step vetoed in this group: {skip_reason}"))
        error = manager.errored()
        committed = manager.should_commit()
        self._step_open = False
        if committed:
            return None
        if skip_reason is None:
            enough = self.participants >= self.ft.min_replica_size
            skip_reason = (f"not committed: {type(error.original_exception).__name__}: "
                           f"{error.original_exception}" if error is not None else
                           f"not committed: {self.participants} group(s) < min_replica_size={self.ft.min_replica_size}"
                           if not enough else "not committed by the quorum")
            if error is not None:  # logged once, at the next quorum (with the lost groups, if any)
                self._failure = (self._token, _one_line(error.original_exception))
        self._event("not_committed", reason=skip_reason[:300], participants=self.participants)
        return skip_reason

    def _release_peers(self) -> None:
        """A step that ended without an optimizer step (a skipped batch): take part in its
        all-reduce with zeros and vote no, so the other groups do not wait for us."""
        parameters = self._state_fns[2]() if self._state_fns is not None else []
        for p in parameters:
            p.grad = None
        self.sync_gradients(parameters)
        self.agree_on_step("the step ended without an optimizer step")
        for p in parameters:
            p.grad = None

    # ------------------------------------------------------------------ state, events, teardown
    def resume_roots(self, root: Path) -> list[Path]:
        """Every replica group's checkpoint root this machine sees (`group_roots`): a group
        resumes from the newest checkpoint of any group of the run, as its peers may have
        gone on or finished while it was down."""
        return group_roots(root, self.group_id)

    def state_dict(self) -> dict[str, int]:
        """The Manager's state (committed steps and batches): saved in checkpoints."""
        return dict(self.manager.state_dict()) if self.manager is not None else {}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if self.manager is not None and state:
            self.manager.load_state_dict({"step": int(state["step"]), "batches_committed": int(state["batches_committed"])})

    def _event(self, name: str, **details: Any) -> None:
        event = {"event": name, "step": self._token, "time": time.time(), "group": self.group_id, **details}
        if self.on_event is not None:
            self.on_event(event)

    def teardown(self, abort: bool = False) -> None:
        if self._failure is not None:  # not reported at a next quorum
            logger.warning("replica group %d: step %d was not committed (%s)", self.group_id, self._failure[0] + 1,
                           self._failure[1])
            self._failure = None
        if self.gradients is not None:
            self.gradients.close()
        manager, self.manager = self.manager, None
        pg, self._replica_pg = self._replica_pg, None
        if manager is not None:
            try:
                manager.shutdown(wait=not abort)
            except Exception:  # noqa: BLE001 - teardown must not mask the original error
                logger.exception("shutting down the torchft Manager failed")
        if pg is not None:
            try:
                pg.abort() if abort else pg.shutdown()
            except Exception:  # noqa: BLE001
                logger.exception("shutting down the torchft process group failed")
        self._store = None
        super().teardown(abort=abort)

    def __repr__(self) -> str:
        return (f"FaultTolerantWorld(group={self.group_id}, rank={self.rank}/{self.world_size}, device={self.device}, "
                f"plan={self.plan}, lighthouse={self.lighthouse}, launched={self.launched})")


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
2. `sync_gradients` (in ``trainer.step``, before clipping): one all-reduce per gradient
   dtype across the groups (this rank's local shards: FSDP2/TP layouts match across groups).
   A peer that dies mid-collective is an error reported to the Manager, never raised.
3. `agree_on_step`: torchft's commit vote. Not committed (a peer died, too few groups, a
   veto of this group's trainer): the trainer skips the step (no update, gradients dropped).

torchft is imported only when a fault-tolerant world is made (``pip install torchft``).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch

from dream_trainer.configs import DeviceParameters, FaultToleranceParameters
from dream_trainer.world.world import DistributedWorld, _env_int

logger = logging.getLogger(__name__)

_BUCKET = 1 << 26  # elements per all-reduce bucket (256 MB of float32)


class FaultToleranceError(RuntimeError):
    """A fault-tolerance setting or event the run cannot continue with (an unreachable
    lighthouse, an unresolvable hostname, more replica failures than `max_failures`)."""


class _DropNoise(logging.Filter):
    """torchft warns at every reconfiguration that it cannot reset NCCL's flight recorder
    (also on CPU, where there is none)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "flight recorder" not in record.getMessage()


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


def lighthouse_address(params: FaultToleranceParameters) -> str:
    """The lighthouse to use: `params.lighthouse`, else ``$TORCHFT_LIGHTHOUSE``."""
    address = params.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
    if not address:
        raise FaultToleranceError(
            "no lighthouse: set FaultToleranceParameters(lighthouse='http://host:port') or TORCHFT_LIGHTHOUSE "
            "(start one with `python -m dream_trainer.ft lighthouse`)"
        )
    FaultToleranceParameters(lighthouse=address)  # the same check as the field's
    return address.rstrip("/")


def _host_port(address: str) -> tuple[str, int]:
    url = urlparse(address)
    return url.hostname or "", url.port or (443 if url.scheme == "https" else 80)


def check_lighthouse(address: str, timeout_s: float) -> None:
    """Fail at once, with a clear message, when nothing answers at the lighthouse's address
    (torchft itself would wait for its quorum timeout)."""
    host, port = _host_port(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return
    except OSError as exc:
        raise FaultToleranceError(
            f"the lighthouse at {address} is unreachable ({exc.__class__.__name__}: {exc}) within "
            f"connect_timeout_s={timeout_s:g}: start it first (`python -m dream_trainer.ft lighthouse --bind "
            f"{host}:{port}`) or fix FaultToleranceParameters.lighthouse / TORCHFT_LIGHTHOUSE"
        ) from None


def _is_loopback(host: str) -> bool:
    try:
        return all(info[4][0].startswith("127.") or info[4][0] == "::1" for info in socket.getaddrinfo(host, None))
    except OSError:
        return False


def resolve_hostname(hostname: str | None, lighthouse: str) -> str:
    """The address peers reach this group at. torchft advertises ``socket.gethostname()``
    by default, which peers cannot use when it does not resolve: an explicit `hostname`
    must resolve; without one, this machine's hostname when it resolves, else ``127.0.0.1``
    when the lighthouse is on loopback (every group on this machine), else an error."""
    if hostname is not None:
        try:
            socket.getaddrinfo(hostname, None)
        except OSError as exc:
            raise FaultToleranceError(
                f"FaultToleranceParameters.hostname={hostname!r} does not resolve ({exc}): peers could not reach "
                "this group; give an address or a name in DNS/hosts"
            ) from None
        return hostname
    own = socket.gethostname()
    try:
        socket.getaddrinfo(own, None)
        return own
    except OSError:
        pass
    if _is_loopback(_host_port(lighthouse)[0]):
        logger.info("hostname %r does not resolve; the lighthouse is on loopback: advertising 127.0.0.1", own)
        return "127.0.0.1"
    raise FaultToleranceError(
        f"this machine's hostname {own!r} does not resolve, so peers could not reach this group: set "
        "FaultToleranceParameters(hostname=...) to an address the other groups can reach"
    )


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
    """

    announces_batches = True

    def __init__(self, device_parameters: DeviceParameters | None, params: FaultToleranceParameters):
        if not isinstance(params, FaultToleranceParameters):
            raise TypeError(f"FaultTolerantWorld takes a FaultToleranceParameters, got {type(params).__name__}")
        super().__init__(device_parameters)
        self.ft = params
        self.group_id = _group_id(params)
        self.lighthouse = lighthouse_address(params)
        self.hostname = resolve_hostname(params.hostname, self.lighthouse)
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
        from torchft.checkpointing.http_transport import HTTPTransport
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        params, timeout = self.ft, timedelta(seconds=self.ft.timeout_s)
        if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            store_addr, store_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        else:  # one process without a launcher: its own store, reachable by peers
            self._store = torch.distributed.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
            store_addr, store_port = self.hostname, self._store.port
        hostname = self.hostname

        class _Transport(HTTPTransport):  # type: ignore[misc]
            """torchft's HTTP heal transport, advertising a reachable address (it would
            advertise ``socket.gethostname()``)."""

            def address(self) -> str:
                return f"http://{hostname}:{self._server.socket.getsockname()[1]}/checkpoint/"

        pg = ProcessGroupNCCL(timeout=timeout) if self.device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        self._replica_pg = pg
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
            hostname=hostname,
            heartbeat_interval=timedelta(seconds=params.heartbeat_interval),
            checkpoint_transport=_Transport(timeout=timeout, num_chunks=0),
            init_sync=params.init_sync,
        )

    def attach(self, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None],
               parameters: Callable[[], list[Any]]) -> None:
        """What a heal sends and applies (the trainer's whole state) and the parameters whose
        gradients are averaged (to release the peers of a step that ended without an update)."""
        self._state_fns = (state_dict, load_state_dict, parameters)
        self.manager.register_state_dict_fn("trainer", self._load, self._save)

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
        finally:
            self._in_quorum = False
        quorum_s = time.perf_counter() - started
        self.participants, self.replica_rank = manager.num_participants(), manager.participating_rank()
        self._token = manager.current_step()
        self._step_open, self._micro = True, 0
        self._attempt += 1
        if self._healed_s is not None:
            self._event("heal", seconds=quorum_s, load_s=self._healed_s, participants=self.participants)
            logger.warning("replica group %d healed from a peer at step %d (%.2f s)", self.group_id, self._token, quorum_s)
        if self.participants != previous:
            self._event("quorum", participants=self.participants, replica_rank=self.replica_rank, seconds=quorum_s)
        if previous and self.participants < previous:
            self.replica_losses += previous - self.participants
            self._event("replica_lost", lost=previous - self.participants, participants=self.participants,
                        seconds=quorum_s)
            logger.warning("replica group %d: %d group(s) lost, training on with %d", self.group_id,
                           previous - self.participants, self.participants)
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

    @torch.no_grad()
    def sync_gradients(self, parameters: list[Any]) -> None:
        """Average this rank's gradients (local shards) over the quorum's participants.
        A missing gradient counts as zeros. On an error (a peer died) the local gradients
        are kept and the error goes to the Manager: the step will not be committed."""
        from torch.distributed.tensor import DTensor

        manager = self.manager
        buckets: dict[tuple[torch.dtype, torch.device], list[tuple[int, list[torch.Tensor]]]] = {}
        for p in parameters:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            chunks = buckets.setdefault((grad.dtype, grad.device), [(0, [])])
            size, tensors = chunks[-1]
            if tensors and size + grad.numel() > _BUCKET:
                chunks.append((0, []))
                size, tensors = chunks[-1]
            tensors.append(grad)
            chunks[-1] = (size + grad.numel(), tensors)
        pending = []
        for chunks in buckets.values():
            for _, tensors in chunks:
                flat = torch._utils._flatten_dense_tensors(tensors)
                pending.append((manager.allreduce(flat), flat, tensors))
        for work, flat, tensors in pending:
            work.wait()  # errors are reported to the Manager, not raised
        if manager.errored() is None:
            for _, flat, tensors in pending:
                torch._foreach_copy_(tensors, torch._utils._unflatten_dense_tensors(flat, tensors))

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


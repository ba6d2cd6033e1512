"""`CallbackCollection`: an ordered, named set of callbacks with typed hook dispatch.

Dispatch calls only the callbacks that override a hook. The per-hook tuples are computed
when callbacks are added or removed (never per step), and each dispatch iterates a
snapshot, so a callback may remove itself or add another from inside a hook.
"""

from __future__ import annotations

import difflib
import logging
import re
import types
import typing
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, Callable

from typing_extensions import get_protocol_members

from dream_trainer.cluster import global_rank as cluster_rank
from dream_trainer.protocol.base import CONTEXT_HOOKS, HOOKS, Callback, RankZeroCallback, SkipBatch, StopTraining
from dream_trainer.protocol.dispatch import DispatchMixin

logger = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")


class CallbackDependencyError(TypeError):
    """A callback was attached to a trainer that lacks what the callback needs."""


class _FailureState:
    __slots__ = ("count", "last_step", "logged_traceback")

    def __init__(self) -> None:
        self.count = 0
        self.last_step: int | None = None
        self.logged_traceback = False


class CallbackCollection(DispatchMixin):
    """Ordered, named callbacks; dispatches each hook to the callbacks that override it.

    Args:
        callbacks: a sequence of callbacks (named after their class; a second instance of
            a class gets a ``_1`` suffix, and so on) or a mapping of name -> callback.

    Callbacks run in ascending ``order`` (a class attribute, default 0), then in insertion
    order. ``collection["Name"]`` or ``collection[SomeCallbackClass]`` looks one up.
    """

    def __init__(self, callbacks: Iterable[Callback[Any]] | Mapping[str, Callback[Any]] | None = None):
        self._callbacks: dict[str, Callback[Any]] = {}
        self._trainer: Any = None
        self._rank: int | None = None
        self._failures: dict[str, _FailureState] = {}
        self._contexts: dict[str, tuple[Callable[[], AbstractContextManager[Any] | None], ...]] = {}
        if isinstance(callbacks, Mapping):
            for name, callback in callbacks.items():
                self.add(callback, name=name)
        elif callbacks is not None:
            for callback in callbacks:
                self.add(callback)
        self._rebuild()

    # ---------------------------------------------------------------- membership
    def add(self, callback: Callback[Any], name: str | None = None) -> str:
        """Add `callback` (initializing it if the collection is already initialized).

        Returns the name it was registered under. An explicit `name` that is taken raises.
        """
        if not isinstance(callback, Callback):
            raise TypeError(
                f"expected a dream_trainer Callback, got {type(callback).__name__}: {callback!r}"
            )
        type(callback).check_hook_signatures()
        if callback.safe_types:
            from dream_trainer.serialization import allow_types

            allow_types(*callback.safe_types)
        interval = callback.log_every_n_steps
        if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int) or interval < 1):
            raise ValueError(
                f"{type(callback).__name__}.log_every_n_steps={interval!r} is invalid: expected an int >= 1 or None"
            )
        if any(existing is callback for existing in self._callbacks.values()):
            raise ValueError(f"callback {callback!r} is already in the collection")
        if name is None:
            base = type(callback).__name__
            name, i = base, 1
            while name in self._callbacks:
                name, i = f"{base}_{i}", i + 1
        else:
            if not isinstance(name, str) or not _NAME_RE.match(name):
                raise ValueError(f"callback name {name!r} is invalid: use letters, digits, '_', '.', '-'")
            if name in self._callbacks:
                raise ValueError(
                    f"a callback named {name!r} ({type(self._callbacks[name]).__name__}) is already "
                    "registered; pass another name"
                )
        if self._trainer is not None:
            self._attach(name, callback)
        self._callbacks[name] = callback
        self._rebuild()
        return name

    append = add

    def remove(self, key: str | Callback[Any] | type) -> Callback[Any]:
        """Remove a callback by name, instance or class (the first of that class)."""
        name = self._name_of(key)
        callback = self._callbacks.pop(name)
        self._failures.pop(name, None)
        self._rebuild()
        return callback

    def _find(self, key: object) -> str | None:
        """The registered name of `key` (a name, a callback class or a callback), or None."""
        if isinstance(key, str):
            return key if key in self._callbacks else None
        for name, callback in self._callbacks.items():
            if isinstance(callback, key) if isinstance(key, type) else callback is key:
                return name
        return None

    def _name_of(self, key: str | Callback[Any] | type) -> str:
        found = self._find(key)
        if found is not None:
            return found
        hint = ""
        if isinstance(key, str):  # a name of the old scheme (`ProgressBar`) or a typo
            close = difflib.get_close_matches(key, list(self._callbacks), n=1, cutoff=0.6)
            longer = [name for name in self._callbacks if name == f"{key}Callback"]
            hint = f" (did you mean {(longer or close)[0]!r}?)" if longer or close else ""
        raise KeyError(f"no callback {key!r}{hint}; registered: {list(self._callbacks)}")

    def __getitem__(self, key: str | type) -> Callback[Any]:
        return self._callbacks[self._name_of(key)]

    def __contains__(self, key: object) -> bool:
        return self._find(key) is not None

    def __iter__(self) -> Iterator[Callback[Any]]:
        return iter(self._ordered())

    def __len__(self) -> int:
        return len(self._callbacks)

    def names(self) -> list[str]:
        """Names in dispatch order."""
        by_id = {id(cb): name for name, cb in self._callbacks.items()}
        return [by_id[id(cb)] for cb in self._ordered()]

    def items(self) -> list[tuple[str, Callback[Any]]]:
        return list(zip(self.names(), self._ordered()))

    def __repr__(self) -> str:
        return f"CallbackCollection({self.names()})"

    def _ordered(self) -> list[Callback[Any]]:
        return sorted(self._callbacks.values(), key=lambda cb: getattr(cb, "order", 0))

    # ---------------------------------------------------------------- initialization
    def initialize(self, trainer: Any, global_rank: int | None = None) -> None:
        """Attach every callback to `trainer`, checking what each one needs.

        `global_rank` decides where `RankZeroCallback` hooks run (default: this process's
        rank from the launch environment, `dream_trainer.cluster.global_rank`: ``RANK``, or
        a SLURM step's ``SLURM_PROCID`` — known before the process group exists).
        """
        self._trainer = trainer
        self._rank = cluster_rank() if global_rank is None else global_rank
        for name, callback in list(self._callbacks.items()):
            self._attach(name, callback)
        self._rebuild()

    def _attach(self, name: str, callback: Callback[Any]) -> None:
        required = type(callback).trainer_requirement()
        if required is not None and not _satisfies(self._trainer, required):
            raise CallbackDependencyError(
                f"callback {name!r} ({type(callback).__name__}) needs a trainer that is "
                f"{_describe(required, self._trainer)}, but got {type(self._trainer).__name__} "
                f"(bases: {', '.join(k.__name__ for k in type(self._trainer).__mro__[1:-1])})"
            )
        callback.trainer = self._trainer

    def _active(self, callback: Callback[Any]) -> bool:
        return not (isinstance(callback, RankZeroCallback) and self._rank not in (None, 0))

    def _rebuild(self) -> None:
        active = [cb for cb in self._ordered() if self._active(cb)]
        overrides = {id(cb): set(type(cb).overridden_hooks()) for cb in active}
        for hook in HOOKS:
            fns = tuple(getattr(cb, hook) for cb in active if hook in overrides[id(cb)])
            setattr(self, "_h_" + hook, fns)
        for hook in CONTEXT_HOOKS:
            self._contexts[hook] = tuple(
                getattr(cb, hook) for cb in active if hook in overrides[id(cb)]
            )
        # Decided from every callback, rank-zero ones included, so every rank agrees.
        every = list(self._callbacks.values())
        #: The log intervals of the callbacks that have their own (`Callback.log_every_n_steps`).
        self.log_intervals = sorted({cb.log_every_n_steps for cb in every if cb.log_every_n_steps})
        #: Whether some callback may veto optimizer steps / skip batches (the ranks then agree on each).
        self.vetoes_steps = any(cb.vetoes_steps for cb in every)  # an instance may set its own
        self.skips_batches = any(cb.skips_batches for cb in every)
        self.recovers_errors = any(cb.recovers_errors for cb in every)
        #: The hooks some active callback overrides: the step's call sites test a hook here
        #: (a set lookup) and make no call for one nobody overrides.
        self.overridden = frozenset(hook for hook in HOOKS if getattr(self, "_h_" + hook))
        #: Whether any callback returns a context for training / validation steps.
        self.has_train_context = bool(self._contexts["train_context"])
        self.has_validation_context = bool(self._contexts["validation_context"])

    # ---------------------------------------------------------------- dispatch core
    # One loop per arity: ``fn(a, b)`` is measurably cheaper than ``fn(*args)`` when 20
    # callbacks run several hooks per step (see benchmarks/overhead.py).
    def _call0(self, fns: tuple[Callable[[], Any], ...], hook: str) -> None:
        for fn in fns:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - the error policy decides
                self._on_error(fn, hook, exc)

    def _call1(self, fns: tuple[Callable[[Any], Any], ...], hook: str, a: Any) -> None:
        for fn in fns:
            try:
                fn(a)
            except Exception as exc:  # noqa: BLE001
                self._on_error(fn, hook, exc)

    def _call2(self, fns: tuple[Callable[[Any, Any], Any], ...], hook: str, a: Any, b: Any) -> None:
        for fn in fns:
            try:
                fn(a, b)
            except Exception as exc:  # noqa: BLE001
                self._on_error(fn, hook, exc)

    def _on_error(self, fn: Callable[..., Any], hook: str, exc: Exception) -> None:
        callback: Callback[Any] = fn.__self__  # type: ignore[attr-defined]
        if isinstance(exc, (StopTraining, SkipBatch)):
            # Inside a trainer, a request every rank agrees on (the hook's other callbacks
            # go on); standalone, it propagates.
            request = getattr(self._trainer, "request_stop" if isinstance(exc, StopTraining) else "request_skip_batch", None)
            if request is None:
                raise exc
            if isinstance(exc, SkipBatch) and not callback.skips_batches:
                raise RuntimeError(
                    f"callback {type(callback).__name__} raised SkipBatch but does not declare "
                    "skips_batches = True (the ranks agree on skipped batches only then)"
                ) from exc
            request(exc.reason)
            return
        if callback.critical:
            raise exc
        try:
            name = self._name_of(callback)
        except KeyError:  # already removed during this dispatch
            return
        state = self._failures.setdefault(name, _FailureState())
        step = int(getattr(self._trainer, "global_step", 0) or 0)
        consecutive = state.last_step is not None and step - state.last_step <= 1
        state.count = state.count + 1 if consecutive else 1
        state.last_step = step
        if not state.logged_traceback:
            state.logged_traceback = True
            logger.exception("non-critical callback %r failed in %s (training continues)", name, hook)
        else:
            logger.warning("non-critical callback %r failed again in %s: %r", name, hook, exc)
        self._tell_error(callback, name, hook, exc)
        if state.count >= callback.max_consecutive_failures:
            why = f"{state.count} consecutive failures"
            # Inside a trainer, every rank disables it at the same boundary.
            request_disable = getattr(self._trainer, "request_disable", None)
            if request_disable is None:
                self.disable(name, why)
            else:
                request_disable(name, why)

    def _tell_error(self, failed: Callback[Any], name: str, hook: str, exc: Exception) -> None:
        """`on_callback_error` of every other callback; its own errors are logged only."""
        for fn in self._h_on_callback_error:
            if fn.__self__ is failed:  # type: ignore[attr-defined]
                continue
            try:
                fn(name, hook, exc)
            except Exception:  # noqa: BLE001 - never dispatched again (no error loops)
                logger.exception("on_callback_error of %r failed", type(fn.__self__).__name__)  # type: ignore[attr-defined]

    def disable(self, name: str, why: str) -> None:
        """Remove the callback `name` (a non-critical one that keeps failing), with a
        warning. Unknown names (already removed) are ignored."""
        if name in self._callbacks:
            logger.warning("disabling callback %r after %s", name, why)
            self.remove(name)
            self.on_callback_disabled(name, why)

    def contexts(self, hook: str) -> list[AbstractContextManager[Any]]:
        """The context managers the callbacks return for `train_context`/`validation_context`."""
        out: list[AbstractContextManager[Any]] = []
        for fn in self._contexts[hook]:
            try:
                ctx = fn()
            except Exception as exc:  # noqa: BLE001
                self._on_error(fn, hook, exc)
                continue
            if ctx is not None:
                out.append(ctx)
        return out

    def listens(self, hook: str) -> bool:
        """Whether any active callback overrides `hook`."""
        return bool(getattr(self, "_h_" + hook))

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, dict[str, Any]]:
        """``{name: callback.state_dict()}`` for every callback that keeps state. A
        non-critical callback whose `state_dict` raises is left out, with a warning."""
        out = {}
        for name, cb in self._callbacks.items():
            if type(cb).state_dict is Callback.state_dict:
                continue
            try:
                out[name] = cb.state_dict()
            except Exception:  # noqa: BLE001
                if cb.critical:
                    raise
                logger.warning("state_dict of non-critical callback %r failed: its state is not saved", name, exc_info=True)
        return out

    def load_state_dict(self, state: Mapping[str, dict[str, Any]]) -> None:
        """Restore callback states by name; a saved callback that is absent only warns, and
        so does a non-critical callback whose `load_state_dict` raises (it keeps its
        current state)."""
        for name, cb_state in state.items():
            if name not in self._callbacks:
                warn_absent_callbacks([name], list(self._callbacks))
                continue
            callback = self._callbacks[name]
            try:
                callback.load_state_dict(cb_state)
            except Exception:  # noqa: BLE001
                if callback.critical:
                    raise
                logger.warning(
                    "load_state_dict of non-critical callback %r failed: it starts from its initial state",
                    name,
                    exc_info=True,
                )


def warn_absent_callbacks(saved: list[str], present: list[str]) -> None:
    """The warning for saved callback states that no callback of this run takes."""
    logger.warning(
        "the checkpoint holds state for callback(s) %s, which are not in this run (callbacks: %s); "
        "their state is ignored",
        saved,
        present,
    )


def _satisfies(trainer: Any, required: Any) -> bool:
    args = typing.get_args(required)
    if args and typing.get_origin(required) in (typing.Union, types.UnionType):
        return any(_satisfies(trainer, arg) for arg in args)
    if _is_runtime_protocol(required):
        return not _missing_members(trainer, required)
    try:
        return isinstance(trainer, required)
    except TypeError as exc:  # a non-runtime-checkable Protocol, a subscripted generic...
        raise CallbackDependencyError(
            f"cannot check callback requirement {required!r}: {exc}. Use a class, a mixin or "
            "a @runtime_checkable Protocol as the Callback's type argument"
        ) from exc


def _is_runtime_protocol(required: Any) -> bool:
    return bool(getattr(required, "_is_protocol", False) and getattr(required, "_is_runtime_protocol", False))


def _missing_members(trainer: Any, protocol: Any) -> list[str]:
    """The members of `protocol` that `trainer` neither has nor declares. A member the
    trainer's class declares (an annotation, like `AbstractTrainer`'s ``run_dir: Path``) is an
    attribute set later in the lifecycle (``run_dir`` and ``world`` at launch): the check runs
    before ``pre_launch``, so a declaration counts."""
    declared = {name for klass in type(trainer).__mro__ for name in getattr(klass, "__annotations__", {})}
    return sorted(m for m in get_protocol_members(protocol) if m not in declared and not hasattr(trainer, m))


def _describe(required: Any, trainer: Any = None) -> str:
    name = getattr(required, "__name__", None) or repr(required)
    if _is_runtime_protocol(required) and trainer is not None:
        return f"an implementation of the protocol {name} (missing: {', '.join(_missing_members(trainer, required))})"
    if getattr(required, "_is_protocol", False):
        return f"an implementation of the protocol {name}"
    return f"a {name}"


_missing = [hook for hook in HOOKS if not callable(getattr(CallbackCollection, hook, None))]
if _missing:  # pragma: no cover - a developer error, caught by the first import
    raise RuntimeError(f"CallbackCollection lacks dispatch methods for hooks: {_missing}")

"""Blends: several token files mixed by weight into one run's global batches (what
pre-training mixes are made of), deterministic and resumable on any world size.

A `TokenBlend` names its sources and their weights; `TokenLoader` reads it like one file
(``TokenLoader(TokenBlend({...}), ...)``, or ``data=[("a.tokens", 0.7), ("b.tokens", 0.3)]``).

**How many samples each source gives**: after ``t`` global batches of ``G`` samples, source
``i`` has given exactly ``c_i(t)``: the largest-remainder apportionment of ``t * G`` samples by
the normalized weights (exact rational arithmetic; a tie goes to the lower source index), so
``|c_i(t) - t * G * w_i| < 1`` at every step. Step ``t`` takes ``c_i(t + 1) - c_i(t)`` samples of
source ``i``. The largest-remainder method is monotone in ``t`` only when every source gets at
least one sample per global batch (``G * w_i >= 1``; otherwise a count could go down by one
from one step to the next: the Alabama paradox), so a blend refuses a weight below
``1 / global_batch_size``.

**Which samples**: each source is a stream of its own epochs, each one permutation of its
samples (a `GlobalOrder` with its own seed, drawn from ``(seed, source index)``); ``c_i(t)`` is
its position in that stream (its epoch: ``c_i(t) // n_i``). A source smaller than its share
repeats, epoch after epoch, while a larger one goes on (no sample is dropped at an epoch's
end: every sample of a source once per its epoch). A step's global batch is each source's next
samples, concatenated in source order, then shuffled by ``(seed, t)`` so that every rank's and
micro-batch's share mixes the sources. Its ids are a ``(G, 2)`` int64 array: ``[source index,
sample id in that source]``. Every rank computes the same global batch from ``t`` alone, so the
loader's split over ranks, micro-batches and a fault-tolerant quorum is the one of a single
file.

**The position** is ``t`` (global batches taken): `BlendOrder.state_dict` saves it with each
source's name, weight, size, fingerprint and position (for reading); it loads into any world
size. A position saved with other sources, weights, sizes or data is refused (naming the
differences) unless ``allow_different_data``, and so is one of another global batch size.

**An epoch of a blend** is nominal: ``sum(n_i) // G`` global batches (as many samples as the
sources hold together); the loader's ``len()``, ``set_epoch`` and epoch loop count in those.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dream_trainer.data.order import GlobalOrder, _data_differences
from dream_trainer.data.tokens import TokenFile

__all__ = ["BlendOrder", "TokenBlend", "apportion"]

_BATCH_KEY = 0xB1E0  # the seed stream of the in-batch shuffle (the sources' orders use 0)


def apportion(total: int, weights: Sequence[int]) -> list[int]:
    """The largest-remainder apportionment of `total` by integer `weights`: ``floor(total *
    w_i / W)`` each, and the samples left one each to the largest remainders (ties: the lower
    index). Exact integers; the counts add up to `total`."""
    whole = sum(weights)
    counts = [total * w // whole for w in weights]
    remainders = [total * w % whole for w in weights]
    left = total - sum(counts)
    for i in sorted(range(len(weights)), key=lambda i: (-remainders[i], i))[:left]:
        counts[i] += 1
    return counts


def _weight(name: str, weight: Any) -> Fraction:
    if isinstance(weight, bool) or not isinstance(weight, (int, float, Fraction)):
        raise ValueError(f"TokenBlend: source {name!r} has weight {weight!r}: expected a number > 0")
    if isinstance(weight, float) and not math.isfinite(weight):
        raise ValueError(f"TokenBlend: source {name!r} has weight {weight!r}: expected a finite number > 0")
    exact = Fraction(repr(weight)) if isinstance(weight, float) else Fraction(weight)  # 0.7 is 7/10
    if exact <= 0:
        raise ValueError(f"TokenBlend: source {name!r} has weight {weight!r}: weights must be > 0 (leave a source "
                         "out instead of giving it weight 0)")
    return exact


class TokenBlend:
    """Token files and their weights (any positive numbers; normalized).

    Args:
        sources: ``{name: (file, weight)}``, or a sequence of ``(file, weight)`` pairs named by
            their files' stems (``"a.tokens"`` is ``"a"``). A file: a `TokenFile` or its path.
            Refused: no sources, a weight that is not > 0, two sources of one name.
        dtype: the token dtype of files given by path (as `TokenFile`'s).
    """

    def __init__(self, sources: Mapping[str, tuple[Any, Any]] | Sequence[tuple[Any, Any]], *,
                 dtype: str | None = None):
        if isinstance(sources, Mapping):
            items = [(str(name), *_pair(name, value)) for name, value in sources.items()]
        elif isinstance(sources, (list, tuple)):
            items = []
            for index, value in enumerate(sources):
                data, weight = _pair(f"#{index}", value)
                path = data.path if isinstance(data, TokenFile) else Path(data)
                items.append((Path(path).stem, data, weight))
        else:
            raise ValueError(f"TokenBlend(sources={sources!r}): expected {{name: (file, weight)}} or a list of "
                             "(file, weight) pairs")
        if not items:
            raise ValueError("TokenBlend: no sources; give at least one (file, weight)")
        names = [name for name, _, _ in items]
        duplicated = sorted({name for name in names if names.count(name) > 1})
        if duplicated:
            raise ValueError(f"TokenBlend: sources named {duplicated} more than once (names: {names}); name them "
                             "apart with {name: (file, weight)}")
        self.names: list[str] = names
        self.weights: list[Fraction] = [_weight(name, weight) for name, _, weight in items]
        self.files: list[TokenFile] = [data if isinstance(data, TokenFile) else TokenFile(data, dtype=dtype)
                                       for _, data, _ in items]
        scale = math.lcm(*(w.denominator for w in self.weights))
        self.integer_weights: list[int] = [int(w * scale) for w in self.weights]  # the same ratios, integers

    @property
    def shares(self) -> dict[str, float]:
        """Each source's normalized weight."""
        whole = sum(self.weights)
        return {name: float(w / whole) for name, w in zip(self.names, self.weights)}

    def __repr__(self) -> str:
        return f"TokenBlend({', '.join(f'{n}={float(w):g}' for n, w in zip(self.names, self.weights))})"


def _pair(name: Any, value: Any) -> tuple[Any, Any]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"TokenBlend: source {name!r} is {value!r}: expected a (file, weight) pair")
    return value[0], value[1]


def _source_seed(seed: int, index: int) -> int:
    return int(np.random.SeedSequence([seed, 0, index]).generate_state(1, np.uint64)[0])


class BlendOrder:
    """The global batches of a `TokenBlend` and the run's position in them (``steps``: global
    batches taken); the interface of `GlobalOrder` that `TokenLoader` uses, over sample ids
    that are ``(source, id)`` rows. See the module docstring."""

    def __init__(self, blend: TokenBlend, seq_len: int, mode: str, global_batch_size: int, *, seed: int = 0,
                 shuffle: bool = True, allow_different_data: bool = False):
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"a blend's seed={seed!r}: expected an int >= 0")
        self.blend, self.global_batch_size = blend, global_batch_size
        self.seed, self.shuffle, self.allow_different_data = seed, bool(shuffle), allow_different_data
        self.sizes = [file.n_samples(seq_len, mode) for file in blend.files]
        empty = [name for name, size in zip(blend.names, self.sizes) if size < 1]
        if empty:
            raise ValueError(f"TokenBlend: source(s) {empty} have no samples of seq_len={seq_len} (mode={mode!r}): "
                             "leave them out or shorten seq_len")
        whole = sum(blend.integer_weights)
        small = [f"{name} (weight {float(w):g}: {global_batch_size * iw / whole:.3g} samples per global batch)"
                 for name, w, iw in zip(blend.names, blend.weights, blend.integer_weights)
                 if global_batch_size * iw < whole]
        if small:
            raise ValueError(f"TokenBlend: every source needs at least one sample per global batch of "
                             f"{global_batch_size}, i.e. a normalized weight >= 1/{global_batch_size}; too small: "
                             f"{', '.join(small)}. Raise those weights or the global batch size")
        if global_batch_size > sum(self.sizes):
            raise ValueError(f"TokenLoader: global_batch_size={global_batch_size} is more than the {sum(self.sizes)} "
                             f"samples of the blend's sources together (seq_len={seq_len}, mode={mode!r})")
        self.steps_per_epoch = sum(self.sizes) // global_batch_size
        self.n_samples = self.steps_per_epoch * global_batch_size  # a nominal epoch's samples
        self.orders = [GlobalOrder(size, 1, seed=_source_seed(seed, i), shuffle=self.shuffle,
                                   fingerprint=file.fingerprint())
                       for i, (size, file) in enumerate(zip(self.sizes, blend.files))]
        self.steps = 0
        self._cache: dict[int, np.ndarray] = {}

    # ----------------------------------------------------------------- the apportionment
    def counts(self, steps: int | None = None) -> list[int]:
        """Samples each source has given after `steps` global batches (default: the cursor's)."""
        steps = self.steps if steps is None else steps
        return apportion(steps * self.global_batch_size, self.blend.integer_weights)

    def _stream(self, index: int, start: int, stop: int) -> np.ndarray:
        """Positions ``start..stop - 1`` of source `index`'s stream: its epochs one after another."""
        order, size, parts = self.orders[index], self.sizes[index], []
        while start < stop:
            epoch, at = divmod(start, size)
            end = min(stop - start, size - at) + at
            parts.append(order.ids(epoch, at, end))
            start += end - at
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def global_batch(self, step: int) -> np.ndarray:
        """The ``(G, 2)`` ``[source, id]`` rows of global batch `step` (0-based)."""
        batch = self._cache.get(step)
        if batch is None:
            before, after = self.counts(step), self.counts(step + 1)
            batch = np.concatenate([np.stack([np.full(b - a, i, dtype=np.int64), self._stream(i, a, b)], axis=1)
                                    for i, (a, b) in enumerate(zip(before, after))])
            if self.shuffle:
                batch = batch[np.random.default_rng([self.seed, _BATCH_KEY, step]).permutation(len(batch))]
            if len(self._cache) > 4:
                self._cache.clear()
            self._cache[step] = batch
        return batch

    # ------------------------------------------------------------ GlobalOrder's interface
    @property
    def epoch(self) -> int:
        return self.steps // self.steps_per_epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.steps = value * self.steps_per_epoch + self.steps % self.steps_per_epoch

    @property
    def consumed(self) -> int:
        return self.steps % self.steps_per_epoch * self.global_batch_size

    @consumed.setter
    def consumed(self, value: int) -> None:
        self.steps = self.epoch * self.steps_per_epoch + value // self.global_batch_size

    def has_batch(self) -> bool:
        return True  # the cursor's epoch rolls over as its last global batch is taken

    def ids(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """Rows ``start..stop - 1`` of nominal epoch `epoch`'s global batches."""
        if not 0 <= start <= stop <= self.n_samples:
            raise ValueError(f"positions {start}..{stop}: must lie within the {self.n_samples} samples of an epoch")
        size, first = self.global_batch_size, epoch * self.steps_per_epoch
        steps = range(start // size, max(start // size, (stop - 1) // size) + 1)
        rows = np.concatenate([self.global_batch(first + s) for s in steps])
        return rows[start - steps[0] * size:stop - steps[0] * size]

    def ids_at(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The rows at `positions` (each in ``[0, n_samples)``) of nominal epoch `epoch`'s
        global batches, each global batch computed once."""
        size, first = self.global_batch_size, epoch * self.steps_per_epoch
        steps = np.unique(positions // size)
        batches = np.stack([self.global_batch(first + int(s)) for s in steps])
        return batches[np.searchsorted(steps, positions // size), positions % size]

    def peek(self) -> np.ndarray:
        return self.global_batch(self.steps)

    def advance(self) -> None:
        self.steps += 1

    # --------------------------------------------------------------------- the position
    def state_dict(self) -> dict[str, Any]:
        """``steps`` and the blend (plain integers and strings), the same on every rank."""
        sources = []
        for i, (name, weight, size, taken) in enumerate(zip(self.blend.names, self.blend.weights, self.sizes,
                                                             self.counts())):
            sources.append({"name": name, "weight": [weight.numerator, weight.denominator], "n_samples": size,
                            "taken": taken, "epoch": taken // size, "consumed": taken % size,
                            "fingerprint": dict(self.orders[i].fingerprint or {})})
        return {"blend": 1, "steps": self.steps, "seed": self.seed, "shuffle": int(self.shuffle),
                "global_batch_size": self.global_batch_size, "epoch": self.epoch, "consumed": self.consumed,
                "n_samples": self.n_samples, "sources": sources}

    def differences(self, state: dict[str, Any]) -> list[str]:
        """How a saved blend differs from this one (names, weights, sizes, data)."""
        saved = state["sources"]
        names = [s["name"] for s in saved]
        if names != self.blend.names:
            return [f"sources {names} saved, {self.blend.names} now"]
        out = []
        for s, weight, size, order in zip(saved, self.blend.weights, self.sizes, self.orders):
            if Fraction(*s["weight"]) != weight:
                out.append(f"{s['name']}: weight {float(Fraction(*s['weight'])):g} saved, {float(weight):g} now")
            if int(s["n_samples"]) != size:
                out.append(f"{s['name']}: {s['n_samples']} samples saved, {size} now")
            differ = _data_differences(s.get("fingerprint") or {}, order.fingerprint or {})
            if differ:
                out.append(f"{s['name']}: other data (different {', '.join(differ)})")
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Seek to a saved position (from any world size); see the module docstring."""
        if "blend" not in state:
            raise ValueError("the saved data position is of a single token file; this loader reads a blend of "
                             f"{self.blend.names}")
        if int(state["global_batch_size"]) != self.global_batch_size:
            raise ValueError(f"the saved blend position is of global_batch_size={state['global_batch_size']}, this "
                             f"run's is {self.global_batch_size}: a blend's position is counted in global batches, "
                             "resume with the same global batch size")
        differ = self.differences(state)
        if differ and not self.allow_different_data:
            raise ValueError(f"the saved data position is of another blend ({'; '.join(differ)}); to continue from "
                             "its step with this blend anyway, pass allow_different_data=True")
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        for i, order in enumerate(self.orders):
            order.seed, order.shuffle = _source_seed(self.seed, i), self.shuffle
            order._cache.clear()
        self.steps = int(state["steps"])
        self._cache.clear()

    # ---------------------------------------------------------------------- reading
    def gather(self, ids: np.ndarray, read: Callable[[TokenFile, np.ndarray], list[torch.Tensor]],
               pin: bool) -> list[torch.Tensor]:
        """The tensors of ``(source, id)`` rows `ids`, in their order: ``read(file, ids)`` per
        source (one read of each file), placed into the rows (pinned when `pin`)."""
        out: list[torch.Tensor] | None = None
        for index in np.unique(ids[:, 0]):
            rows = np.flatnonzero(ids[:, 0] == index)
            parts = read(self.blend.files[int(index)], ids[rows, 1])
            if out is None:
                out = [torch.empty((len(ids), *p.shape[1:]), dtype=p.dtype, pin_memory=pin) for p in parts]
            where = torch.from_numpy(rows)
            for target, part in zip(out, parts):
                target[where] = part
        assert out is not None, "an empty batch"
        return out

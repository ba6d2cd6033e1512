"""The global sample order of a run (`GlobalOrder`) and the split of a global batch over
data-parallel ranks (`split_global_batch`).

**The order** is one permutation of the samples per epoch, drawn from ``(seed, epoch)``: a
property of the run, not of a rank. A global batch is the next ``global_batch_size`` samples of
that order; `GlobalOrder.step_samples` splits it into the micro-batches of one data-parallel
rank. Which samples make up each global batch therefore does not depend on how many ranks
share it.

**The permutation is computed, not stored**: sample ``p`` of epoch ``e`` is ``π_e(p)``, a
seeded bijection of ``[0, n_samples)`` (a 6-round Feistel network over the smallest ``2**k
>= n_samples``, walking the cycle until the value falls below ``n_samples``; its round keys are
drawn from numpy's PCG64 seeded with ``(seed, epoch)``). Only the ids of the batches asked
for are evaluated, vectorized (`peek`: a window of ``max(global_batch_size, 8192)`` positions
at a time): memory is O(global_batch_size) for any ``n_samples`` (a 488M-sample epoch costs
what a 1,000-sample one does), and the ids are the same on every machine.

Order versions: runs saved before this scheme (``order_version`` absent from the saved
position) drew a materialized ``rng.permutation(n_samples)`` (order version 1); loading such a
position keeps that order for the rest of the run, so its resume is exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["ORDER_VERSION", "WINDOW", "GlobalOrder", "permuted", "split_global_batch"]

ORDER_VERSION = 2
"""The order new runs use: 2, the computed permutation (1: the materialized one of runs before)."""

_ROUNDS = 6
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64's multipliers
_S32 = np.uint64(32)
WINDOW = 8192
"""Sample ids evaluated at once (`GlobalOrder.peek`, the loader's plan): numpy's cost per
call, not per id, dominates a global batch's few hundred ids."""


def _round(x: np.ndarray, key: np.uint64, width: int) -> np.ndarray:
    """A round function: the top `width` bits of a multiply-xorshift-multiply hash of
    ``x ^ key`` (uint64 arithmetic wraps)."""
    y = (x ^ key) * _M1
    y ^= y >> _S32
    y *= _M2
    return y >> np.uint64(64 - width)


def _feistel(x: np.ndarray, keys: np.ndarray, bits: int) -> np.ndarray:
    """A bijection of ``[0, 2**bits)``: an alternating Feistel network over the high
    ``bits // 2`` and low ``bits - bits // 2`` bits, each round xoring a hash of one half
    into the other (each round is its own inverse)."""
    high, low = bits // 2, bits - bits // 2
    left, right = x >> np.uint64(low), x & np.uint64((1 << low) - 1)
    for i, key in enumerate(keys):
        if i % 2 == 0 and high:
            left ^= _round(right, key, high)
        elif i % 2 == 1 and low:
            right ^= _round(left, key, low)
    return (left << np.uint64(low)) | right


def permuted(positions: np.ndarray, n: int, keys: np.ndarray) -> np.ndarray:
    """``π(positions)`` for the bijection of ``[0, n)`` that `keys` (uint64 round keys)
    define: the Feistel network over the smallest ``2**k >= n``, applied again to a value
    until it falls below ``n`` (cycle walking: the orbit of a position below ``n`` reaches
    another one, on average after fewer than 2 steps). int64 ids."""
    bits = max(int(n) - 1, 0).bit_length()
    out = _feistel(np.asarray(positions, dtype=np.uint64), keys, bits)
    outside = np.flatnonzero(out >= np.uint64(n))
    while outside.size:
        out[outside] = _feistel(out[outside], keys, bits)
        outside = outside[out[outside] >= np.uint64(n)]
    return out.astype(np.int64)


def split_global_batch(global_batch_size: int, dp_size: int, micro_batch_size: int | None = None) -> tuple[int, int]:
    """``(micro_batch_size, accumulation_steps)`` for a global batch over `dp_size`
    data-parallel ranks: ``global = dp_size * micro * accumulation``. Without a micro-batch
    size, one micro-batch per rank. A split that does not divide is refused, naming the
    sizes that would."""
    if global_batch_size < 1 or dp_size < 1:
        raise ValueError(f"global_batch_size={global_batch_size}, dp_size={dp_size}: both must be at least 1")
    if global_batch_size % dp_size:
        sizes = [d for d in range(1, global_batch_size + 1) if global_batch_size % d == 0]
        raise ValueError(f"global_batch_size={global_batch_size} cannot be split over {dp_size} data-parallel ranks; "
                         f"data-parallel sizes that divide it: {sizes}")
    per_rank = global_batch_size // dp_size
    micro = per_rank if micro_batch_size is None else micro_batch_size
    if micro < 1 or per_rank % micro:
        sizes = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
        raise ValueError(f"micro_batch_size={micro_batch_size} does not divide the {per_rank} samples each of "
                         f"{dp_size} ranks takes from global_batch_size={global_batch_size}; micro-batch sizes that "
                         f"do: {sizes}")
    return micro, per_rank // micro


def _data_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The fields in which two data fingerprints (`TokenFile.fingerprint`) differ, compared
    where both record one (a version-1 file has no vocabulary size or checksum)."""
    return [key for key in ("n_tokens", "n_docs", "vocab_size", "checksum")
            if saved.get(key) is not None and current.get(key) is not None and saved[key] != current[key]]


@dataclass
class GlobalOrder:
    """The run's sample order and position: one permutation of `n_samples` per epoch, from
    ``(seed, epoch)`` (``shuffle=False``: the file's order), and a cursor (`epoch`, `consumed`
    samples of it) that is the same on every rank. A global batch that would run past the end
    of an epoch starts the next one (the remainder is dropped: every global batch has the
    same size).

    `fingerprint`: what identifies the data (e.g. `TokenFile.fingerprint()`), saved with the
    position; a saved position of other data is refused on load unless
    `allow_different_data`. `order_version`: see the module docstring (a loaded position
    sets it)."""

    n_samples: int
    global_batch_size: int
    seed: int = 0
    epoch: int = 0
    consumed: int = 0
    shuffle: bool = True
    fingerprint: dict[str, Any] | None = None
    allow_different_data: bool = False
    order_version: int = ORDER_VERSION
    _cache: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 1 <= self.global_batch_size <= self.n_samples:
            raise ValueError(f"global_batch_size={self.global_batch_size}: must be between 1 and the "
                             f"{self.n_samples} samples of an epoch")
        if self.fingerprint is not None and not isinstance(self.fingerprint, dict):
            raise ValueError(f"GlobalOrder(fingerprint={self.fingerprint!r}): expected a dict "
                             "(TokenFile.fingerprint()) or None")
        _check_order_version(self.order_version)

    def ids(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """The sample ids at positions ``start..stop - 1`` of epoch `epoch`'s order (int64;
        computed for those positions only)."""
        if not 0 <= start <= stop <= self.n_samples:
            raise ValueError(f"positions {start}..{stop}: must lie within the {self.n_samples} samples of an epoch")
        return self.ids_at(epoch, np.arange(start, stop, dtype=np.int64))

    def ids_at(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The sample ids at `positions` (int64, each in ``[0, n_samples)``) of epoch
        `epoch`'s order: one evaluation for positions anywhere in the epoch (a rank's shares
        of several global batches at once)."""
        if not self.shuffle:
            return positions.astype(np.int64)
        if self.order_version == 1:  # a run saved before the computed order: its materialized permutation
            if self._cache.get("legacy_epoch") != epoch:
                self._cache.update(legacy_epoch=epoch,
                                   legacy=np.random.default_rng([self.seed, epoch]).permutation(self.n_samples))
            return self._cache["legacy"][positions]
        if self._cache.get("keys_epoch") != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._cache.update(keys_epoch=epoch, keys=rng.integers(0, 2**64, size=_ROUNDS, dtype=np.uint64))
        return permuted(positions.astype(np.uint64), self.n_samples, self._cache["keys"])

    def order(self, epoch: int) -> np.ndarray:
        """The whole permutation of epoch `epoch` (O(n_samples) memory: for inspection and
        tests; the loader asks `peek` for one global batch at a time)."""
        return self.ids(epoch, 0, self.n_samples)

    def has_batch(self) -> bool:
        """Whether the cursor's epoch has a whole global batch left."""
        return self.consumed + self.global_batch_size <= self.n_samples

    def peek(self) -> np.ndarray:
        """The sample ids of the global batch at the cursor (moved to the next epoch first
        when this one is used up); the cursor stays."""
        if not self.has_batch():
            self.epoch, self.consumed = self.epoch + 1, 0
        start, stop, at = (self.consumed, self.consumed + self.global_batch_size,
                            (self.epoch, self.shuffle, self.seed, self.order_version))
        window = self._cache.get("window")  # the ids of a few batches ahead: one evaluation for several
        if window is None or window[0] != at or not window[1] <= start < stop <= window[1] + window[2].size:
            ahead = min(self.n_samples, start + max(self.global_batch_size, WINDOW))
            window = self._cache["window"] = (at, start, self.ids(self.epoch, start, ahead))
        return window[2][start - window[1]:stop - window[1]]

    def advance(self) -> None:
        """Move the cursor past the global batch `peek` returns."""
        self.peek()
        self.consumed += self.global_batch_size

    def next_global_batch(self) -> np.ndarray:
        """The sample ids of the next global batch; advances the cursor."""
        batch = self.peek()
        self.advance()
        return batch

    def step_samples(self, dp_rank: int, dp_size: int, micro_batch_size: int | None = None) -> list[np.ndarray]:
        """This rank's micro-batches (sample ids) of the next global batch: rank ``r`` takes the
        ``r``-th contiguous share, cut into micro-batches in order. Every rank must call it
        once per optimizer step (the cursor is global)."""
        micro, accumulation = split_global_batch(self.global_batch_size, dp_size, micro_batch_size)
        share = self.next_global_batch()[dp_rank * micro * accumulation:(dp_rank + 1) * micro * accumulation]
        return [share[i * micro:(i + 1) * micro] for i in range(accumulation)]

    def state_dict(self) -> dict[str, Any]:
        """The position: plain integers, independent of the number of ranks (and the data's
        fingerprint, when the order has one)."""
        state: dict[str, Any] = {"seed": self.seed, "epoch": self.epoch, "consumed": self.consumed,
                                 "n_samples": self.n_samples, "global_batch_size": self.global_batch_size,
                                 "shuffle": int(self.shuffle), "order_version": self.order_version}
        if self.fingerprint is not None:
            state["fingerprint"] = dict(self.fingerprint)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Seek to a saved position (no batch is replayed). The corpus must have the same
        number of samples, and when both the saved position and this order have a data
        fingerprint, the same data (unless `allow_different_data`). A position saved without
        ``order_version`` (before the computed order) continues in order version 1."""
        if int(state["n_samples"]) != self.n_samples:
            raise ValueError(f"the saved data position is over {state['n_samples']} samples, this corpus has "
                             f"{self.n_samples}: not the same data")
        saved = state.get("fingerprint")
        if saved is not None and self.fingerprint is not None and not self.allow_different_data:
            differ = _data_differences(saved, self.fingerprint)
            if differ:
                raise ValueError(f"the saved data position is of other data (different {', '.join(differ)}): saved "
                                 f"{saved}, this run's {self.fingerprint}; to continue on this data from the saved "
                                 "position anyway, pass allow_different_data=True")
        version = int(state.get("order_version", 1))
        _check_order_version(version)
        self.seed, self.epoch, self.consumed = int(state["seed"]), int(state["epoch"]), int(state["consumed"])
        self.shuffle = bool(state.get("shuffle", self.shuffle))
        self.order_version = version
        self._cache.clear()


def _check_order_version(version: Any) -> None:
    if version not in (1, 2):
        raise ValueError(f"order_version={version!r}: known order versions are 1 (the materialized permutation of "
                         f"runs before) and {ORDER_VERSION} (the computed one); a newer dream_trainer may have "
                         "saved it")

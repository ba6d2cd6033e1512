"""`ModelFacts`: what the trainer knows about its models beyond the modules themselves —
which model owns each parameter, and the training FLOPs per token or sample — owned by the
trainer as ``trainer.model_facts``. Needs no trainer: the models are passed in."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

_UNSET: Any = object()  # FLOPs per token: not set, estimated on the first read


class ModelFacts:
    """Parameter owners and model FLOPs (see the module docstring)."""

    def __init__(self) -> None:
        self._owners: dict[int, str] = {}  # id(parameter) -> model name
        self._flops_per_token: float | None = _UNSET  # set by the user, else estimated once
        self._estimated: float | None = _UNSET
        self.flops_per_sample: float | None = None

    def index(self, models: dict[str, nn.Module]) -> None:
        """Record which model owns each parameter (call it with the sharded parameters
        registered), and estimate the FLOPs again at the next read."""
        self._owners = {id(p): name for name, model in models.items() for p in model.parameters()}
        self._estimated = _UNSET

    def owner(self, parameter: Any) -> str | None:
        """The name of the model `parameter` belonged to when indexed (None: unknown)."""
        return self._owners.get(id(parameter))

    def flops_per_token(self, configured: bool, estimate: Callable[[], float | None]) -> float | None:
        """The value set, else `estimate()`'s, computed once per `index` (`configured`:
        models exist to estimate from; else None, estimated at a later read)."""
        if self._flops_per_token is not _UNSET:
            return self._flops_per_token
        if self._estimated is _UNSET:
            if not configured:
                return None
            self._estimated = check_flops("estimate_model_flops_per_token()", estimate())
        return self._estimated

    def set_flops_per_token(self, value: float | None) -> None:
        self._flops_per_token = check_flops("model_flops_per_token", value)

    def set_flops_per_sample(self, value: float | None) -> None:
        self.flops_per_sample = check_flops("model_flops_per_sample", value)


def dense_flops_per_token(models: Iterable[nn.Module]) -> float:
    """``6 * N``: the training FLOPs per token of a dense transformer (Kaplan et al. 2020,
    "Scaling Laws for Neural Language Models": 2N forward, 4N backward), N being the
    parameters outside embedding lookups (``nn.Embedding``, ``nn.EmbeddingBag``: a lookup
    does no matmul), each counted once: a weight tied to an output layer counts, as that
    layer's. Sharded parameters (DTensor) count at their full size, so every rank and
    layout gets the same number. Left out: attention's sequence-length term (add
    `attention_flops_per_token`; `transformer_flops_per_token` is both); frozen parameters
    count as trained. Biases and norm weights count too (a matmul-only FLOP counter does
    not see them: about ``1 / d_model`` of the total)."""
    seen: set[int] = set()
    n = 0
    for model in models:
        for module in model.modules():
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
                continue
            for p in module.parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    n += p.numel()
    return 6.0 * n


def attention_flops_per_token(n_layers: int, d_model: int, seq_len: int, causal: bool = True) -> float:
    """Training FLOPs per token of attention's scores and weighted sum (``Q K^T`` and
    ``P V``, forward and backward): ``12 * n_layers * d_model * seq_len``, where `d_model`
    is the query width (heads x head dim; grouped-query attention scores every query head),
    and **half that when `causal`**: a causal mask leaves half the score matrix unneeded,
    which causal kernels (FlashAttention, SDPA's flash and memory-efficient backends, flex
    attention's block mask) skip, so it is not counted as work (counting it lets MFU pass
    100 % on those kernels; torchtitan #4300/#4366). A block-causal (packed documents) mask
    needs less still; it is counted as causal. The projections are in
    `dense_flops_per_token`."""
    for name, value in (("n_layers", n_layers), ("d_model", d_model), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"attention_flops_per_token({name}={value!r}) is invalid: expected an int >= 0")
    full = 12.0 * n_layers * d_model * seq_len
    return full / 2 if causal else full


def transformer_flops_per_token(models: Iterable[nn.Module], n_layers: int, d_model: int, seq_len: int,
                                causal: bool = True) -> float:
    """`dense_flops_per_token` of `models` plus `attention_flops_per_token`: the training
    FLOPs per token of a decoder (or, ``causal=False``, an encoder) transformer."""
    return dense_flops_per_token(models) + attention_flops_per_token(n_layers, d_model, seq_len, causal)


def check_flops(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} is invalid: expected FLOPs as a finite number > 0, or None (unknown)")
    return float(value)



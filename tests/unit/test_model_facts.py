"""`ModelFacts` on its own: parameter owners, FLOPs set, estimated once, invalid values."""

from __future__ import annotations

import pytest
from torch import nn

from dream_trainer.trainer.model_facts import ModelFacts


def test_owners_follow_the_last_index():
    facts, a, b = ModelFacts(), nn.Linear(2, 2), nn.Linear(2, 2)
    facts.index({"a": a, "b": b})
    assert facts.owner(a.weight) == "a" and facts.owner(b.bias) == "b"
    facts.index({"b": a})
    assert facts.owner(a.weight) == "b" and facts.owner(b.weight) is None


def test_flops_are_estimated_once_per_index_and_a_set_value_wins():
    facts, calls = ModelFacts(), []

    def estimate() -> float:
        calls.append(1)
        return 60.0

    assert facts.flops_per_token(False, estimate) is None and calls == []  # no models yet: later
    assert facts.flops_per_token(True, estimate) == 60.0
    assert facts.flops_per_token(True, estimate) == 60.0 and len(calls) == 1
    facts.index({})
    assert facts.flops_per_token(True, estimate) == 60.0 and len(calls) == 2
    facts.set_flops_per_token(7)
    assert facts.flops_per_token(True, estimate) == 7.0 and len(calls) == 2
    facts.set_flops_per_token(None)  # unknown, on purpose: not estimated
    assert facts.flops_per_token(True, estimate) is None


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "6e9"])
def test_invalid_flops_are_refused_with_the_name_and_value(bad):
    facts = ModelFacts()
    with pytest.raises(ValueError, match=r"model_flops_per_sample=.* is invalid"):
        facts.set_flops_per_sample(bad)
    with pytest.raises(ValueError, match=r"estimate_model_flops_per_token\(\)=.* is invalid"):
        facts.flops_per_token(True, lambda: bad)

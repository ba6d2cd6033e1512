"""``model_flops_per_token`` of the examples' trainers (GPT, Llama) checked against
``torch.utils.flop_counter.FlopCounterMode`` over a real forward and backward of each model.

The rule compared (``dream_trainer.trainer.model_facts.attention_flops_per_token``): 6 x
the parameters outside embeddings, plus attention's ``12 * n_layers * d_model * seq_len``,
counted at half for a causal model. SDPA runs on its math backend here, so the counter sees
attention as the ``bmm`` it computes: the full score matrix, masked. The comparison counts
those ``bmm`` FLOPs at half too, so both sides follow one rule. Tolerance: `TOLERANCE`, the
share of biases and norm weights (in 6N, invisible to a matmul counter: about
``1 / d_model``) with room; dropping the attention term or
counting it in full fails (attention is 7 % of these models at half).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from dream_trainer import Callback, StopTraining
from dream_trainer.trainer.model_facts import attention_flops_per_token, dense_flops_per_token

from tests.demos import load

TOLERANCE = 0.02  # relative
SEQ = 128
ARGS = ["--n-chars", "20000", "--d-model", "128", "--n-layer", "2", "--n-head", "4", "--block-size", str(SEQ)]


class _Facts(Callback[Any]):
    """Reads the trainer's FLOPs per token after `configure`, then ends the run."""

    def post_configure(self) -> None:
        trainer = self.trainer
        self.flops = trainer.model_flops_per_token
        self.config = trainer.llama_config if hasattr(trainer, "llama_config") else trainer.gpt_config
        self.model_cls = type(trainer.model)
        raise StopTraining("FLOPs read")


def _counted(model: torch.nn.Module, seq_len: int, vocab: int, causal: bool = True) -> tuple[float, float]:
    """(FLOPs per token under the rule, attention's share of them) from FlopCounterMode over
    one forward and backward of `model` on a batch of 2 x `seq_len`."""
    torch.manual_seed(0)
    tokens = torch.randint(0, vocab, (2, seq_len))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens.reshape(-1)).backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    attention = counts.get("aten.bmm", 0)  # only attention uses bmm in these models (math SDPA)
    total = counter.get_total_flops() - (attention / 2 if causal else 0)  # causal: the masked half is no work
    return total / tokens.numel(), (attention / 2 if causal else attention) / tokens.numel()


@pytest.mark.parametrize("example", ["gpt", "llama"])
def test_model_flops_per_token_matches_the_flop_counter(example, tmp_path):
    facts = _Facts()
    load(example).main([*ARGS, "--root-dir", str(tmp_path), "--run-name", example], callbacks=[facts])
    model = facts.model_cls(facts.config)
    model.init_weights()
    counted, attention = _counted(model, SEQ, facts.config.vocab_size)
    assert attention > 0.05 * counted  # attention is a real share of these models
    print(f"{example}: model_flops_per_token {facts.flops:.0f}, counted {counted:.0f}, ratio {facts.flops / counted:.4f}")
    assert facts.flops == pytest.approx(counted, rel=TOLERANCE), (facts.flops, counted)
    # The check has teeth: leaving attention out, or counting its masked half, drifts past it.
    assert dense_flops_per_token([model]) != pytest.approx(counted, rel=TOLERANCE)
    assert facts.flops + attention != pytest.approx(counted, rel=TOLERANCE)


def test_attention_flops_rule_and_its_errors():
    assert attention_flops_per_token(2, 128, 64, causal=False) == 12 * 2 * 128 * 64
    assert attention_flops_per_token(2, 128, 64) == 6 * 2 * 128 * 64  # causal: half
    with pytest.raises(ValueError, match=r"attention_flops_per_token\(seq_len=-1\) is invalid"):
        attention_flops_per_token(2, 128, -1)

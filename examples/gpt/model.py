"""A tiny GPT (decoder-only transformer) in plain PyTorch.

Designed to be friendly to meta-device construction and parallelism:

* no registered buffers -- every tensor is a parameter initialized by
  :meth:`GPT.init_weights`, so ``to_empty`` + ``init_weights`` fully
  materializes the model;
* attention uses separate ``q_proj``/``k_proj``/``v_proj``/``o_proj`` linears
  and derives the number of (local) heads from the projected width, so the
  projections can be sharded colwise/rowwise by tensor parallelism;
* no weight tying between the token embedding and ``lm_head``.

Packed documents (a `dream_trainer.data.TokenLoader` with ``document_info=True``):
``forward(idx, position_ids, document_ids)`` embeds each token's position in its document and
lets attention see only the earlier tokens of the same document (a block-causal mask:
SDPA with a boolean mask, or flex attention with ``GPTConfig(attention="flex")``). Without
them the model is the plain causal one, unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from dream_trainer.context_parallel import sequence_positions
from dream_trainer.data.documents import block_causal_mask, flex_block_mask
from dream_trainer.trainer.model_facts import transformer_flops_per_token

ATTENTION = ("sdpa", "flex")


@dataclass
class GPTConfig:
    """Hyperparameters of :class:`GPT`."""

    vocab_size: int
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    dropout: float = 0.0
    attention: str = "sdpa"
    """How a document mask is applied (only with ``document_ids``): ``"sdpa"``, a boolean
    ``(B, 1, T, T)`` mask (any device, eager or compiled); ``"flex"``, a flex-attention
    BlockMask (skips the blocks with no pair allowed; fast only under ``torch.compile``,
    no dropout)."""

    def __post_init__(self) -> None:
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})"
            )
        if self.attention not in ATTENTION:
            raise ValueError(f"GPTConfig(attention={self.attention!r}): use one of {ATTENTION}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention via ``scaled_dot_product_attention``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d = config.d_model
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.o_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, mask: Any = None) -> torch.Tensor:
        """`mask`: None (causal), a boolean ``(B, 1, T, T)`` SDPA mask or a flex BlockMask."""
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # Local head count: correct even when the projections are sharded.
        n_head = q.shape[-1] // self.head_dim
        q, k, v = (t.view(B, T, n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        elif isinstance(mask, torch.Tensor):
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        else:
            if dropout:
                raise ValueError(f"GPTConfig(attention='flex') has no attention dropout (dropout={dropout}): "
                                 "use attention='sdpa' or dropout=0")
            from torch.nn.attention.flex_attention import flex_attention

            if q.device.type == "cpu":  # torch 2.13's compiled CPU flex kernel cannot lower a view of the
                q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # projections' 2-D output
            y = flex_attention(q, k, v, block_mask=mask)
        y = y.transpose(1, 2).reshape(B, T, n_head * self.head_dim)
        return self.o_proj(y)


class MLP(nn.Module):
    """Position-wise feed-forward network: ``fc1 -> GELU -> fc2``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.d_model, 4 * config.d_model)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * config.d_model, config.d_model)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.act(self.fc1(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, mask: Any = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x), mask))
        x = x + self.mlp(self.ln2(x))
        return x


class GPT(nn.Module):
    """Decoder-only transformer language model.

    ``forward(idx[B, T]) -> logits[B, T, vocab_size]`` with ``T <= block_size``; packed
    documents: ``forward(idx, position_ids, document_ids)`` (``int64`` ``(B, T)`` each, a
    `DocumentBatch`'s; position ids must be below ``block_size``).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.block_size, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids to logits; cut into pipeline stages (dream_trainer's
        ``PipelineLayout``), a stage without the embeddings takes the previous stage's
        hidden states, and one without the head returns its own. `position_ids`: each
        token's position (default: ``arange(T)``); `document_ids`: attention stays within
        a document (a block-causal mask; default: causal over the whole sequence)."""
        if self.tok_emb is None:
            x = idx
        else:
            _, T = idx.shape
            if T > self.config.block_size:  # (context parallel: T is this rank's share)
                raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
            if position_ids is None:
                position_ids = sequence_positions(T, idx.device)  # arange(T); context parallel: this rank's part
            x = self.drop(self.tok_emb(idx) + self.pos_emb(position_ids))
        mask = None
        if document_ids is not None:
            mask = flex_block_mask(document_ids) if self.config.attention == "flex" else block_causal_mask(document_ids)
        for block in self.blocks:
            x = block(x, mask)
        return x if self.lm_head is None else self.lm_head(self.ln_f(x))

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialize every parameter in place, deterministically given the
        global torch seed. Safe to call after ``to_empty`` from a meta build."""
        residual_scale = 1.0 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if name.endswith(("o_proj", "fc2")):
                    module.weight.mul_(residual_scale)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Total number of (optionally only trainable) parameter elements."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token at sequence length `seq_len`: 6 x the parameters outside
        the embeddings plus causal attention, counted at half (see
        `dream_trainer.trainer.model_facts.attention_flops_per_token`). Counts the blocks this
        module holds (a pipeline stage: its own)."""
        return transformer_flops_per_token([self], len(self.blocks), self.config.d_model, seq_len, causal=True)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over the ``B*T`` positions whose target is not -100
    (``cross_entropy``'s ``ignore_index``: a document loader's padding and boundaries)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))

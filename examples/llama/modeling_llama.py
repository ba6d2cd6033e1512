"""A small Llama-style decoder in plain PyTorch, laid out like Hugging Face's
``LlamaForCausalLM`` (the same module names: ``model.embed_tokens``,
``model.layers.N.self_attn.q_proj``, ``mlp.gate_proj``, ``input_layernorm``, ``lm_head``), random
init, no download.

What makes it a different shape from the GPT demo: rotary position embeddings (a
non-persistent ``inv_freq`` buffer, recomputed by ``init_weights`` after a meta-device
build), RMSNorm, grouped-query attention (fewer key/value heads than query heads), a SwiGLU
MLP without biases, and the output head tied to the token embedding.

Packed documents (a `dream_trainer.data.TokenLoader` with ``document_info=True``):
``forward(input_ids, position_ids, document_ids)`` rotates by each token's position in its
document and masks attention block-causally (``dream_trainer.data.documents``); without them
the model is the plain causal one, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from dream_trainer.context_parallel import sequence_positions
from dream_trainer.data.documents import block_causal_mask
from dream_trainer.trainer.model_facts import transformer_flops_per_token


@dataclass
class LlamaConfig:
    """Hyperparameters (Hugging Face's names)."""

    vocab_size: int
    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size={self.hidden_size} must be divisible by "
                             f"num_attention_heads={self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class LlamaRotaryEmbedding(nn.Module):
    """``cos``/``sin`` of the rotary angles; ``inv_freq`` is a buffer that is not saved."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.head_dim, self.theta = config.head_dim, config.rope_theta
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self, device: torch.device | None = None) -> torch.Tensor:
        steps = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float()
        return 1.0 / (self.theta ** (steps / self.head_dim))

    def reset_parameters(self) -> None:  # after to_empty: the buffer holds garbage
        self.inv_freq.copy_(self._inv_freq(self.inv_freq.device))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`positions`: ``(T,)`` (one for the batch) or ``(B, T)``: ``(.., T, head_dim)``."""
        angles = positions[..., None].float() * self.inv_freq
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class LlamaAttention(nn.Module):
    """Grouped-query causal attention. The number of (local) heads is read from the
    projected width, so tensor parallelism can shard the projections by heads."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        d, h = config.hidden_size, config.head_dim
        self.head_dim = h
        self.groups = config.num_attention_heads // config.num_key_value_heads
        self.q_proj = nn.Linear(d, config.num_attention_heads * h, bias=False)
        self.k_proj = nn.Linear(d, config.num_key_value_heads * h, bias=False)
        self.v_proj = nn.Linear(d, config.num_key_value_heads * h, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * h, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """`mask`: None (causal) or a boolean ``(B, 1, T, T)`` SDPA mask."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, k, cos, sin)
        k, v = k.repeat_interleave(self.groups, dim=1), v.repeat_interleave(self.groups, dim=1)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if position_ids is None:  # context parallel: this rank's positions
            cos, sin = self.rotary_emb(x, sequence_positions(input_ids.shape[1], input_ids.device))
        else:
            cos, sin = (t[:, None] for t in self.rotary_emb(x, position_ids))  # (B, 1, T, head_dim): over the heads
        mask = None if document_ids is None else block_causal_mask(document_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """``forward(input_ids[B, T]) -> logits[B, T, vocab_size]``; packed documents:
    ``forward(input_ids, position_ids, document_ids)`` (``int64`` ``(B, T)`` each)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        if input_ids.shape[1] > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {input_ids.shape[1]} exceeds max_position_embeddings "
                             f"{self.config.max_position_embeddings}")
        return self.lm_head(self.model(input_ids, position_ids, document_ids))

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token at sequence length `seq_len`: 6 x the parameters outside
        the embedding (the tied head counts once) plus causal attention over the query heads,
        counted at half (`dream_trainer.trainer.model_facts.attention_flops_per_token`)."""
        width = self.config.num_attention_heads * self.config.head_dim
        return transformer_flops_per_token([self], len(self.model.layers), width, seq_len, causal=True)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Hugging Face's Llama init: normal(0, initializer_range) for linear and embedding
        weights, ones for the norms; the rotary buffers recomputed."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                if module is self.lm_head and self.config.tie_word_embeddings:
                    continue  # the embedding's weight
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, (LlamaRMSNorm, LlamaRotaryEmbedding)):
                module.reset_parameters()

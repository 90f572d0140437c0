"""OLMo 2's modules (declared in ``workers/families/olmo2.py``): the Llama family's attention, SwiGLU and
model with norms after attention and MLP, and q/k norms over the whole projection width.

Numerics follow ``transformers``' ``Olmo2ForCausalLM``: ``h = x + post_attention_norm(attention(x))``,
``h + post_ffn_norm(mlp(h))``; ``q = q_norm(wq x)`` and ``k = k_norm(wk x)`` before the heads are split
and rotated; every RMSNorm multiplies by its weight in fp32 and then casts (:class:`Olmo2RMSNorm`).

Under tensor parallelism (``width_norm`` in the family's plan) ``wq`` and ``wk`` hand their outputs
over as DTensors sharded on the width and the q/k norms' weights are sharded the same way, so the
norm's mean over the width is a DTensor reduction across the tp ranks and each rank keeps its heads.
"""

from __future__ import annotations

import torch
from torch import nn

from etrain.workers.families.layers import RMSNorm
from etrain.workers.families.llama_model import Llama, LlamaAttention, SwiGLU
from etrain.workers.protocol.run_config import ModelConfig

__all__ = ["Olmo2", "Olmo2Attention", "Olmo2Block", "Olmo2RMSNorm", "build"]


class Olmo2RMSNorm(RMSNorm):
    """Multiplies by the weight in fp32 and then casts back (``transformers``' Olmo2RMSNorm); Llama's
    casts first. Equal in fp32, one rounding apart in bf16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * self.normalized(x)).to(x.dtype)


class Olmo2Attention(LlamaAttention):
    """Llama's grouped-query attention with RoPE, q and k normalised over their whole width first."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.q_norm = Olmo2RMSNorm(config.n_heads * config.head_dim, config.norm_eps)
        self.k_norm = Olmo2RMSNorm(config.kv_heads * config.head_dim, config.norm_eps)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, seq, _ = x.shape
        q = self.q_norm(self.wq(x)).view(batch, seq, -1, self.head_dim)
        k = self.k_norm(self.wk(x)).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        return q, k, v


class Olmo2Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attention = Olmo2Attention(config)
        self.post_attention_norm = Olmo2RMSNorm(config.d_model, config.norm_eps)
        self.feed_forward = SwiGLU(config)
        self.post_ffn_norm = Olmo2RMSNorm(config.d_model, config.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_norm(self.attention(x))
        return x + self.post_ffn_norm(self.feed_forward(x))


class Olmo2(Llama):
    """The Llama model with OLMo 2 blocks and final norm (tied embeddings allowed, as transformers does)."""

    block = Olmo2Block
    final_norm = Olmo2RMSNorm


def build(config: ModelConfig) -> nn.Module:
    return Olmo2(config)

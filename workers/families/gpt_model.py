"""The built-in GPT-style decoder's modules (declared in ``workers/families/gpt.py``).

Learned position embeddings, pre-norm LayerNorm blocks, GELU MLP, biases on every projection, an
untied output head; cut like every family (``workers/families/layers.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from etrain.workers.families import check_shape
from etrain.workers.families.layers import run_trunk
from etrain.workers.families.ring_attention import chunk_positions, ring_attention
from etrain.workers.protocol.run_config import ModelConfig

__all__ = ["GPT", "Attention", "FeedForward", "TransformerBlock", "build"]


class Attention(nn.Module):
    """Causal multi-head self-attention.

    Heads are read from the local projection width (``wq.out_features // head_dim``), so the same
    code runs unsharded and tensor-parallel (where each rank holds n_heads / tp heads).

    ``cp_group``: set by the engine's ``apply_cp`` under context parallelism; the input is then this rank's
    two chunks of every sequence and attention runs as a ring over the group
    (``workers/families/ring_attention.py``).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        d = config.d_model
        self.head_dim = config.head_dim
        self.wq = nn.Linear(d, d)
        self.wk = nn.Linear(d, d)
        self.wv = nn.Linear(d, d)
        self.wo = nn.Linear(d, d)
        self.cp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        # -1 heads: the local head count (all heads unsharded, n_heads / tp under tensor parallelism).
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if self.cp_group is not None:
            full = seq * torch.distributed.get_world_size(self.cp_group)
            out = ring_attention(q, k, v, group=self.cp_group, seq_len=full)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).reshape(batch, seq, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(config.d_model, config.ffn_dim)
        self.w2 = nn.Linear(config.ffn_dim, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.d_model)
        self.attention = Attention(config)
        self.ffn_norm = nn.LayerNorm(config.d_model)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    """Decoder-only language model. Parts a pipeline stage does not own are ``None``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        check_shape(config)
        self.config = config
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_embeddings: nn.Embedding | None = nn.Embedding(config.seq_len, config.d_model)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config) for i in range(config.n_layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(config.d_model)
        self.output: nn.Linear | None = nn.Linear(config.d_model, config.vocab_size, bias=False)
        #: context parallelism (``apply_cp``): the input is this rank's chunks, embedded at their true positions
        self.cp_group = None

    def forward(self, tokens_or_hidden: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens ``[batch, seq]`` → logits ``[batch, seq, vocab]`` on a whole model; a pipeline stage
        maps whatever its predecessor produced to what its successor expects; with ``targets``, the last stage returns the mean loss (``run_trunk``)."""
        h = tokens_or_hidden
        if self.tok_embeddings is not None:
            if self.cp_group is None:
                positions = torch.arange(h.shape[1], device=h.device)
            else:
                cp, rank = torch.distributed.get_world_size(self.cp_group), torch.distributed.get_rank(self.cp_group)
                positions = chunk_positions(h.shape[1] * cp, cp, rank, device=h.device)
            h = self.tok_embeddings(h) + self.pos_embeddings(positions)
        return run_trunk(self, h, targets)


def build(config: ModelConfig) -> nn.Module:
    return GPT(config)

"""The Llama family's modules (declared in ``workers/families/llama.py``): Llama 2/3, Mistral, Qwen2, Qwen3
as one decoder, cut like every family (``workers/families/layers.py``).

Numerics follow ``transformers``' ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM`` /
``Qwen3ForCausalLM`` (the tests compare logits with tiny random models made by ``transformers``):
RMSNorm computed in fp32, RoPE in the rotate-half convention on ``[cos, cos]`` / ``[sin, sin]``
halves, grouped-query attention with each kv head serving ``n_heads / n_kv_heads`` consecutive query
heads, SwiGLU ``w2(silu(w1 x) * w3 x)``. The family's declaration maps these names to Hugging Face's.

RoPE tables are plain (non-buffer) attributes computed on first use per (length, device): nothing
positional is in the state dict, and a model built on the ``meta`` device needs no buffer
re-initialisation after materialisation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from etrain.workers.families import check_shape
from etrain.workers.families.layers import RMSNorm, rope_inverse_frequencies, rotate_half, run_trunk
from etrain.workers.families.ring_attention import chunk_positions, ring_attention
from etrain.workers.protocol.run_config import ModelConfig

__all__ = ["Llama", "LlamaAttention", "LlamaBlock", "SwiGLU", "build"]


class LlamaAttention(nn.Module):
    """Causal grouped-query attention with RoPE; heads are read from the local projection widths,
    so the same code runs unsharded and tensor-parallel (n_heads / tp, n_kv_heads / tp per rank).

    ``cp_group``: set by the engine's ``apply_cp`` under context parallelism. The input is then this rank's
    two chunks of every sequence (``S / cp`` tokens, ``workers/families/ring_attention.py``): RoPE is applied at
    their true positions and attention runs as a ring over the group.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        d, hd = config.d_model, config.head_dim
        bias = config.attention_bias
        self.head_dim = hd
        self.n_rep = config.n_heads // config.kv_heads
        self.wq = nn.Linear(d, config.n_heads * hd, bias=bias != "none")
        self.wk = nn.Linear(d, config.kv_heads * hd, bias=bias != "none")
        self.wv = nn.Linear(d, config.kv_heads * hd, bias=bias != "none")
        self.wo = nn.Linear(config.n_heads * hd, d, bias=bias == "all")
        self.q_norm = RMSNorm(hd, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(hd, config.norm_eps) if config.qk_norm else None
        self._inv_freq = rope_inverse_frequencies(config)
        self._rope_cache: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.cp_group = None

    def _rope(self, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin tables ``[seq, head_dim]``: cached per (length, device) in eager mode; inside a
        compiled block (``training.compile``) computed in the graph, on the device, because a compiled
        region may not write to module state (and the compiler fuses the few element-wise ops)."""
        if torch.compiler.is_compiling():
            positions = torch.arange(seq, dtype=torch.float32, device=device)
            freqs = torch.outer(positions, self._inv_freq.to(device))
            emb = torch.cat((freqs, freqs), dim=-1)
            return emb.cos(), emb.sin()
        key = (seq, str(device))
        if key not in self._rope_cache:
            positions = torch.arange(seq, dtype=torch.float32, device="cpu")
            freqs = torch.outer(positions, self._inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            self._rope_cache[key] = (emb.cos().to(device), emb.sin().to(device))
        return self._rope_cache[key]

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as ``[batch, seq, local heads, head_dim]``, q and k normalised where the model says."""
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self._project(x)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [batch, heads, seq, head_dim]
        if self.cp_group is not None:
            return self._context_parallel(q, k, v, batch, seq)
        cos, sin = self._rope(seq, x.device)
        q = (q * cos.to(q.dtype)) + (rotate_half(q) * sin.to(q.dtype))
        k = (k * cos.to(k.dtype)) + (rotate_half(k) * sin.to(k.dtype))
        if self.n_rep > 1:
            k = k.repeat_interleave(self.n_rep, dim=1)
            v = v.repeat_interleave(self.n_rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def _context_parallel(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int, seq: int
    ) -> torch.Tensor:
        """This rank's ``seq`` tokens of a ``seq · cp`` sequence: RoPE at their true positions, ring attention."""
        cp = torch.distributed.get_world_size(self.cp_group)
        full = seq * cp
        positions = chunk_positions(full, cp, torch.distributed.get_rank(self.cp_group), device=q.device)
        cos, sin = self._rope(full, q.device)
        cos, sin = cos[positions], sin[positions]
        q = (q * cos.to(q.dtype)) + (rotate_half(q) * sin.to(q.dtype))
        k = (k * cos.to(k.dtype)) + (rotate_half(k) * sin.to(k.dtype))
        out = ring_attention(q, k, v, group=self.cp_group, seq_len=full)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLU(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(config.d_model, config.ffn_dim, bias=False)  # gate
        self.w2 = nn.Linear(config.ffn_dim, config.d_model, bias=False)  # down
        self.w3 = nn.Linear(config.d_model, config.ffn_dim, bias=False)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attention = LlamaAttention(config)
        self.ffn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.feed_forward = SwiGLU(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Decoder-only Llama-family model. Parts a pipeline stage does not own are ``None``.

    With ``tie_embeddings`` the output projection shares the embedding's weight (one parameter,
    reported once by ``named_parameters``); tied models run unpipelined (the planner refuses
    ``pp > 1`` for them, since the two ends would live on different stages). A family with another
    block or final norm subclasses it and sets :attr:`block` and :attr:`final_norm`.
    """

    block: type[nn.Module] = LlamaBlock
    final_norm: type[nn.Module] = RMSNorm

    def __init__(self, config: ModelConfig):
        super().__init__()
        check_shape(config)
        self.config = config
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleDict({str(i): self.block(config) for i in range(config.n_layers)})
        self.norm: nn.Module | None = self.final_norm(config.d_model, config.norm_eps)
        self.output: nn.Linear | None = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding's weight with the output projection (tied models, on one stage).

        Called again after anything that swaps parameters (tensor parallelism, ``to_empty``)."""
        if self.config.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def forward(
        self, tokens_or_hidden: torch.Tensor, carried: torch.Tensor | None = None, targets: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``carried``: a pipeline stage's second input, the earlier stages' routing statistics (a mixture of
        experts, ``run_trunk``); None on the first stage and without a pipeline."""
        h = tokens_or_hidden
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        return run_trunk(self, h, targets, carried)


def build(config: ModelConfig) -> nn.Module:
    return Llama(config)

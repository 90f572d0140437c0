"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) as one decoder, cut the same way as the GPT.

Numerics follow ``transformers``' ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM`` /
``Qwen3ForCausalLM`` (the tests compare logits with tiny random models made by ``transformers``):
RMSNorm computed in fp32, RoPE in the rotate-half convention on ``[cos, cos]`` / ``[sin, sin]``
halves, grouped-query attention with each kv head serving ``n_heads / n_kv_heads`` consecutive query
heads, SwiGLU ``w2(silu(w1 x) * w3 x)``.

Structure is the engine's convention (see ``workers/model.py``): ``tok_embeddings``, ``layers`` (a
``ModuleDict`` keyed by the global layer index), ``norm``, ``output``; a pipeline stage sets the
parts it does not own to ``None``. Projections carry Megatron role names (``wq/wk/wv`` and ``w1/w3``
column-parallel, ``wo`` and ``w2`` row-parallel), so the tensor-parallel plan is a table;
``workers/hf_config.py`` maps these names to Hugging Face's.

RoPE tables are plain (non-buffer) attributes computed on first use per (length, device): nothing
positional is in the state dict, and a model built on the ``meta`` device needs no buffer
re-initialisation after materialisation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from etrain.workers.protocol.run_config import ModelConfig, RopeScaling
from etrain.workers.model import run_trunk, validate_model_config


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """``inv_freq[i] = theta^(-2i/head_dim)``, then the config's scaling (linear or Llama 3.1's)."""
    dim = config.head_dim
    # Explicitly on CPU: a model built under ``torch.device('meta')`` still needs real frequencies.
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    return _llama3_scaled(inv_freq, scaling)


def _llama3_scaled(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by ``factor``, short ones kept, a smooth ramp between."""
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RMSNorm(nn.Module):
    """``weight * x / rms(x)`` computed in fp32 and cast back (``transformers``' LlamaRMSNorm).

    Written with elementary ops rather than ``nn.RMSNorm`` so that, under tensor/sequence
    parallelism, DTensor propagates any sharding of the non-normalised dims (the per-head q/k norms
    run on head-sharded activations).
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class LlamaAttention(nn.Module):
    """Causal grouped-query attention with RoPE; heads are read from the local projection widths,
    so the same code runs unsharded and tensor-parallel (n_heads / tp, n_kv_heads / tp per rank)."""

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

    def _rope(self, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (seq, str(device))
        if key not in self._rope_cache:
            positions = torch.arange(seq, dtype=torch.float32, device="cpu")
            freqs = torch.outer(positions, self._inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            self._rope_cache[key] = (emb.cos().to(device), emb.sin().to(device))
        return self._rope_cache[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [batch, heads, seq, head_dim]
        cos, sin = self._rope(seq, x.device)
        q = (q * cos.to(q.dtype)) + (_rotate_half(q) * sin.to(q.dtype))
        k = (k * cos.to(k.dtype)) + (_rotate_half(k) * sin.to(k.dtype))
        if self.n_rep > 1:
            k = k.repeat_interleave(self.n_rep, dim=1)
            v = v.repeat_interleave(self.n_rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
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
    ``pp > 1`` for them, since the two ends would live on different stages).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        validate_model_config(config)
        self.config = config
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleDict({str(i): LlamaBlock(config) for i in range(config.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(config.d_model, config.norm_eps)
        self.output: nn.Linear | None = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding's weight with the output projection (tied models, on one stage).

        Called again after anything that swaps parameters (tensor parallelism, ``to_empty``)."""
        if self.config.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens_or_hidden: torch.Tensor) -> torch.Tensor:
        h = tokens_or_hidden
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        return run_trunk(self, h)

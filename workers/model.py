"""Built-in GPT-style decoder, shaped so every parallel layout can cut it the same way.

Structure (torchtitan's convention, which the parallel engine relies on):

* ``layers`` is a ``ModuleDict`` keyed by the *global* layer index. A pipeline stage is the same
  model with the layers it does not own deleted and the embeddings / final norm / output set to
  ``None``, so parameter names (FQNs) are identical under every layout. That is what lets a
  checkpoint saved by one layout load under another (DCP matches tensors by FQN).
* Every projection is a plain ``nn.Linear`` named after its Megatron role (``wq``/``wk``/``wv``
  column-parallel, ``wo`` row-parallel; ``w1`` up column-parallel, ``w2`` down row-parallel), so the
  tensor-parallel plan is a table of names (``workers/parallelize.py``).
* No dropout: fp32 runs of different layouts must compute the same numbers.

Weights are initialised per parameter from a seed derived from its FQN (``workers/init.py``), so
every layout starts from identical parameters whether the model is built whole or on the meta
device and materialised shard by shard.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from etrain.workers.protocol.run_config import ModelConfig
from etrain.workers.protocol.errors import ConfigError


class Attention(nn.Module):
    """Causal multi-head self-attention.

    Heads are read from the local projection width (``wq.out_features // head_dim``), so the same
    code runs unsharded and tensor-parallel (where each rank holds n_heads / tp heads).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        d = config.d_model
        self.head_dim = config.head_dim
        self.wq = nn.Linear(d, d)
        self.wk = nn.Linear(d, d)
        self.wv = nn.Linear(d, d)
        self.wo = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        # -1 heads: the local head count (all heads unsharded, n_heads / tp under tensor parallelism).
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
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
        validate_model_config(config)
        self.config = config
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_embeddings: nn.Embedding | None = nn.Embedding(config.seq_len, config.d_model)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config) for i in range(config.n_layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(config.d_model)
        self.output: nn.Linear | None = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, tokens_or_hidden: torch.Tensor) -> torch.Tensor:
        """Tokens ``[batch, seq]`` → logits ``[batch, seq, vocab]`` on a whole model; a pipeline stage
        maps whatever its predecessor produced to what its successor expects."""
        h = tokens_or_hidden
        if self.tok_embeddings is not None:
            positions = torch.arange(h.shape[1], device=h.device)
            h = self.tok_embeddings(h) + self.pos_embeddings(positions)
        return run_trunk(self, h)


def run_trunk(model: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The part of a forward every architecture shares: the stage's blocks, then the final norm and
    the output projection where this stage owns them."""
    for layer in model.layers.values():
        h = layer(h)
    if model.norm is not None:
        h = model.norm(h)
    if model.output is not None:
        h = model.output(h)
    return h


def validate_model_config(config: ModelConfig) -> None:
    """Shape rules the model itself needs (the planner adds the parallel ones)."""
    if config.arch == "gpt" and config.d_model % config.n_heads:
        raise ConfigError(
            f"model.d_model={config.d_model} is not divisible by model.n_heads={config.n_heads}.",
            field="model.d_model",
            fix="pick d_model as a multiple of n_heads (head_dim = d_model / n_heads)",
        )
    for name in ("n_layers", "d_model", "n_heads", "vocab_size", "seq_len"):
        if getattr(config, name) < 1:
            raise ConfigError(f"model.{name} must be >= 1, got {getattr(config, name)}.", field=f"model.{name}")
    if config.arch == "llama":
        if config.n_heads % config.kv_heads:
            raise ConfigError(
                f"model.n_heads={config.n_heads} is not divisible by model.n_kv_heads={config.kv_heads}.",
                field="model.n_kv_heads",
                fix="grouped-query attention shares each kv head among n_heads / n_kv_heads query heads: "
                "pick n_kv_heads dividing n_heads",
            )
        if config.head_dim % 2:
            raise ConfigError(f"the head dimension {config.head_dim} is odd; RoPE rotates pairs.",
                              field="model.d_model", fix="use an even head_dim (d_model / n_heads)")


def build_model_skeleton(config: ModelConfig) -> nn.Module:
    """The architecture ``config.arch`` names, with uninitialised weights.

    Call it under ``torch.device("meta")`` to allocate nothing: the engine parallelises the meta
    model first and then materialises only each rank's shards (``workers/init.py``).
    """
    if config.arch == "llama":
        from etrain.workers.llama import Llama

        return Llama(config)
    return GPT(config)


def build_model(config: ModelConfig, seed: int) -> nn.Module:
    """Full model on CPU with deterministic weights (the same values the meta-device path gives)."""
    from etrain.workers.init import initialize_parameters

    model = build_model_skeleton(config)
    initialize_parameters(model, seed=seed, n_layers=config.n_layers)
    return model


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy over a micro-batch (fp32 for the reduction), as a plain tensor.

    Under tensor parallelism ``logits`` is a DTensor sharded by vocabulary (``Shard(-1)`` on the tp
    mesh, ``etrain.workers.parallelize.apply_tp``) and this must run, with its backward, inside
    ``torch.distributed.tensor.parallel.loss_parallel()`` (``etrain.workers.parallelize.loss_context``):
    there ``cross_entropy`` all-reduces the per-token max, sum of exponentials and target logit over
    the tp ranks, so no rank materialises the full logits. The result is a replicated scalar
    DTensor; its local value (the same on every tp rank) is returned, and ``to_local``'s backward
    hands the gradient back to the sharded logits, so callers treat both cases alike.
    """
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))
    if isinstance(loss, DTensor):
        loss = loss.to_local()
    return loss

"""Torch layers more than one family builds from: the shared trunk, RMSNorm and rotary embeddings.

Structure is the engine's convention (torchtitan's): a model has ``tok_embeddings``, ``layers`` (a
``ModuleDict`` keyed by the *global* layer index), ``norm`` and ``output``; a pipeline stage is the same
model with the parts it does not own set to ``None`` (or deleted from ``layers``), so parameter names
(FQNs) are identical under every layout and a checkpoint saved by one layout loads under another.
Projections carry Megatron role names (``wq/wk/wv``, ``w1/w3`` column-parallel, ``wo``/``w2``
row-parallel), so each family's tensor-parallel plan is a table of names (its ``tp_plan``). No dropout:
fp32 runs of different layouts must compute the same numbers.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from etrain.workers.families.head_loss import head_loss
from etrain.workers.protocol.run_config import ModelConfig, RopeScaling

__all__ = ["RMSNorm", "rope_inverse_frequencies", "rotate_half", "run_trunk"]


def run_trunk(
    model: nn.Module, h: torch.Tensor, targets: torch.Tensor | None = None, carried: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The part of a forward every family shares: the stage's blocks, then the final norm and the
    output projection where this stage owns them.

    With ``targets`` (the trainer's call) a stage that owns the output projection returns the mean loss
    instead of the logits, computed in chunks of ``model.loss_chunk_tokens`` tokens
    (``etrain.workers.families.head_loss``); other stages ignore them.

    The auxiliary-loss hook: a block may return ``(hidden, extra)`` (a mixture of experts' routing
    statistics, ``[2, n_experts]`` per layer); the extras of all the blocks go to
    ``model.auxiliary_loss(extras, rows=tokens)``, whose result is added to the loss (the logits are
    returned as they are). Under pipeline parallelism they ride with the activations: a stage without the
    output returns ``(hidden, carried)``, ``carried`` the running sum of every earlier layer's extras (this
    stage's added, in layer order), and the next stage takes it as its second input; the last stage's loss
    then sees the sum over all the layers, and the backward brings each stage the gradient of its own
    (``model.carried_layers`` says how many layers ``carried`` holds: all of them at the last stage).
    """
    extras = []
    for layer in model.layers.values():
        h = layer(h)
        if isinstance(h, tuple):
            h, extra = h
            extras.append(extra)
    if model.norm is not None:
        h = model.norm(h)
    if extras and (carried is not None or model.output is None):
        for extra in extras:  # summed in layer order, as one process sums them (load_balancing_loss)
            carried = extra if carried is None else carried + extra
        extras = [carried]
    if model.output is None:
        return (h, extras[0]) if extras else h
    auxiliary = None
    if extras:
        layers = model.config.n_layers if carried is not None else len(extras)
        auxiliary = model.auxiliary_loss(extras, rows=h.shape[0] * h.shape[1], layers=layers)
    if targets is not None:
        chunk = getattr(model, "loss_chunk_tokens", 0)
        compile_backend = getattr(model, "loss_compile_backend", None)  # training.compile (engine/compile.py)
        loss = head_loss(model.output, h, targets, chunk_tokens=chunk, compile_backend=compile_backend)
        return loss if auxiliary is None else loss + auxiliary
    return model.output(h)


class RMSNorm(nn.Module):
    """``weight * x / rms(x)`` computed in fp32 and cast back (``transformers``' LlamaRMSNorm).

    Written with elementary ops rather than ``nn.RMSNorm`` so that, under tensor/sequence
    parallelism, DTensor propagates any sharding of the non-normalised dims (the per-head q/k norms
    run on head-sharded activations) and reduces the mean over a sharded normalised dim (q/k norms
    over the whole projection width).
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        """``x / rms(x)`` in fp32."""
        x32 = x.float()
        return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self.normalized(x).to(x.dtype)


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """``inv_freq[i] = theta^(-2i/head_dim)``, then the config's scaling (linear or Llama 3.1's)."""
    dim = config.head_dim
    # Explicitly on CPU: a model built under ``torch.device('meta')`` still needs real frequencies.
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
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


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

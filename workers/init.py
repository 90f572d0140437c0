"""Layout-independent parameter initialisation, and materialising a meta-device model shard by shard.

Why a seed per parameter: the engine builds the model on the ``meta`` device, applies TP,
activation checkpointing, FSDP2 or the pipeline split, and only then allocates each rank's *local*
shards. For every layout to start from the same numbers, a parameter's initial value must not
depend on which other parameters a rank holds or in which order they are visited. So each
parameter's full initial tensor is drawn from its own CPU generator seeded by
``sha256(seed, canonical FQN)``, and a rank keeps the slice it owns. DTensor's own random ops are
layout-independent only on CUDA (its offset-based RNG tracker); this works on CPU and CUDA alike
and gives bit-identical weights on both.

The cost is one full parameter at a time as a transient (the largest is the embedding: vocab ×
d_model), never the whole model: peak init memory per rank is its shards plus the largest single
parameter. ``distribute_tensor(..., src_data_rank=None)`` cuts the local slice for any placement
(TP ``Shard``, FSDP2 ``Shard(0)``, both at once) without communication.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["canonical_fqn", "initial_value", "initialize_parameters", "materialize", "param_seed"]

#: Wrapper segments that torch inserts into parameter paths; checkpoints and init ignore them.
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")
_STD = 0.02


def canonical_fqn(name: str) -> str:
    """A parameter path with wrapper segments (activation checkpointing, compile, DDP) removed."""
    parts = [p for p in name.split(".") if p not in _WRAPPER_SEGMENTS]
    if parts and parts[0] == "module":  # DistributedDataParallel
        parts = parts[1:]
    return ".".join(parts)


def param_seed(seed: int, fqn: str) -> int:
    """A 63-bit seed for parameter ``fqn`` of a run seeded with ``seed``."""
    digest = hashlib.sha256(f"{seed}/{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def initial_value(fqn: str, shape: tuple[int, ...], *, seed: int, n_layers: int) -> torch.Tensor:
    """The full fp32 initial tensor of parameter ``fqn`` (CPU).

    GPT-2 / Llama style: biases 0, norm weights 1, every other weight N(0, 0.02), except the
    residual output projections (``wo``, ``w2``), scaled by 1/sqrt(2 · n_layers).
    """
    leaf = fqn.rsplit(".", 2)
    if fqn.endswith(".bias"):
        return torch.zeros(shape)
    if "norm" in fqn.split(".")[-2]:
        return torch.ones(shape)
    std = _STD / math.sqrt(2 * n_layers) if len(leaf) >= 2 and leaf[-2] in ("wo", "w2") else _STD
    generator = torch.Generator(device="cpu").manual_seed(param_seed(seed, fqn))
    return torch.randn(shape, generator=generator).mul_(std)  # in place: one full tensor, not two


@torch.no_grad()
def initialize_parameters(module: nn.Module, *, seed: int, n_layers: int) -> None:
    """Set every parameter of ``module`` (plain or DTensor, whole or sharded) to its initial value.

    ``named_parameters`` reports a tied weight once (under its first name, ``tok_embeddings``), so
    the output projection of a tied model takes the embedding's values, as in Hugging Face.
    """
    for name, param in module.named_parameters():
        fqn = canonical_fqn(name)
        full = initial_value(fqn, tuple(param.shape), seed=seed, n_layers=n_layers).to(param.dtype)
        if isinstance(param, DTensor):
            local = distribute_tensor(full.to(param.device_mesh.device_type), param.device_mesh,
                                      param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(full.to(param.device))


def materialize(module: nn.Module, *, device: torch.device, seed: int, n_layers: int) -> nn.Module:
    """Allocate a meta-device (possibly parallelised) module's local shards on ``device`` and
    initialise them; a module that is already real is left as it is."""
    if any(p.is_meta for p in module.parameters()):
        module.to_empty(device=device)
        tie_weights = getattr(module, "tie_weights", None)
        if tie_weights is not None:  # to_empty gives each name its own tensor
            tie_weights()
        initialize_parameters(module, seed=seed, n_layers=n_layers)
    return module

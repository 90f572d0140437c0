"""Layout-independent parameter initialisation, and materialising a meta-device model shard by shard.

Why a seed per parameter: the engine builds the model on the ``meta`` device, applies TP,
activation checkpointing, FSDP2 or the pipeline split, and only then allocates each rank's *local*
shards. For every layout to start from the same numbers, a parameter's initial value must not
depend on which other parameters a rank holds or in which order they are visited. So each
parameter's full initial tensor is drawn from its own generator seeded by ``sha256(seed, canonical
FQN)`` (:func:`param_seed`), and a rank keeps the slice it owns. DTensor's own random ops are
layout-independent only on CUDA (its offset-based RNG tracker); a generator per parameter is, on any
device.

Where the numbers are drawn: on the device the rank computes on (``rng_device``: the Trainer's
device, also under CPU offload, where the slice is then copied to the host). A CPU rank draws on a CPU
generator (the numbers every CPU test and checkpoint has always had); a CUDA rank on a CUDA generator
(Philox), directly in GPU memory. The two devices give different numbers, each the same for every
layout and rank count: CPU layouts match CPU layouts, GPU layouts GPU layouts (of one GPU model:
CUDA's generator hands elements to threads by the GPU's number of SMs, so another model may draw
others). Drawing on the host was what made a 1.24 B-parameter Llama take 6.8-13 s to build on an
H100: about 5 GB of normal samples from one CPU core (~0.5 GB/s), then copied to the GPU. On the GPU
the same draw is bound by memory bandwidth: 5 GB of writes at ~2-3 TB/s is a few milliseconds, plus a
few small launches per parameter (~150 of them). Measured on an H100 (torch 2.11): drawing all 1.24 B
values 12 ms; the whole Trainer build 0.10-0.12 s against 13.0 s with the host draw, a warm spare's
first build included (its CUDA context made in the background by then, ``workers/rank/device_info.py``;
a bare process's first build, context and kernels' loading included, 2.5 s). tests/gpu/test_cuda.py
holds a 0.78 B model's build under 1.5 s.

A sharded parameter (DTensor: TP ``Shard``, FSDP2 ``Shard(0)``, both at once) is still drawn whole and
then sliced (``distribute_tensor(..., src_data_rank=None)``: no communication). Drawing only the local
slice would need a generator whose numbers are addressable by element, which CUDA's Philox kernels
are not across tensor shapes (the element-to-thread mapping follows the tensor's size); the full draw
costs a rank at most the whole model's samples once (milliseconds on a GPU) and one full parameter
as a transient (the largest is the embedding: vocab x d_model, 1 GB fp32 for Llama 3's 128256 x 2048),
never the whole model: peak init memory per rank is its shards plus the largest single parameter. A
plain parameter is whole on its rank anyway: nothing is drawn that it does not keep.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from etrain.workers.families.model import build_model_skeleton, canonical_fqn
from etrain.workers.protocol.run_config import ModelConfig

__all__ = ["build_model", "initial_value", "initialize_parameters", "materialize", "param_seed"]

_STD = 0.02


def param_seed(seed: int, fqn: str) -> int:
    """A 63-bit seed for parameter ``fqn`` of a run seeded with ``seed``."""
    digest = hashlib.sha256(f"{seed}/{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def initial_value(
    fqn: str, shape: tuple[int, ...], *, seed: int, n_layers: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The full fp32 initial tensor of parameter ``fqn``, drawn on ``device`` with a generator of its own.

    GPT-2 / Llama style: biases 0, norm weights 1, every other weight N(0, 0.02), except the
    residual output projections (``wo``, ``w2``, and the stacked experts' ``w2``), scaled by
    1/sqrt(2 · n_layers). The numbers depend
    on ``seed``, ``fqn`` and the device type (CPU and CUDA generators differ), nothing else.
    """
    device = torch.device(device)
    leaf = fqn.rsplit(".", 2)
    if fqn.endswith(".bias"):
        return torch.zeros(shape, device=device)
    if "norm" in fqn.split(".")[-2]:
        return torch.ones(shape, device=device)
    # wo/w2 modules' weights, and a mixture of experts' stacked down projections (a parameter named w2)
    residual = (len(leaf) >= 2 and leaf[-2] in ("wo", "w2")) or (leaf[-1] == "w2" and len(shape) == 3)
    std = _STD / math.sqrt(2 * n_layers) if residual else _STD
    generator = torch.Generator(device=device).manual_seed(param_seed(seed, fqn))
    return torch.randn(shape, generator=generator, device=device).mul_(std)  # in place: one full tensor, not two


@torch.no_grad()
def initialize_parameters(
    module: nn.Module, *, seed: int, n_layers: int, rng_device: torch.device | str = "cpu"
) -> None:
    """Set every parameter of ``module`` (plain or DTensor, whole or sharded) to its initial value,
    drawn on ``rng_device`` (the rank's compute device) and copied to where the parameter lives.

    ``named_parameters`` reports a tied weight once (under its first name, ``tok_embeddings``), so
    the output projection of a tied model takes the embedding's values, as in Hugging Face.
    """
    for name, param in module.named_parameters():
        fqn = canonical_fqn(name)
        full = initial_value(fqn, tuple(param.shape), seed=seed, n_layers=n_layers, device=rng_device).to(param.dtype)
        if isinstance(param, DTensor):
            local = distribute_tensor(
                full.to(param.device_mesh.device_type), param.device_mesh, param.placements, src_data_rank=None
            ).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(full)  # copy_ moves it where the parameter lives (a no-op transfer on its device)


def materialize(
    module: nn.Module, *, device: torch.device, seed: int, n_layers: int, rng_device: torch.device | None = None
) -> nn.Module:
    """Allocate a meta-device (possibly parallelised) module's local shards on ``device`` and
    initialise them, drawn on ``rng_device`` (default: ``device``; the Trainer passes its compute
    device, which differs under CPU offload); a module that is already real is left as it is."""
    if any(p.is_meta for p in module.parameters()):
        module.to_empty(device=device)
        tie_weights = getattr(module, "tie_weights", None)
        if tie_weights is not None:  # to_empty gives each name its own tensor
            tie_weights()
        initialize_parameters(
            module, seed=seed, n_layers=n_layers, rng_device=device if rng_device is None else rng_device
        )
    return module


def build_model(config: ModelConfig, seed: int) -> nn.Module:
    """Full model on CPU with deterministic weights (the same values the meta-device path gives)."""
    model = build_model_skeleton(config)
    initialize_parameters(model, seed=seed, n_layers=config.n_layers)
    return model

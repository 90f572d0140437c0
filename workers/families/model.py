"""Build the model a ``ModelConfig`` names, from its family's modules, and the loss every family trains with.

Each family's torch modules live in ``workers/families/<name>_model.py`` (the module its declaration's
``model_module`` names, imported here by name: only a rank that builds that family loads it). Every
family is cut the same way (``workers/families/layers.py``): ``layers`` is a ``ModuleDict`` keyed by the
*global* layer index, a pipeline stage is the same model with the parts it does not own set to
``None``, so parameter names (FQNs) are identical under every layout and DCP checkpoints reshard.

Weights are initialised per parameter from a seed derived from its FQN (``workers/engine/init.py``), so
every layout starts from identical parameters whether the model is built whole or on the meta
device and materialised shard by shard.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from etrain.workers.families import check_shape, family
from etrain.workers.protocol.run_config import ModelConfig

__all__ = [
    "build_model_skeleton",
    "canonical_fqn",
    "cross_entropy_loss",
    "token_cross_entropy",
    "validate_model_config",
]

#: Wrapper segments that torch inserts into parameter paths; checkpoints and init ignore them.
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def validate_model_config(config: ModelConfig) -> None:
    """Shape rules the model itself needs (its family's; the planner adds the parallel ones)."""
    check_shape(config)


def build_model_skeleton(config: ModelConfig) -> nn.Module:
    """The model of the family ``config.arch`` names, with uninitialised weights.

    Call it under ``torch.device("meta")`` to allocate nothing: the engine parallelises the meta
    model first and then materialises only each rank's shards (``workers/engine/init.py``).
    """
    return importlib.import_module(family(config.arch).model_module).build(config)


def canonical_fqn(name: str) -> str:
    """A parameter path with wrapper segments (activation checkpointing, compile, DDP) removed."""
    parts = [p for p in name.split(".") if p not in _WRAPPER_SEGMENTS]
    if parts and parts[0] == "module":  # DistributedDataParallel
        parts = parts[1:]
    return ".".join(parts)


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy over a micro-batch (fp32 for the reduction), as a plain tensor.

    Under tensor parallelism ``logits`` is a DTensor sharded by vocabulary (``Shard(-1)`` on the tp
    mesh, ``etrain.workers.engine.parallelize.apply_tp``) and this must run, with its backward, inside
    ``torch.distributed.tensor.parallel.loss_parallel()`` (``etrain.workers.engine.parallelize.loss_context``):
    there ``cross_entropy`` all-reduces the per-token max, sum of exponentials and target logit over
    the tp ranks, so no rank materialises the full logits. The result is a replicated scalar
    DTensor; its local value (the same on every tp rank) is returned, and ``to_local``'s backward
    hands the gradient back to the sharded logits, so callers treat both cases alike.

    ``to_local`` returns a *view* of the local tensor, and a view as the output of a module wrapped by
    FSDP2 or ``replicate`` (dp × tp) makes torch warn on every forward that an in-place op on it would skip
    the pre-backward hook (it printed in every DP·TP rank log after each checkpoint); the copy of one
    number is free, and nothing in-place may then drop the hook.
    """
    loss = token_cross_entropy(logits, targets)
    if isinstance(loss, DTensor):
        loss = loss.to_local().clone()
    return loss


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy`` of ``[batch, seq, vocab]`` logits (upcast to fp32) against ``[batch, seq]`` targets."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))

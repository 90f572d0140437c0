"""What a checkpoint or an in-memory snapshot holds of a rank: FQN-keyed model and optimizer state, and RNG.

:func:`collect_state` gathers every model part's and optimizer's state into one dict that DCP saves or
fills (``workers/checkpoints/checkpoint.py``) and that ``workers/checkpoints/snapshot.py`` copies to host memory;
:func:`apply_state` hands a filled one back. Why it is built this way:

* **FQN-keyed state through torch's state-dict API.** ``get_model_state_dict`` /
  ``get_optimizer_state_dict(flatten_optimizer_state_dict=True)`` key every tensor by parameter name
  (``state.layers.0.attention.wq.weight.exp_avg``), whatever wraps the parameter: DDP, FSDP2 /
  ``replicate`` (DTensor shards), TP (DTensor), or a pipeline stage (the model with other layers
  deleted, names unchanged). DCP stores each DTensor's shards with their global offsets and reads
  back whatever slice the *loading* layout asks for, so resharding (FSDP2(2) → one process,
  TP2 → TP1, PP2 → PP1, ZeRO-3 → ZeRO-1, FSDP2×TP2 → FSDP2(4); ``tests/integration/
  test_checkpoint_dcp.py`` has the list it proves) needs no code of ours.
* **ZeRO-1 is ours.** ``ZeroRedundancyOptimizer`` has no FQN-keyed state dict (its own one needs a
  ``consolidate_state_dict`` gather to one rank). But its local optimizer (``zero.optim``) is a
  plain optimizer over the parameters this rank owns, and DSD accepts an optimizer covering a
  *subset* of the model's parameters. So each rank contributes the full, plain-tensor states of the
  parameters it owns; DCP writes every key once (by its owner), and a ZeRO-1 checkpoint is
  indistinguishable from a DDP one (FSDP2 loads it by slicing, and ZeRO-1 loads an FSDP2 one by
  asking for full tensors). After a load the outer optimizer's hyperparameters are re-synced from
  the local one (``ZeroRedundancyOptimizer.step`` copies outer → local), and groups a rank owns no
  parameter of get theirs from a rank that does (hyperparameters are stored per parameter).
* **Optimizers need not match parts one-to-one.** A pipeline rank may run one optimizer over its
  virtual stages; DSD wants one model per call and fails on optimizer parameters the model lacks.
  Each (part, optimizer) pair whose parameters only partly overlap gets a *view*: an optimizer of
  the same class over the overlap, sharing the per-parameter state, copied back after each call.
* **RNG is global, not per rank** (:func:`capture_rng_state`, stored in the checkpoint's ``extra``):
  the data sampler is global and the model has no dropout, and per-rank RNG would not survive a
  resize anyway.
"""

from __future__ import annotations

import random
import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from etrain.workers.protocol.errors import CheckpointError

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

__all__ = ["CollectedState", "apply_state", "capture_rng_state", "collect_state", "restore_rng_state"]

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass
class CollectedState:
    """What DCP saves or fills (``state``), and how to hand it back to each part and optimizer."""

    state: dict[str, Any]  # {"model": {fqn: tensor}, "optim": {flat key: value}}
    model_keys: list[tuple[str, ...]]  # per model part
    bindings: list[_Binding]


def collect_state(model_parts: list[nn.Module], optimizers: list[Optimizer]) -> CollectedState:
    """FQN-keyed model and (flattened) optimizer state of all parts, merged into one dict: what DCP
    saves and fills (and what the in-memory snapshots of ``workers/checkpoints/snapshot.py`` copy)."""
    model_state: dict[str, Any] = {}
    model_keys = []
    for part in model_parts:
        part_state = get_model_state_dict(part)
        _merge(model_state, part_state, "model")
        model_keys.append(tuple(part_state))
    optim_state: dict[str, Any] = {}
    bindings = _bind(model_parts, optimizers)
    for binding in bindings:
        part_state = get_optimizer_state_dict(binding.part, binding.optimizer, options=_OPTIONS)
        binding.sync_back(after_load=False)  # DSD may have initialised empty state on a view
        binding.keys = tuple(part_state)
        _merge(optim_state, part_state, "optimizer")
    return CollectedState(state={"model": model_state, "optim": optim_state}, model_keys=model_keys, bindings=bindings)


def apply_state(collected: CollectedState, model_parts: list[nn.Module], optimizers: list[Optimizer]) -> None:
    """Hand filled ``collected.state`` back to each part and optimizer (after a DCP load or a snapshot).

    DCP fills the merged dicts (non-tensor values by replacement), so each part and optimizer gets
    its own entries back out of them.
    """
    state = collected.state
    for part, keys in zip(model_parts, collected.model_keys):
        set_model_state_dict(part, {key: state["model"][key] for key in keys})
    for binding in collected.bindings:
        optim_state = {key: state["optim"][key] for key in binding.keys}
        set_optimizer_state_dict(binding.part, binding.optimizer, optim_state, options=_OPTIONS)
        binding.sync_back(after_load=True)
    _share_zero_hyperparameters(optimizers)


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy and torch RNG states as ``extra`` can store them (weights_only-loadable types)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:  # numpy is optional here
        pass
    else:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`; states it does not hold are left alone."""
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# -- binding optimizers to model parts ------------------------------------------------------------


class _Binding:
    """One (model part, optimizer) pairing as DSD sees it.

    ``optimizer`` is what DSD reads and writes: the caller's optimizer, ZeRO's local optimizer, or a
    view over the part's share of either. ``local`` is the optimizer that really steps (the
    view's state is copied back into it); ``zero`` the outer ZeRO wrapper whose hyperparameters
    must follow a load.
    """

    def __init__(
        self,
        part: nn.Module,
        optimizer: Optimizer,
        local: Optimizer,
        zero: ZeroRedundancyOptimizer | None,
        local_groups: list[dict[str, Any]] | None = None,
    ):
        self.part = part
        self.optimizer = optimizer
        self.local = local
        self.zero = zero
        self.local_groups = local_groups  # for a view: the local group behind each view group
        self.keys: tuple[str, ...] = ()

    def sync_back(self, *, after_load: bool) -> None:
        if self.optimizer is not self.local:
            for param, state in self.optimizer.state.items():
                self.local.state[param] = state
            if after_load:
                for view_group, local_group in zip(self.optimizer.param_groups, self.local_groups):
                    local_group.update({k: v for k, v in view_group.items() if k != "params"})
        if after_load and self.zero is not None:
            for outer, inner in zip(self.zero.param_groups, self.zero.optim.param_groups):
                outer.update({k: v for k, v in inner.items() if k != "params"})


def _bind(model_parts: list[nn.Module], optimizers: list[Optimizer]) -> list[_Binding]:
    part_of: dict[torch.Tensor, int] = {}
    for index, part in enumerate(model_parts):
        for param in part.parameters():
            part_of[param] = index
    bindings = []
    for optimizer in optimizers:
        zero = zero_redundancy(optimizer)
        if zero is not None and zero._overlap_with_ddp:
            raise CheckpointError(
                "ZeroRedundancyOptimizer(overlap_with_ddp=True) cannot be checkpointed: its local "
                "optimizer is a functional one without a state dict",
                field="parallel.zero",
                fix="build ZeroRedundancyOptimizer with overlap_with_ddp=False",
            )
        local = zero.optim if zero is not None else optimizer
        by_part: dict[int, list[torch.Tensor]] = defaultdict(list)
        for group in local.param_groups:
            for param in group["params"]:
                if param not in part_of:
                    raise CheckpointError(
                        f"an optimizer holds a parameter of shape {tuple(param.shape)} that belongs to "
                        "none of the model parts passed to the checkpoint",
                        fix="pass every model part the optimizers step",
                    )
                by_part[part_of[param]].append(param)
        whole = all(group["params"] for group in local.param_groups)
        for index, params in by_part.items():
            if whole and len(by_part) == 1:
                bindings.append(_Binding(model_parts[index], local, local, zero))
            else:
                view, local_groups = _optimizer_view(local, params)
                bindings.append(_Binding(model_parts[index], view, local, zero, local_groups))
    return bindings


def _optimizer_view(local: Optimizer, params: list[torch.Tensor]) -> tuple[Optimizer, list[dict[str, Any]]]:
    """An optimizer of ``local``'s class over ``params`` only, sharing their state, and the local
    group behind each of its groups (loaded hyperparameters are copied back there).

    Empty parameter groups are dropped: DSD's unflattening reads each group's hyperparameters
    through its first parameter and fails on an empty one.
    """
    keep = set(params)
    groups, local_groups = [], []
    for group in local.param_groups:
        kept = [p for p in group["params"] if p in keep]
        if kept:
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": kept})
            local_groups.append(group)
    try:
        view = type(local)(groups)
    except TypeError as exc:
        raise CheckpointError(
            f"cannot checkpoint a {type(local).__name__} that spans several model parts: {exc}",
            fix="use one optimizer per model part",
        ) from exc
    view.state = defaultdict(dict, {p: local.state[p] for p in params if p in local.state})
    return view, local_groups


def _merge(into: dict[str, Any], part: dict[str, Any], what: str) -> None:
    clash = into.keys() & part.keys()
    if clash:
        raise CheckpointError(
            f"two model parts both hold {what} state for {sorted(clash)[:3]}: parts must not share parameters",
            fix="pass each pipeline stage's module once",
        )
    into.update(part)


def zero_redundancy(optimizer: Optimizer) -> ZeroRedundancyOptimizer | None:
    """``optimizer`` when it is ZeRO-1's ``ZeroRedundancyOptimizer``, else None.

    Without importing ``torch.distributed.optim`` (0.2 s of every rank process's start-up: it scripts
    its functional optimizers on import): a process that built a ZeRO-1 optimizer has imported it.
    """
    module = sys.modules.get("torch.distributed.optim")
    return optimizer if module is not None and isinstance(optimizer, module.ZeroRedundancyOptimizer) else None


def _share_zero_hyperparameters(optimizers: list[Optimizer]) -> None:
    """Give every ZeRO rank the loaded hyperparameters of every parameter group.

    Hyperparameters are stored per parameter (flattened), so a rank that owns no parameter of a
    group loaded none for it and would keep its constructor's values: harmless for its (empty)
    local step, but its ``param_groups`` would disagree with its peers' (an LR schedule reading
    them, the next save). Each group is taken from a rank that owns part of it.
    """
    for optimizer in optimizers:
        zero = zero_redundancy(optimizer)
        if zero is None or zero.world_size == 1:
            continue
        mine = [
            (bool(inner["params"]), {k: v for k, v in outer.items() if k != "params"})
            for outer, inner in zip(zero.param_groups, zero.optim.param_groups)
        ]
        everyone: list[Any] = [None] * zero.world_size
        dist.all_gather_object(everyone, mine, group=zero.process_group)
        for index, (outer, inner) in enumerate(zip(zero.param_groups, zero.optim.param_groups)):
            loaded = next((groups[index][1] for groups in everyone if groups[index][0]), None)
            if loaded is not None:
                outer.update(loaded)
                inner.update(loaded)

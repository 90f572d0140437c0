"""Whole-model views of a Trainer's parameters, for tests and benchmarks (never on the training path).

Comparing a layout's parameters with one process' (equivalence, resharding, resume tests; the
engine benchmark's digest) needs every parameter unsharded on every rank. Production never does:
checkpoints save each rank's shards, and exports read them back in one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict


def full_state_dict(trainer) -> dict[str, torch.Tensor]:
    """Every parameter of ``trainer`` (an ``etrain.workers.engine.train.Trainer``), unsharded, of every stage, on
    every rank (CPU tensors; a collective). DCP's state-dict API gathers FSDP and TP shards; stages are
    then exchanged over the pp group."""
    state: dict[str, torch.Tensor] = {}
    for part in trainer.model_parts:
        if trainer.distributed:
            part_state = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
        else:
            part_state = part.state_dict()
        state.update({k: v.detach().cpu().clone() for k, v in part_state.items()})
    pp_group = trainer.dims.group("pp")
    if pp_group is not None:
        gathered: list[dict[str, torch.Tensor] | None] = [None] * trainer.dims.pp
        dist.all_gather_object(gathered, state, group=pp_group)
        state = {k: v for stage_state in gathered for k, v in stage_state.items()}
    return state

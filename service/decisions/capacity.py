"""How many data-parallel replicas the cluster can hold for a job (pure).

A replica is ``tp * pp`` ranks, and each tensor-parallel group must sit on one node (its all-reduces
run on every layer; across nodes they would crawl). So capacity is counted in whole tp groups per
node: a node with 3 free rank slots holds one tp=2 group, not one and a half.

The Ray adapter measures free slots per node (free resources plus what the job itself already holds
there, minus excluded nodes) and asks :func:`replicas_that_fit`; the supervisor turns the answer
into a resize decision.
"""

from __future__ import annotations

import math
from collections.abc import Mapping


def rank_slots(*, free: Mapping[str, float], per_rank: Mapping[str, float]) -> int:
    """Ranks a node can host: the tightest resource decides (``per_rank`` entries of 0 are ignored)."""
    limits = [math.floor(free.get(name, 0.0) / amount + 1e-9) for name, amount in per_rank.items() if amount > 0]
    return max(0, min(limits)) if limits else 0


def replicas_that_fit(slots_per_node: Mapping[str, int], *, tp: int, pp: int) -> int:
    """Data-parallel replicas (``tp * pp`` ranks each, tp groups node-local) the nodes can hold."""
    if tp < 1 or pp < 1:
        raise ValueError(f"tp={tp} and pp={pp} must be >= 1")
    tp_groups = sum(max(0, slots) // tp for slots in slots_per_node.values())
    return tp_groups // pp

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


#: ``ETRAIN_WARM_SPARES_PER_NODE=auto`` on a node without GPUs: a DP2 job's two ranks plus one for a
#: replacement (at most one more than the node's CPUs), so the usual CPU job starts with no cold rank and a
#: killed rank is replaced warm. A cold rank is a Python start and ``import torch``: 3-7 s on a 2-core
#: machine. Measured as installed (``make bench``, DP2, 2-core machine): one spare, 7.2 s submit -> first
#: step; two, 2.0-2.3 s but a replacement started cold, 9.7-17.8 s SIGKILL -> next step (the pool refills
#: only after the launch); with the replacement's spare, 1.0 s. Each spare holds ~300 MB of host memory
#: with torch imported and no CPU while idle.
AUTO_SPARES_CPU_NODE = 3
#: The most spares ``auto`` keeps on one node (a 16-GPU node's worth).
MAX_AUTO_SPARES = 16


def spares_for_node(resources: Mapping[str, float], per_node: int | None) -> int:
    """Warm spares to keep on a node with Ray ``resources``: the operator's ``per_node``, or under ``auto``
    (``None``) one per GPU and one more (a whole machine's job starts with no cold rank and its first
    replacement is warm too: 9 on an 8-GPU node; a spare holds no GPU memory until it is assigned),
    :data:`AUTO_SPARES_CPU_NODE` (at most one more than the node's CPUs) on a node with only CPUs, none on a
    node that runs no ranks."""
    if per_node is not None:
        return max(0, per_node)
    gpus = int(resources.get("GPU", 0) or 0)
    if gpus > 0:
        return min(gpus + 1, MAX_AUTO_SPARES)
    cpus = int(resources.get("CPU", 0) or 0)
    return min(AUTO_SPARES_CPU_NODE, cpus + 1) if cpus > 0 else 0

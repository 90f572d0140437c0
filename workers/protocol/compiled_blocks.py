"""How ``training.compile`` compiles a block, from the layout alone: one rule for the engine
(``workers/engine/parallelize.py``) and the planner's activation count (``service/planning/plan_memory.py``).

A block compiles as one graph (``fullgraph``) unless it holds a region that runs eagerly by design:
expert parallelism's token exchange (its split sizes are host integers that change every step) and the
hand-written collectives of tensor-parallel experts (``workers/families/expert_parallel.py``). Context
parallelism's ring is one custom op inside the graph, so it is not such a region.

Where a block has one, how it compiles depends on activation checkpointing, because torch 2.13's dynamo
cannot split a checkpointed region: a graph break inside ``torch.utils.checkpoint`` makes it run that whole
checkpointed call eagerly. So:

* ``none``: the block compiles without ``fullgraph``, in graphs between the eager regions (``"split"``);
* ``full``: the checkpoint stays eager around the block and the block inside it compiles in graphs between
  the eager regions (``"split_inside_checkpoint"``): the recompute in the backward runs those graphs again.
  Compiled around the checkpoint, as for a whole block, nothing of it would compile;
* ``selective``: the block runs eagerly (``"eager"``). Compiling inside the checkpoint does not work there:
  torch 2.13's partitioner fails on the graphs traced under selective checkpointing's dispatch mode
  (``cleanup_recompute_tags``: a recompute tag without its checkpoint's id). Compiled around it, the break
  makes the whole checkpointed block eager. The rank log, the ``compiled`` job event and ``POST /v1/plan``
  (``estimate.training.compiled_blocks``) say so.

Pure standard library: the control plane imports it without torch.
"""

from __future__ import annotations

__all__ = ["COMPILED_BLOCK_FORMS", "compiled_block_form", "has_eager_regions"]

#: Each form and what it means, for messages and docs.
COMPILED_BLOCK_FORMS = {
    "whole": "each block is one compiled graph",
    "split": "each block compiles in graphs between its eager regions",
    "split_inside_checkpoint": "each block compiles in graphs between its eager regions, inside an eager checkpoint",
    "eager": "the blocks run eagerly (selective checkpointing around an eager region cannot be compiled)",
}


def has_eager_regions(*, ep: int, tp: int, moe: bool) -> bool:
    """Whether a block holds a region that must run eagerly: a mixture of experts' token exchange
    (``ep > 1``) or its tensor-parallel experts' collectives (``tp > 1``)."""
    return moe and (ep > 1 or tp > 1)


def compiled_block_form(*, ep: int, tp: int, moe: bool, checkpointing: str) -> str:
    """How a compiled block runs (a key of :data:`COMPILED_BLOCK_FORMS`)."""
    if not has_eager_regions(ep=ep, tp=tp, moe=moe):
        return "whole"
    return {"none": "split", "full": "split_inside_checkpoint"}.get(checkpointing, "eager")

"""What autograd saves for one backward: the planner's activation counts are checked against it byte for byte
(tests/unit/test_planner.py; the mixtures of experts' blocks through tests/moe_utils.py)."""

from __future__ import annotations

import torch


def saved_bytes(block: torch.nn.Module, x: torch.Tensor, *, autocast: bool, exclude=()) -> int:
    """Distinct non-parameter storages autograd saves for one block's backward (and the module state
    in ``exclude``, e.g. RoPE's cached tables)."""
    skip = {p.untyped_storage().data_ptr() for p in block.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = block(x)
        out.float().sum().backward()
    return sum(nbytes for ptr, nbytes in saved.items() if ptr not in exclude)

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


def record_local_storage(saved: dict[int, int], weights: set[int]):
    """A saved-tensor pack hook for a tensor-parallel rank: records in ``saved`` (storage address → bytes)
    the local storage of every tensor autograd keeps, unwrapping a DTensor to its shard and a collective's
    pending result (``AsyncCollectiveTensor``) to its tensor, except the storages in ``weights``."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    def pack(tensor):
        plain = tensor._local_tensor if isinstance(tensor, DTensor) else tensor  # noqa: SLF001
        if isinstance(plain, AsyncCollectiveTensor):  # a collective's result, still a wrapper
            plain = plain.elem
        storage = plain.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    return pack

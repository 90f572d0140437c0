"""What an in-memory snapshot copies (workers/checkpoints/snapshot.py), in one process: a tensor held under two
names once, and a tensor subclass whose storage cannot be read (torchao's float8 weight under FSDP2) under each
name, never failing the copy."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from etrain.workers.checkpoints.snapshot import _to_host, restore_snapshot, take_snapshot


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 4)
        self.head = nn.Linear(4, 16, bias=False)
        self.head.weight = self.embed.weight


def test_a_tied_weight_is_copied_once_and_restored_into_the_one_parameter():
    torch.manual_seed(0)
    model = _Tied()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.head(model.embed(torch.tensor([1, 2]))).sum().backward()
    optimizer.step()
    before = model.embed.weight.detach().clone()
    snapshot = take_snapshot(1, [model], [optimizer], {"step": 1})
    copies = snapshot.state["model"]
    assert copies["embed.weight"] is copies["head.weight"]  # one host copy under both names
    with torch.no_grad():
        model.embed.weight.add_(1.0)
    restore_snapshot(snapshot, [model], [optimizer])
    assert torch.equal(model.embed.weight, before) and model.head.weight is model.embed.weight


def test_a_tensor_subclass_without_a_readable_storage_is_copied_under_each_name():
    fsdp_utils = pytest.importorskip("torchao.float8.fsdp_utils")
    training_tensor = pytest.importorskip("torchao.float8.float8_training_tensor")
    inner = torch.randn(4, 4)
    wrapped = fsdp_utils.WeightWithDynamicFloat8CastTensor(inner, training_tensor.LinearMMConfig(), torch.float8_e4m3fn)
    with pytest.raises(RuntimeError):  # what the de-duplication must not trip on
        wrapped.untyped_storage().data_ptr()
    copies: dict = {}
    first, second = _to_host(wrapped, copies), _to_host(wrapped, copies)
    assert first is not second and copies == {}
    assert torch.equal(first._tensor, inner) and first._tensor.data_ptr() != inner.data_ptr()  # a copy, not a view

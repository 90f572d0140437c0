"""``local_param_digest``: the replicas' end-of-job check hashes parameters in pieces, on threads.

The digest must be a pure function of the names and bytes (equal replicas report equal digests), see
every byte (a replica that diverged in one element reports another digest, in any piece of a tensor),
and be the documented hash tree, whatever the piece size.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from etrain.workers.rank import worker
from etrain.workers.rank.worker import local_param_digest


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3, bias=False))
    model.register_parameter("odd_bf16", torch.nn.Parameter(torch.randn(3, dtype=torch.bfloat16)))  # 6 bytes
    model.register_parameter("empty", torch.nn.Parameter(torch.empty(0)))
    return model


def _by_hand(model: torch.nn.Module, piece: int) -> str:
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        data = param.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        tree = hashlib.sha256()
        for at in range(0, len(data), piece):
            tree.update(hashlib.sha256(data[at : at + piece]).digest())
        digest.update(name.encode())
        digest.update(tree.digest())
    return digest.hexdigest()


@pytest.mark.parametrize("piece", [4, 16, 64 << 20])
def test_the_digest_is_the_hash_tree_of_each_parameters_pieces(monkeypatch, piece) -> None:
    monkeypatch.setattr(worker, "DIGEST_CHUNK_BYTES", piece)
    model = _model()
    assert local_param_digest([model]) == _by_hand(model, piece)
    assert local_param_digest([model]) == local_param_digest([_model()])  # an equal replica: the same digest


def test_one_changed_element_in_a_later_piece_changes_the_digest(monkeypatch) -> None:
    monkeypatch.setattr(worker, "DIGEST_CHUNK_BYTES", 16)  # the 7x5 weight is 140 bytes: 9 pieces
    model = _model()
    before = local_param_digest([model])
    with torch.no_grad():
        model[0].weight.view(-1)[-1] += 1e-6  # the last piece of the first weight
    assert local_param_digest([model]) != before
    changed = _model()
    with torch.no_grad():
        changed[0].weight[0, 0] = torch.nextafter(changed[0].weight[0, 0], torch.tensor(2.0))  # one ulp
    assert local_param_digest([changed]) != local_param_digest([_model()])

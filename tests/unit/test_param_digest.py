"""``local_param_digest``: the replicas' end-of-job check fingerprints parameters where they live.

The digest must be a pure function of the names, dtypes, sizes and bytes (equal replicas report equal
digests, whatever the piece size the device works in), see every byte (one ulp in any element, in any
piece, changes it), and compute the documented formula, checked here against NumPy's wrapping uint64
arithmetic (an outside reference for the integer kernels).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from etrain.workers.rank import worker
from etrain.workers.rank.worker import _fingerprint, local_param_digest


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3, bias=False))
    model.register_parameter("odd_bf16", torch.nn.Parameter(torch.randn(3, dtype=torch.bfloat16)))  # 6 bytes
    model.register_parameter("empty", torch.nn.Parameter(torch.empty(0)))
    return model


def _by_numpy(tensor: torch.Tensor) -> list[int]:
    """The fingerprint's two sums, in NumPy uint64 (wrapping) arithmetic."""
    data = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()
    word = next(dtype for dtype in (np.int32, np.int16, np.int8) if len(data) % np.dtype(dtype).itemsize == 0)
    if word is np.int8:
        w = data.astype(np.uint8).astype(np.int64).astype(np.uint64)  # bytes as unsigned, as torch.uint8
    else:
        w = data.view(word).astype(np.int64).astype(np.uint64)  # sign-extended, as torch's int64 cast
    i = np.arange(len(w), dtype=np.uint64)
    c1, c2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9)
    with np.errstate(over="ignore"):
        first = (w * (np.uint64(2) * i + np.uint64(1))).sum(dtype=np.uint64)
        second = ((w ^ (i * c1)) * c2).sum(dtype=np.uint64)
    return [int(np.array([first, second], dtype=np.uint64).view(np.int64)[k]) for k in range(2)]


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(7, 5, generator=torch.Generator().manual_seed(1)),
        torch.randn(3, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16),
        torch.arange(5, dtype=torch.uint8),
        torch.randn(6, 4, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)[1:, 1:3],  # an odd view
        torch.randn(9, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)[1:5],  # 2 bytes into its storage
    ],
    ids=["fp32", "bf16-odd", "bytes", "bf16-view", "bf16-unaligned"],
)
def test_the_fingerprint_is_the_documented_formula(tensor) -> None:
    assert _fingerprint(tensor).tolist() == _by_numpy(tensor)


@pytest.mark.parametrize("words", [1, 3, 8, 32 << 20])
def test_the_digest_does_not_depend_on_the_piece_size(monkeypatch, words) -> None:
    expected = local_param_digest([_model()])
    monkeypatch.setattr(worker, "DIGEST_CHUNK_WORDS", words)
    assert local_param_digest([_model()]) == expected  # an equal replica, fingerprinted in other pieces


def test_the_digest_covers_names_dtypes_and_sizes() -> None:
    model = _model()
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        digest.update(f"{name}|{param.dtype}|{param.numel()}|".encode())
        digest.update(np.array(_by_numpy(param), dtype=np.int64).tobytes())
    assert local_param_digest([model]) == digest.hexdigest()


@pytest.mark.parametrize("where", [0, 17, 34])
def test_one_ulp_anywhere_changes_the_digest(monkeypatch, where) -> None:
    monkeypatch.setattr(worker, "DIGEST_CHUNK_WORDS", 8)  # the 7x5 weight is 35 words: 5 pieces
    before = local_param_digest([_model()])
    changed = _model()
    with torch.no_grad():
        flat = changed[0].weight.view(-1)
        flat[where] = torch.nextafter(flat[where], torch.tensor(2.0))
    assert local_param_digest([changed]) != before

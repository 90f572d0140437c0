"""The flat buckets expert gradients are reduced in (``workers/engine/parallelize.py``: ``_buckets``): every
tensor once, in order, one dtype and device per bucket, none over the cap unless a tensor alone is."""

from __future__ import annotations

import itertools
import random

import torch

from etrain.workers.engine.parallelize import _buckets


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def test_buckets_keep_order_split_by_dtype_and_stay_under_the_cap():
    rng = random.Random(0)
    for trial in range(200):
        tensors = [
            torch.zeros(rng.randint(1, 40), dtype=rng.choice((torch.float32, torch.bfloat16)))
            for _ in range(rng.randint(0, 12))
        ]
        cap = rng.choice((4, 32, 64, 1 << 20))
        buckets = list(_buckets(tensors, cap))
        assert [id(t) for t in itertools.chain.from_iterable(buckets)] == [id(t) for t in tensors], trial
        for bucket in buckets:
            assert bucket, trial
            assert len({t.dtype for t in bucket}) == 1, trial
            assert len(bucket) == 1 or sum(map(_nbytes, bucket)) <= cap, (trial, cap)
        for before, after in itertools.pairwise(buckets):  # a bucket closes only when the next tensor cannot join it
            joined = sum(map(_nbytes, before)) + _nbytes(after[0])
            assert before[0].dtype != after[0].dtype or joined > cap, (trial, cap)


def test_one_large_tensor_is_a_bucket_of_its_own():
    small, large = torch.zeros(2), torch.zeros(100)
    assert [len(b) for b in _buckets([small, large, small], 64)] == [1, 1, 1]
    assert [len(b) for b in _buckets([small, small, large], 1 << 20)] == [3]

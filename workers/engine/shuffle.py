"""An epoch's sample order as a keyed permutation computed per index: no table, nothing to build at start.

Why hand-written: the order must be a pure function of ``(seed, epoch, position)`` (every layout, restart and
resize reads the same samples at the same step), and numpy offers that only as a whole table
(``Generator.permutation``): 4 bytes a sample held by every rank (two epochs: 4 GB for a trillion-token corpus cut
into 2,048-token samples) and a Fisher-Yates pass of the whole corpus at every rank's start and at every epoch
boundary (2.5 s for 50M samples on this machine: about 25 s for 500M, which a replacement rank spent before its
first step while the job waited). No maintained library computes one index of a seeded permutation; the
construction is the standard one (format-preserving encryption's): a balanced Feistel network is a bijection on
``[0, 4^h)`` whatever its round function, and cycle-walking (apply it again while the result is ``>= n``) turns
it into a bijection on ``[0, n)``; ``4^h < 4n``, so a walk takes fewer than four applications on average.

The round function is SplitMix64's finalizer of the right half and a round key; eight rounds with keys drawn from
``numpy.random.default_rng([seed, epoch])``. Luby and Rackoff's four rounds make a strong pseudo-random
permutation of wide halves; a tiny corpus has halves of a bit or two, where four rounds measurably favour some
places (where sample 0 lands over 20,000 seeds, 10 samples: chi-square 55.7 on 9 degrees of freedom) and eight
do not (8.0; tested). Vectorized over a batch of positions: 512 positions of a 500M-sample corpus in under a
millisecond. Torch-free.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ROUNDS", "permuted"]

ROUNDS = 8
_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def _round(right: np.ndarray, key: np.uint64, mask: np.uint64) -> np.ndarray:
    z = (right ^ key) * _MIX[0]  # uint64 arithmetic wraps, as SplitMix64's does
    z = (z ^ (z >> np.uint64(30))) * _MIX[1]
    z = (z ^ (z >> np.uint64(27))) * _MIX[2]
    return (z ^ (z >> np.uint64(31))) & mask


def _feistel(values: np.ndarray, half_bits: int, keys: np.ndarray) -> np.ndarray:
    mask = np.uint64((1 << half_bits) - 1)
    shift = np.uint64(half_bits)
    left, right = values >> shift, values & mask
    for key in keys:
        left, right = right, left ^ _round(right, key, mask)
    return (left << shift) | right


def permuted(positions: np.ndarray, n: int, *, seed: int, epoch: int) -> np.ndarray:
    """Where each of ``positions`` (each in ``[0, n)``) goes in epoch ``epoch``'s order of ``n`` samples: a
    bijection of ``[0, n)`` per ``(seed, epoch)``, as int64."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    values = np.asarray(positions, dtype=np.uint64)
    if values.size and int(values.max()) >= n:
        raise ValueError(f"positions must be < n={n}")
    half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
    if 2 * half_bits > 64:
        raise ValueError(f"n={n} is beyond 2**64 samples")
    keys = np.random.default_rng([seed, epoch]).integers(0, 2**64, size=ROUNDS, dtype=np.uint64, endpoint=False)
    out = _feistel(values, half_bits, keys)
    outside = out >= np.uint64(n)
    while outside.any():  # cycle-walking: within [0, n) the walk ends at the first value that is inside
        out[outside] = _feistel(out[outside], half_bits, keys)
        outside = out >= np.uint64(n)
    return out.astype(np.int64)

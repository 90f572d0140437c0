"""The epoch order as a keyed permutation computed per index (workers/engine/shuffle.py): a bijection for every
corpus size, a pure function of (seed, epoch), and as uniform as a shuffle by the statistics that matter for
training (where a sample lands; no trace of the original order)."""

from __future__ import annotations

import numpy as np
import pytest

from etrain.workers.engine.shuffle import permuted


@pytest.mark.parametrize("n", [*range(1, 130), 255, 256, 257, 4095, 4096, 4097, 65_537, 1_000_003])
def test_every_size_is_a_bijection(n: int) -> None:
    order = permuted(np.arange(n), n, seed=3, epoch=1)
    assert order.dtype == np.int64 and np.array_equal(np.sort(order), np.arange(n))


def test_the_order_is_a_pure_function_of_seed_and_epoch() -> None:
    n = 10_007
    some = np.array([5, 0, 10_006, 77])
    full = permuted(np.arange(n), n, seed=9, epoch=2)
    assert np.array_equal(permuted(some, n, seed=9, epoch=2), full[some])  # any subset, any order: the same places
    assert not np.array_equal(permuted(np.arange(n), n, seed=9, epoch=3), full)
    assert not np.array_equal(permuted(np.arange(n), n, seed=10, epoch=2), full)


# 0.1% points of chi-square: a fair shuffle fails one of these tests once in a thousand seeds sets; the seeds are
# fixed, so the test is deterministic.
_CHI2_999 = {9: 27.9, 36: 67.0}


@pytest.mark.parametrize(("n", "position"), [(10, 0), (37, 5)])  # four rounds failed the first (chi-square 55.7)
def test_where_a_sample_lands_is_uniform_over_seeds(n: int, position: int) -> None:
    trials = 20_000
    landed = np.array([permuted(np.array([position]), n, seed=seed, epoch=0)[0] for seed in range(trials)])
    counts = np.bincount(landed, minlength=n)
    chi2 = float(((counts - trials / n) ** 2 / (trials / n)).sum())
    assert chi2 < _CHI2_999[n - 1], (n, position, counts)


def test_no_trace_of_the_original_order_is_left() -> None:
    n = 200_000
    order = permuted(np.arange(n), n, seed=0, epoch=0).astype(float)
    assert abs(np.corrcoef(np.arange(n), order)[0, 1]) < 0.01  # against the index
    assert abs(np.corrcoef(order[:-1], order[1:])[0, 1]) < 0.01  # between neighbours
    gaps = np.abs(np.diff(order))
    assert abs(gaps.mean() / n - 1 / 3) < 0.01  # two uniform draws lie n/3 apart on average


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        permuted(np.array([0]), 0, seed=0, epoch=0)
    with pytest.raises(ValueError):
        permuted(np.array([5]), 5, seed=0, epoch=0)

"""Resize policy: legal dp sizes keep the global batch whole; the chosen dp is the largest that fits."""

import pytest

from etrain.service.decisions.elastic import (
    ElasticPolicy,
    ResizeError,
    choose_dp,
    legal_dp_sizes,
    num_micro_batches,
)
from etrain.workers.protocol.errors import ConfigError
from etrain.workers.protocol.layout_rules import grad_accum_steps


def brute_force_legal(global_batch, micro_batch, min_dp, max_dp):
    return [dp for dp in range(min_dp, max_dp + 1) if global_batch % (dp * micro_batch) == 0]


class TestLegalSizes:
    def test_divisors_of_the_micro_batch_count_in_range(self):
        # 32 / 2 = 16 micro-batches: dp must divide 16.
        assert legal_dp_sizes(32, 2, 1, 16) == [1, 2, 4, 8, 16]
        assert legal_dp_sizes(32, 2, 2, 8) == [2, 4, 8]
        assert legal_dp_sizes(32, 2, 3, 7) == [4]

    def test_non_power_of_two_batches(self):
        assert legal_dp_sizes(24, 1, 1, 24) == [1, 2, 3, 4, 6, 8, 12, 24]
        assert legal_dp_sizes(24, 4, 1, 10) == [1, 2, 3, 6]

    def test_range_beyond_the_micro_batch_count_is_empty(self):
        assert legal_dp_sizes(8, 4, 3, 100) == []

    @pytest.mark.parametrize("global_batch", [1, 6, 12, 16, 30, 36, 64, 96, 100])
    @pytest.mark.parametrize("micro_batch", [1, 2, 3, 4])
    def test_matches_brute_force(self, global_batch, micro_batch):
        if global_batch % micro_batch:
            with pytest.raises(ResizeError):
                legal_dp_sizes(global_batch, micro_batch, 1, 64)
            return
        for min_dp in (1, 2, 3, 5):
            for max_dp in (min_dp, 8, 64):
                assert legal_dp_sizes(global_batch, micro_batch, min_dp, max_dp) == brute_force_legal(
                    global_batch, micro_batch, min_dp, max_dp
                )

    def test_every_legal_size_keeps_the_global_batch(self):
        for dp in legal_dp_sizes(96, 3, 1, 96):
            assert dp * grad_accum_steps(96, 3, dp) * 3 == 96


class TestErrors:
    def test_global_batch_not_a_multiple_of_micro_batch_names_both(self):
        with pytest.raises(ResizeError, match=r"global_batch=10 is not a multiple of micro_batch=4"):
            num_micro_batches(10, 4)

    def test_bad_range(self):
        with pytest.raises(ResizeError, match=r"min_dp=0 must be >= 1"):
            legal_dp_sizes(8, 1, 0, 4)
        with pytest.raises(ResizeError, match=r"max_dp=2 must be >= min_dp=4"):
            legal_dp_sizes(8, 1, 4, 2)

    def test_grad_accum_names_the_numbers(self):
        with pytest.raises(ConfigError, match=r"global_batch=32 is not divisible by .* = 3 \* 2 = 6") as info:
            grad_accum_steps(32, 2, 3)
        assert info.value.field == "training.global_batch"

    def test_resize_error_is_a_value_error(self):
        assert issubclass(ResizeError, ValueError)


class TestGradAccum:
    @pytest.mark.parametrize("dp,expected", [(1, 16), (2, 8), (4, 4), (8, 2), (16, 1)])
    def test_global_batch_over_dp_times_micro(self, dp, expected):
        assert grad_accum_steps(32, 2, dp) == expected


class TestChooseDp:
    kwargs = dict(global_batch=32, micro_batch=2, min_dp=2, max_dp=8)

    def test_largest_legal_not_above_capacity(self):
        assert choose_dp(8, 4, **self.kwargs) == 8
        assert choose_dp(7, 4, **self.kwargs) == 4  # 5, 6, 7 do not divide 16
        assert choose_dp(3, 4, **self.kwargs) == 2

    def test_capped_at_max_dp(self):
        assert choose_dp(100, 4, **self.kwargs) == 8

    def test_none_below_min_dp(self):
        assert choose_dp(1, 4, **self.kwargs) is None
        assert choose_dp(0, None, **self.kwargs) is None

    def test_none_when_no_divisor_fits(self):
        # 24/8 = 3 micro-batches: in [2, 8] only dp=3 is legal.
        assert choose_dp(2, None, global_batch=24, micro_batch=8, min_dp=2, max_dp=8) is None
        assert choose_dp(5, None, global_batch=24, micro_batch=8, min_dp=2, max_dp=8) == 3

    def test_answer_does_not_depend_on_current(self):
        assert {choose_dp(6, cur, **self.kwargs) for cur in (None, 2, 4, 8)} == {4}

    def test_rejects_negative_capacity_and_bad_current(self):
        with pytest.raises(ResizeError, match="available_dp=-1"):
            choose_dp(-1, 4, **self.kwargs)
        with pytest.raises(ResizeError, match="current_dp=0"):
            choose_dp(4, 0, **self.kwargs)

    def test_bad_config_is_reported_even_below_min(self):
        with pytest.raises(ResizeError, match="micro_batch=3"):
            choose_dp(0, None, global_batch=32, micro_batch=3, min_dp=2, max_dp=8)


class TestElasticPolicy:
    def test_methods_agree_with_functions(self):
        policy = ElasticPolicy(global_batch=32, micro_batch=2, min_dp=2, max_dp=8)
        assert policy.legal_sizes() == [2, 4, 8]
        assert policy.is_legal(4) and not policy.is_legal(3) and not policy.is_legal(16)
        assert policy.choose(6) == 4
        assert grad_accum_steps(32, 2, 8) == 2

    def test_check_names_the_legal_sizes(self):
        policy = ElasticPolicy(global_batch=32, micro_batch=2, min_dp=2, max_dp=8)
        with pytest.raises(ResizeError, match=r"dp=6 is not a legal size .* legal sizes: \[2, 4, 8\]"):
            policy.check(6)

    def test_no_legal_size_in_range_is_an_error(self):
        with pytest.raises(ResizeError, match=r"no dp in \[min_dp=5, max_dp=7\]"):
            ElasticPolicy(global_batch=32, micro_batch=2, min_dp=5, max_dp=7)

    def test_hsdp_keeps_dp_a_multiple_of_dp_replicate(self):
        # 48 micro-batches: 2, 3, 4, 6, 8 and 12 divide it; with dp_replicate=2 only even sizes stay.
        policy = ElasticPolicy(global_batch=48, micro_batch=1, min_dp=2, max_dp=12, dp_multiple=2)
        assert policy.legal_sizes() == [2, 4, 6, 8, 12]
        assert policy.choose(11) == 8  # 11 replicas fit, but 9..11 are odd or do not divide 48
        assert legal_dp_sizes(48, 1, 2, 12, 4) == [4, 8, 12]
        with pytest.raises(ResizeError, match=r"multiple of 4 \(parallelism.dp_replicate and parallelism.ep\)"):
            ElasticPolicy(global_batch=48, micro_batch=1, min_dp=5, max_dp=7, dp_multiple=4)

"""Throughput arithmetic and the learning-rate schedule: pure functions, exact numbers."""

from __future__ import annotations

import math

import pytest

from etrain.workers.engine.metrics import PEAK_FLOPS, flops_per_token, mfu, peak_flops_per_s, tokens_per_s
from etrain.workers.engine.optim import lr_at
from etrain.workers.protocol.run_config import ModelConfig, TrainingConfig


def test_flops_per_token_is_six_per_matmul_weight_plus_the_attention_term() -> None:
    config = ModelConfig(n_layers=2, d_model=8, n_heads=2, vocab_size=16, seq_len=4)  # the GPT, d_ff 32
    block = 4 * 8 * 8 + 2 * 8 * 32  # wq wk wv wo; w1 w2
    assert flops_per_token(config) == 6 * (2 * block + 16 * 8) + 12 * 2 * 8 * 4


def test_gpt2_small_flops_per_token_is_about_a_gigaflop() -> None:
    # 6 * ~124M + 12 * 12 * 768 * 1024 ≈ 0.86 GFLOP per token (nanoGPT's estimate for GPT-2 small).
    config = ModelConfig(n_layers=12, d_model=768, n_heads=12, vocab_size=50304, seq_len=1024)
    assert 0.8e9 < flops_per_token(config) < 1.1e9


@pytest.mark.parametrize(
    "name, precision, expected",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989e12),
        ("NVIDIA H100 PCIe", "bf16", 756e12),
        ("NVIDIA H200", "fp32", 67e12),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
        ("NVIDIA A10G", "bf16", 70e12),
        ("NVIDIA L4", "bf16", 121e12),
        ("Some CPU", "bf16", None),
        (None, "fp32", None),
    ],
)
def test_peak_flops_lookup_matches_the_most_specific_name(name, precision, expected) -> None:
    assert peak_flops_per_s(name, precision) == expected


def test_every_peak_entry_has_both_precisions() -> None:
    assert all(set(entry) == {"bf16", "fp32"} for entry in PEAK_FLOPS.values())


def test_mfu_and_tokens_per_s() -> None:
    assert mfu(4.0e14, 4, 1.0e14) == pytest.approx(1.0)
    assert mfu(4.0e14, 8, 1.0e14) == pytest.approx(0.5)
    assert mfu(1.0, 1, None) is None
    assert tokens_per_s(1000, 0.5) == 2000.0 and tokens_per_s(10, 0.0) == 0.0


def test_lr_warms_up_linearly_then_decays_by_cosine_to_a_tenth() -> None:
    training = TrainingConfig(steps=110, global_batch=8, micro_batch=2, lr=1.0, warmup_steps=10)
    assert [lr_at(s, training) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert lr_at(10, training) == pytest.approx(1.0)
    assert lr_at(60, training) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(110, training) == pytest.approx(0.1)
    assert lr_at(500, training) == pytest.approx(0.1)  # past the end: stays at the floor
    values = [lr_at(s, training) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_lr_without_warmup_starts_at_the_peak() -> None:
    training = TrainingConfig(steps=4, global_batch=8, micro_batch=2, lr=3e-4)
    assert lr_at(0, training) == pytest.approx(3e-4)
    assert math.isfinite(lr_at(3, training))


@pytest.mark.parametrize("arch", ["gpt", "llama", "llama-tied", "olmo2"])
def test_flops_per_token_is_six_per_matmul_weight_by_hand_plus_attention(arch) -> None:
    """The formula against a hand count on the real torch modules: every ``nn.Linear`` weight (the output
    head included, tied or not), no embedding lookup, norm or bias; plus 12·L·(heads·head_dim)·s."""
    import dataclasses

    import torch
    from torch import nn

    from etrain.workers.families.model import build_model_skeleton
    from tests.equivalence_utils import TINY_GPT, TINY_LLAMA

    config = {
        "gpt": TINY_GPT,
        "llama": TINY_LLAMA,
        "llama-tied": dataclasses.replace(TINY_LLAMA, tie_embeddings=True),
        "olmo2": dataclasses.replace(TINY_LLAMA, arch="olmo2", attention_bias="none"),
    }[arch]
    with torch.device("meta"):
        model = build_model_skeleton(config)
    linear_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    attention = 12 * config.n_layers * config.n_heads * config.head_dim * config.seq_len
    assert flops_per_token(config) == 6 * linear_weights + attention

"""The built-in GPT: exact parameter count, causal, deterministic, and cut into stages by FQN."""

from __future__ import annotations

import copy

import pytest
import torch

from workers.config import MODEL_PRESETS, ModelConfig
from workers.errors import ConfigError
from workers.model import GPT, build_model, cross_entropy_loss

CONFIG = ModelConfig(n_layers=4, d_model=32, n_heads=4, vocab_size=64, seq_len=16)


@pytest.mark.parametrize(
    "config",
    [CONFIG, ModelConfig(n_layers=2, d_model=24, n_heads=3, vocab_size=50, seq_len=7, d_ff=40)],
    ids=["default-ffn", "custom-ffn"],
)
def test_parameter_count_matches_the_config_formula(config: ModelConfig) -> None:
    model = GPT(config)
    assert sum(p.numel() for p in model.parameters()) == config.num_params


def test_preset_parameter_counts_are_plausible() -> None:
    small = ModelConfig(**MODEL_PRESETS["gpt-small"])
    assert 120e6 < small.num_params < 170e6  # GPT-2 small, untied head


def test_future_tokens_do_not_change_past_logits() -> None:
    model = build_model(CONFIG, seed=0)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_len), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % CONFIG.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_init_is_deterministic_per_seed() -> None:
    a, b, c = build_model(CONFIG, seed=5), build_model(CONFIG, seed=5), build_model(CONFIG, seed=6)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.layers["0"].attention.wq.weight, c.layers["0"].attention.wq.weight)
    # GPT-2 residual scaling: output projections start smaller than the others.
    assert a.layers["0"].attention.wo.weight.std() < a.layers["0"].attention.wq.weight.std()


def test_initial_loss_is_near_uniform() -> None:
    model = build_model(CONFIG, seed=0)
    tokens = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.seq_len + 1))
    with torch.no_grad():
        loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
    assert abs(loss.item() - torch.log(torch.tensor(64.0)).item()) < 0.1


def _cut(model: GPT, layers: range, *, first: bool, last: bool) -> GPT:
    """A pipeline stage as workers/pipeline.py makes it: unowned parts deleted or set to None."""
    stage = copy.deepcopy(model)
    for key in list(stage.layers.keys()):
        if int(key) not in layers:
            del stage.layers[key]
    if not first:
        stage.tok_embeddings = stage.pos_embeddings = None
    if not last:
        stage.norm = stage.output = None
    return stage


def test_stages_keep_the_full_models_fqns_and_chain_to_its_output() -> None:
    model = build_model(CONFIG, seed=0)
    stage0 = _cut(model, range(0, 2), first=True, last=False)
    stage1 = _cut(model, range(2, 4), first=False, last=True)

    full = dict(model.named_parameters())
    names0, names1 = dict(stage0.named_parameters()), dict(stage1.named_parameters())
    assert names0.keys() | names1.keys() == full.keys()
    assert not names0.keys() & names1.keys()
    assert "layers.2.attention.wq.weight" in names1 and "output.weight" in names1
    for name, param in {**names0, **names1}.items():
        assert torch.equal(param, full[name]), name

    tokens = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_len))
    with torch.no_grad():
        torch.testing.assert_close(stage1(stage0(tokens)), model(tokens), rtol=0, atol=0)


def test_invalid_shapes_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="d_model=30 is not divisible by model.n_heads=4"):
        GPT(ModelConfig(n_layers=1, d_model=30, n_heads=4, vocab_size=8, seq_len=4))

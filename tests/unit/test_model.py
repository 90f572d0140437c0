"""The built-in GPT, the Llama family and OLMo 2: exact parameter count, causal, deterministic (whole or
meta-device built), and cut into stages by FQN."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from etrain.workers import families
from etrain.workers.engine.init import build_model, materialize
from etrain.workers.families import MODEL_PRESETS
from etrain.workers.families.gpt_model import GPT
from etrain.workers.families.llama_model import Llama
from etrain.workers.families.model import build_model_skeleton, cross_entropy_loss
from etrain.workers.protocol.errors import ConfigError
from etrain.workers.protocol.run_config import ModelConfig

CONFIG = ModelConfig(n_layers=4, d_model=32, n_heads=4, vocab_size=64, seq_len=16)


@pytest.mark.parametrize(
    "config",
    [CONFIG, ModelConfig(n_layers=2, d_model=24, n_heads=3, vocab_size=50, seq_len=7, d_ff=40)],
    ids=["default-ffn", "custom-ffn"],
)
def test_parameter_count_matches_the_config_formula(config: ModelConfig) -> None:
    model = GPT(config)
    assert sum(p.numel() for p in model.parameters()) == families.num_params(config)


def test_preset_parameter_counts_are_plausible() -> None:
    small = ModelConfig(**MODEL_PRESETS["gpt-small"])
    assert 120e6 < families.num_params(small) < 170e6  # GPT-2 small, untied head


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
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
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
    """A pipeline stage as workers/engine/pipeline.py makes it: unowned parts deleted or set to None."""
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


# -- the Llama family ------------------------------------------------------------------------------

LLAMA = ModelConfig(
    arch="llama",
    n_layers=4,
    d_model=32,
    n_heads=4,
    n_kv_heads=2,
    d_ff=64,
    vocab_size=64,
    seq_len=16,
    attention_bias="qkv",
    qk_norm=True,
)
LLAMA_CONFIGS = {
    "mha": ModelConfig(arch="llama", n_layers=2, d_model=32, n_heads=4, vocab_size=50, seq_len=8),
    "gqa": ModelConfig(
        arch="llama", n_layers=3, d_model=48, n_heads=6, n_kv_heads=2, d_ff=80, vocab_size=70, seq_len=8
    ),
    "mqa-default-ffn": ModelConfig(
        arch="llama", n_layers=1, d_model=16, n_heads=4, n_kv_heads=1, vocab_size=20, seq_len=4
    ),
    "head-dim-override": ModelConfig(
        arch="llama",
        n_layers=2,
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        head_dim_override=12,
        d_ff=40,
        vocab_size=50,
        seq_len=8,
    ),
    "qkv-bias": ModelConfig(
        arch="llama",
        n_layers=2,
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        d_ff=40,
        vocab_size=50,
        seq_len=8,
        attention_bias="qkv",
    ),
    "all-bias": ModelConfig(
        arch="llama",
        n_layers=2,
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        d_ff=40,
        vocab_size=50,
        seq_len=8,
        attention_bias="all",
    ),
    "qk-norm-head-dim": ModelConfig(
        arch="llama",
        n_layers=2,
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        head_dim_override=16,
        d_ff=40,
        vocab_size=50,
        seq_len=8,
        qk_norm=True,
    ),
    "tied": ModelConfig(
        arch="llama",
        n_layers=2,
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        d_ff=40,
        vocab_size=50,
        seq_len=8,
        tie_embeddings=True,
    ),
    "everything": dataclasses.replace(LLAMA, tie_embeddings=True, head_dim_override=10),
}


def _hand_count(config: ModelConfig) -> int:
    """The parameter count written out term by term, independently of ``etrain.workers.families.num_params``."""
    d, hd, h, kv, f, v, n = (
        config.d_model,
        config.head_dim,
        config.n_heads,
        config.kv_heads,
        config.ffn_dim,
        config.vocab_size,
        config.n_layers,
    )
    attention = d * h * hd + 2 * d * kv * hd + h * hd * d
    if config.attention_bias in ("qkv", "all"):
        attention += h * hd + 2 * kv * hd
    if config.attention_bias == "all":
        attention += d
    if config.qk_norm:
        attention += 2 * hd
    block = 2 * d + attention + 3 * d * f
    return v * d + n * block + d + (0 if config.tie_embeddings else v * d)


@pytest.mark.parametrize("config", LLAMA_CONFIGS.values(), ids=LLAMA_CONFIGS.keys())
def test_llama_parameter_count_matches_the_config_formula(config: ModelConfig) -> None:
    model = Llama(config)
    counted = sum(p.numel() for p in model.parameters())  # a tied weight is reported once
    assert counted == families.num_params(config) == _hand_count(config)
    names = dict(model.named_parameters())
    assert ("output.weight" in names) is not config.tie_embeddings
    assert ("layers.0.attention.q_norm.weight" in names) is config.qk_norm
    assert ("layers.0.attention.wq.bias" in names) is (config.attention_bias != "none")
    assert ("layers.0.attention.wo.bias" in names) is (config.attention_bias == "all")
    assert names["layers.0.attention.wk.weight"].shape == (config.kv_heads * config.head_dim, config.d_model)


def test_llama_preset_parameter_counts_are_the_published_ones() -> None:
    # Meta's Llama 3.2 1B (tied) and 3.1 8B, Qwen3 0.6B (tied, head_dim 128, q/k norms): 1.24B, 8.03B, 0.60B.
    assert families.num_params(ModelConfig(**MODEL_PRESETS["llama3-1b"])) == 1_235_814_400
    assert families.num_params(ModelConfig(**MODEL_PRESETS["llama3-8b"])) == 8_030_261_248
    assert families.num_params(ModelConfig(**MODEL_PRESETS["qwen3-0.6b"])) == 596_049_920


def test_llama_future_tokens_do_not_change_past_logits() -> None:
    config = LLAMA_CONFIGS["everything"]
    model = build_model(config, seed=0)
    _perturb_norms_and_biases(model)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_len), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % config.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)
    assert (a[:, 10:] - b[:, 10:]).abs().max() > 1e-3


def _perturb_norms_and_biases(model: torch.nn.Module) -> None:
    """Norm weights start at 1 and biases at 0; give them values so their code paths count."""
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)


@pytest.mark.parametrize("name", ["gqa", "head-dim-override", "all-bias", "everything"])
def test_llama_meta_device_materialise_gives_build_models_weights(name: str) -> None:
    """Per-FQN seeded init: the same value per parameter whether built whole or on the meta device."""
    config = LLAMA_CONFIGS[name]
    whole = build_model(config, seed=5)
    with torch.device("meta"):
        skeleton = build_model_skeleton(config)
    assert all(p.is_meta for p in skeleton.parameters())
    materialize(skeleton, device=torch.device("cpu"), seed=5, n_layers=config.n_layers)
    state, expected = skeleton.state_dict(), whole.state_dict()
    assert state.keys() == expected.keys()
    for fqn, value in expected.items():
        assert torch.equal(state[fqn], value), fqn
    if config.tie_embeddings:  # still one parameter after to_empty gave each name its own tensor
        assert skeleton.output.weight is skeleton.tok_embeddings.weight
        assert torch.equal(state["output.weight"], state["tok_embeddings.weight"])
    # another seed, other values; norms 1, biases 0, residual projections scaled down
    other = build_model(config, seed=6)
    assert not torch.equal(other.layers["0"].attention.wq.weight, whole.layers["0"].attention.wq.weight)
    assert torch.equal(whole.layers["1"].ffn_norm.weight, torch.ones(config.d_model))
    assert whole.layers["0"].feed_forward.w2.weight.std() < whole.layers["0"].feed_forward.w1.weight.std()


def test_llama_initial_loss_is_near_uniform() -> None:
    model = build_model(LLAMA, seed=0)
    tokens = torch.randint(0, LLAMA.vocab_size, (4, LLAMA.seq_len + 1), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
    assert abs(loss.item() - torch.log(torch.tensor(64.0)).item()) < 0.1


def test_llama_stages_keep_the_full_models_fqns_and_chain_to_its_output() -> None:
    from etrain.workers.engine.pipeline import stage_module

    model = build_model(LLAMA, seed=0)
    _perturb_norms_and_biases(model)
    stages = [stage_module(model, index, 2) for index in range(2)]

    full = dict(model.named_parameters())
    names0, names1 = (dict(stage.named_parameters()) for stage in stages)
    assert names0.keys() | names1.keys() == full.keys()
    assert not names0.keys() & names1.keys()
    assert "tok_embeddings.weight" in names0 and "layers.1.attention.q_norm.weight" in names0
    assert "layers.2.attention.wk.bias" in names1 and "norm.weight" in names1 and "output.weight" in names1
    for name, param in {**names0, **names1}.items():
        assert torch.equal(param, full[name]), name

    tokens = torch.randint(0, LLAMA.vocab_size, (2, LLAMA.seq_len))
    with torch.no_grad():
        torch.testing.assert_close(stages[1](stages[0](tokens)), model(tokens), rtol=0, atol=0)


def test_llama_invalid_shapes_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="n_heads=4 is not divisible by model.n_kv_heads=3"):
        Llama(dataclasses.replace(LLAMA, n_kv_heads=3))
    with pytest.raises(ConfigError, match="head dimension 9 is odd"):
        Llama(dataclasses.replace(LLAMA, head_dim_override=9))


# -- OLMo 2 (workers/families/olmo2_model.py) --------------------------------------------------------

OLMO2 = ModelConfig(
    arch="olmo2",
    n_layers=4,
    d_model=32,
    n_heads=4,
    n_kv_heads=2,
    d_ff=64,
    vocab_size=64,
    seq_len=16,
    attention_bias="all",
)


def test_olmo2_is_causal_and_cut_into_stages_like_every_family() -> None:
    from etrain.workers.engine.pipeline import stage_module

    model = build_model(OLMO2, seed=0)
    assert torch.equal(model.layers["0"].attention.q_norm.weight, torch.ones(4 * 8))  # a norm: initialised to 1
    assert model.layers["0"].attention.k_norm.weight.shape == (2 * 8,)  # over the whole key width
    _perturb_norms_and_biases(model)
    tokens = torch.randint(0, OLMO2.vocab_size, (2, OLMO2.seq_len), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % OLMO2.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)
    assert (a[:, 10:] - b[:, 10:]).abs().max() > 1e-3
    stages = [stage_module(model, index, 2) for index in range(2)]
    names0, names1 = (dict(stage.named_parameters()) for stage in stages)
    assert names0.keys() | names1.keys() == dict(model.named_parameters()).keys()
    assert "layers.1.post_ffn_norm.weight" in names0 and "layers.2.attention.q_norm.weight" in names1
    with torch.no_grad():
        torch.testing.assert_close(stages[1](stages[0](tokens)), a, rtol=0, atol=0)


def test_olmo2_preset_parameter_count_is_the_published_one() -> None:
    # allenai/OLMo-2-0425-1B: 1.48B
    assert families.num_params(ModelConfig(**MODEL_PRESETS["olmo2-1b"])) == 1_484_916_736


# --- where initial values are drawn (workers/engine/init.py) -------------------------------------------------

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def test_cpu_init_draws_the_numbers_it_always_did() -> None:
    """A CPU rank draws each weight from a CPU generator seeded by (seed, FQN), as before device-side init:
    the default, an explicit CPU ``rng_device`` and the meta-device path all give those numbers."""
    from etrain.workers.engine.init import initial_value, initialize_parameters, param_seed

    fqn, shape = "layers.0.attention.wq.weight", (32, 32)
    drawn = torch.randn(shape, generator=torch.Generator(device="cpu").manual_seed(param_seed(5, fqn))) * 0.02
    assert torch.equal(initial_value(fqn, shape, seed=5, n_layers=4), drawn)
    assert torch.equal(initial_value(fqn, shape, seed=5, n_layers=4, device="cpu"), drawn)
    whole = build_model(CONFIG, seed=5)
    explicit = build_model_skeleton(CONFIG)
    initialize_parameters(explicit, seed=5, n_layers=CONFIG.n_layers, rng_device=torch.device("cpu"))
    with torch.device("meta"):
        skeleton = build_model_skeleton(CONFIG)
    materialize(skeleton, device=torch.device("cpu"), seed=5, n_layers=CONFIG.n_layers, rng_device=torch.device("cpu"))
    for name, value in whole.state_dict().items():
        assert torch.equal(explicit.state_dict()[name], value), name
        assert torch.equal(skeleton.state_dict()[name], value), name
    assert torch.equal(whole.layers["0"].attention.wq.weight, drawn)


@pytest.mark.parametrize("device", DEVICES)
def test_a_drawn_value_depends_on_seed_fqn_and_device_only(device: str) -> None:
    """Each parameter has a generator of its own on the drawing device: what else is drawn, and in which
    order, changes nothing, and the process's own generators are neither read nor advanced."""
    from etrain.workers.engine.init import initial_value, initialize_parameters

    fqn, other, shape = "layers.1.feed_forward.w2.weight", "layers.1.feed_forward.w1.weight", (48, 16)
    cpu_state = torch.random.get_rng_state()
    cuda_state = torch.cuda.get_rng_state() if device == "cuda" else None
    first = initial_value(fqn, shape, seed=3, n_layers=2, device=device)
    initial_value(other, shape, seed=3, n_layers=2, device=device)
    again = initial_value(fqn, shape, seed=3, n_layers=2, device=device)
    assert first.device.type == device and torch.equal(first, again)
    assert not torch.equal(first, initial_value(other, shape, seed=3, n_layers=2, device=device))
    assert not torch.equal(first, initial_value(fqn, shape, seed=4, n_layers=2, device=device))
    assert torch.equal(torch.random.get_rng_state(), cpu_state)
    if cuda_state is not None:
        assert torch.equal(torch.cuda.get_rng_state(), cuda_state)
    # A part of the model (a pipeline stage's parameters), visited in reverse order: the same values.
    whole = build_model_skeleton(CONFIG).to(device)
    initialize_parameters(whole, seed=3, n_layers=CONFIG.n_layers, rng_device=device)
    part = build_model_skeleton(CONFIG).to(device)
    params = dict(part.named_parameters())
    for name in reversed([n for n in params if n.startswith("layers.3.") or n.startswith("output")]):
        params[name].data.copy_(
            initial_value(name, tuple(params[name].shape), seed=3, n_layers=CONFIG.n_layers, device=device)
        )
        assert torch.equal(params[name], dict(whole.named_parameters())[name]), name

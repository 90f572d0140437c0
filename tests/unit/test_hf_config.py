"""``etrain.workers.checkpoints.hf_config`` against configs and models made by ``transformers`` itself
(no weights read).

* ``model_config_from_hf`` reads each supported architecture's config to the sizes and features
  etrain builds (Llama 3.1 rope scaling and biases, Mistral, tied Qwen2 with q/k/v biases, Qwen3
  with ``head_dim != hidden / heads`` and q/k norms), and refuses what it cannot train exactly;
* each family's name map is a bijection onto ``transformers``' own state-dict keys;
* ``hf_config_dict`` is read back by ``transformers.AutoConfig`` to the same sizes, and by
  ``model_config_from_hf`` to the same ``ModelConfig``.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from etrain.workers import families  # noqa: E402
from etrain.workers.checkpoints.hf_config import (  # noqa: E402
    SUPPORTED_ARCHITECTURES,
    etrain_name,
    hf_config_dict,
    hf_name,
    hf_parameter_names,
    model_config_from_hf,
)
from etrain.workers.protocol.errors import ConfigError  # noqa: E402
from etrain.workers.protocol.run_config import ModelConfig, RopeScaling  # noqa: E402

COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=64,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def _configs() -> dict[str, tuple[object, type]]:
    return {
        "llama": (
            transformers.LlamaConfig(
                **COMMON, attention_bias=True, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, rms_norm_eps=1e-5
            ),
            transformers.LlamaForCausalLM,
        ),
        "mistral": (transformers.MistralConfig(**COMMON, sliding_window=32), transformers.MistralForCausalLM),
        "qwen2": (
            transformers.Qwen2Config(**COMMON, tie_word_embeddings=True, rope_theta=1e6),
            transformers.Qwen2ForCausalLM,
        ),
        "qwen3": (transformers.Qwen3Config(**COMMON, head_dim=32), transformers.Qwen3ForCausalLM),
        "olmo2": (
            transformers.Olmo2Config(**COMMON, attention_bias=True, rope_theta=500000.0, rms_norm_eps=1e-6),
            transformers.Olmo2ForCausalLM,
        ),
    }


def _raw(arch: str, **changes) -> dict:
    config, cls = _configs()[arch]
    raw = json.loads(config.to_json_string())
    raw["architectures"] = [cls.__name__]
    raw.update(changes)
    return raw


def test_llama_with_llama3_rope_and_attention_bias():
    config = model_config_from_hf(_raw("llama"), seq_len=32)
    assert (config.arch, config.hf_architecture) == ("llama", "LlamaForCausalLM")
    assert (config.n_layers, config.d_model, config.n_heads, config.kv_heads, config.ffn_dim, config.vocab_size) == (
        2,
        64,
        4,
        2,
        96,
        128,
    )
    assert (config.seq_len, config.max_position_embeddings, config.head_dim) == (32, 64, 16)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling(
        kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
    )
    assert config.attention_bias == "all" and not config.qk_norm and not config.tie_embeddings
    assert config.norm_eps == 1e-5


def test_mistral():
    config = model_config_from_hf(_raw("mistral"), seq_len=32)
    assert config.hf_architecture == "MistralForCausalLM"
    assert (config.attention_bias, config.qk_norm, config.tie_embeddings, config.rope_scaling) == (
        "none",
        False,
        False,
        None,
    )
    assert (config.kv_heads, config.head_dim, config.rope_theta, config.norm_eps) == (2, 16, 10000.0, 1e-6)


def test_qwen2_tied_with_qkv_bias():
    config = model_config_from_hf(_raw("qwen2"), seq_len=64)
    assert config.hf_architecture == "Qwen2ForCausalLM"
    assert (config.attention_bias, config.tie_embeddings, config.rope_theta) == ("qkv", True, 1e6)
    assert config.seq_len == config.max_position_embeddings == 64


def test_qwen3_head_dim_unlike_hidden_over_heads():
    config = model_config_from_hf(_raw("qwen3"), seq_len=16)
    assert config.hf_architecture == "Qwen3ForCausalLM"
    assert (config.head_dim_override, config.head_dim, config.d_model // config.n_heads) == (32, 32, 16)
    assert config.qk_norm and config.attention_bias == "none"


def test_olmo2_is_its_own_family_with_biases_when_attention_bias():
    config = model_config_from_hf(_raw("olmo2"), seq_len=16)
    assert (config.arch, config.hf_architecture) == ("olmo2", "Olmo2ForCausalLM")
    assert (config.attention_bias, config.tie_embeddings, config.rope_theta) == ("all", False, 5e5)
    assert config.norm_eps == 1e-6
    assert config.head_dim == 16 and config.head_dim_override is None


def test_seq_len_defaults_to_the_model_context():
    assert model_config_from_hf(_raw("llama")).seq_len == 64
    assert model_config_from_hf(_raw("llama", max_position_embeddings=131072)).seq_len == 4096


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "olmo2"])
def test_parameter_count_equals_the_transformers_model(arch):
    config, cls = _configs()[arch]
    with torch.device("meta"):
        model = cls(config)
    assert families.num_params(model_config_from_hf(_raw(arch), seq_len=16)) == sum(
        p.numel() for p in model.parameters()
    )


# -- refusals --------------------------------------------------------------------------------------


def test_unsupported_architecture_names_the_supported_ones():
    raw = _raw("llama", architectures=["GemmaForCausalLM"], model_type="gemma")
    with pytest.raises(ConfigError) as info:
        model_config_from_hf(raw, seq_len=16)
    assert info.value.field == "model.hf"
    assert "GemmaForCausalLM" in info.value.message
    for name in SUPPORTED_ARCHITECTURES:
        assert name in info.value.fix


def test_seq_len_beyond_max_position_embeddings_is_refused():
    with pytest.raises(ConfigError) as info:
        model_config_from_hf(_raw("qwen2"), seq_len=65)
    assert info.value.field == "model.seq_len"
    assert "max_position_embeddings=64" in info.value.message and "<= 64" in info.value.fix


def test_mistral_seq_len_beyond_sliding_window_is_refused():
    assert model_config_from_hf(_raw("mistral"), seq_len=32).seq_len == 32  # up to the window: exact
    with pytest.raises(ConfigError) as info:
        model_config_from_hf(_raw("mistral"), seq_len=33)
    assert info.value.field == "model.seq_len"
    assert "sliding_window=32" in info.value.message and "<= 32" in info.value.fix


def test_activation_other_than_silu_is_refused():
    with pytest.raises(ConfigError) as info:
        model_config_from_hf(_raw("llama", hidden_act="gelu"), seq_len=16)
    assert info.value.field == "model.hf"
    assert "hidden_act='gelu'" in info.value.message


# -- names -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "olmo2"])
def test_names_map_onto_transformers_state_dict_and_back(arch):
    config, cls = _configs()[arch]
    ours = model_config_from_hf(_raw(arch), seq_len=16)
    names = hf_parameter_names(ours)
    assert len(set(names)) == len(names)
    mapped = [hf_name(name, ours.arch) for name in names]
    assert [etrain_name(name, ours.arch) for name in mapped] == names
    with torch.device("meta"):
        theirs = set(cls(config).state_dict())
    if ours.tie_embeddings:
        theirs.discard("lm_head.weight")  # one tensor, saved once, under the embedding's name
    assert set(mapped) == theirs
    per_layer = {"llama": 13, "mistral": 9, "qwen2": 12, "qwen3": 11, "olmo2": 15}[arch]
    assert len(names) == 2 * per_layer + (2 if ours.tie_embeddings else 3)


def test_unknown_names_raise_key_error():
    with pytest.raises(KeyError):
        hf_name("layers.0.attention.rotary.weight", "llama")
    with pytest.raises(KeyError):
        etrain_name("model.layers.0.self_attn.rotary_emb.inv_freq", "olmo2")


# -- config.json out -------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "olmo2"])
def test_hf_config_dict_reads_back_to_the_same_sizes(arch):
    ours = model_config_from_hf(_raw(arch), seq_len=16)
    written = hf_config_dict(ours)
    config = transformers.AutoConfig.for_model(**written)
    assert type(config) is type(_configs()[arch][0])
    again = type(config).from_dict(written)
    for read in (config, again):
        assert (
            read.hidden_size,
            read.intermediate_size,
            read.num_hidden_layers,
            read.num_attention_heads,
            read.num_key_value_heads,
            read.head_dim,
            read.vocab_size,
            read.max_position_embeddings,
        ) == (
            ours.d_model,
            ours.ffn_dim,
            ours.n_layers,
            ours.n_heads,
            ours.kv_heads,
            ours.head_dim,
            ours.vocab_size,
            64,
        )
        assert read.tie_word_embeddings == ours.tie_embeddings
        assert read.rms_norm_eps == ours.norm_eps and read.hidden_act == "silu"
        assert read.rope_parameters["rope_theta"] == ours.rope_theta
    back = json.loads(config.to_json_string())
    back["architectures"] = written["architectures"]
    assert model_config_from_hf(back, seq_len=16) == ours
    if arch == "mistral":
        assert config.sliding_window is None  # etrain's full causal attention, not transformers' 4096 default
    if arch in ("llama", "olmo2"):
        assert config.attention_bias is True
    if arch == "llama":
        assert config.rope_parameters["rope_type"] == "llama3" and config.rope_parameters["factor"] == 8.0


def test_gpt_cannot_be_written_as_a_hugging_face_config():
    with pytest.raises(ConfigError) as info:
        hf_config_dict(ModelConfig(n_layers=2, d_model=64, n_heads=4, vocab_size=128, seq_len=16))
    assert info.value.field == "checkpoint.export"

"""Mixtral (``workers/families/mixtral*.py``): numbers against ``transformers`` and against autograd.

* Numerics: a tiny random ``MixtralForCausalLM`` built here (never downloaded), its weights copied in;
  logits, the load-balancing loss (transformers' ``aux_loss``), the training loss (``output_router_logits=
  True``: LM loss + ``router_aux_loss_coef`` · aux) and every gradient equal within 1e-5 in fp32.
* The counts: the published sizes (Mixtral-8x7B 46.7 B parameters, 12.9 B active; 8x22B 141 B, 39 B), the
  activation count byte for byte against autograd.
* ``config.json`` in and out, and what the family refuses (configs, fields, layouts); expert parallelism's
  planning. Hugging Face weights in and out through the engine: tests/integration/test_qwen3_moe_hf.py;
  ep=2 training: tests/integration/test_expert_parallel.py.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

transformers = pytest.importorskip("transformers")

from etrain.service.planning.estimate import estimate  # noqa: E402
from etrain.service.planning.plan_activations import layer_activation_bytes  # noqa: E402
from etrain.service.planning.planner import check_plan  # noqa: E402
from etrain.service.planning.spec import JobSpec  # noqa: E402
from etrain.service.planning.spec_checks import check_spec  # noqa: E402
from etrain.workers import families  # noqa: E402
from etrain.workers.checkpoints.hf_config import hf_config_dict, model_config_from_hf  # noqa: E402
from etrain.workers.engine.init import build_model  # noqa: E402
from etrain.workers.families import MODEL_PRESETS  # noqa: E402
from etrain.workers.families.mixtral_model import MixtralBlock  # noqa: E402
from etrain.workers.protocol.errors import ConfigError  # noqa: E402
from etrain.workers.protocol.run_config import ModelConfig  # noqa: E402
from tests.moe_utils import compare_with_transformers, random_hf_model, saved_activation_bytes  # noqa: E402

FAMILY = families.family("mixtral")
TOL = 1e-5
SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=64,
)
CASES = {
    "published": dict(router_aux_loss_coef=0.02, rms_norm_eps=1e-5),
    "top3-tied-head-dim": dict(
        num_experts_per_tok=3, tie_word_embeddings=True, head_dim=32, rope_parameters={"rope_theta": 1e4}
    ),
}


# -- numerics against transformers ------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_logits_aux_loss_loss_and_gradients_equal_transformers(case):
    config = transformers.MixtralConfig(**{**SMALL, **CASES[case]})
    found = compare_with_transformers(*random_hf_model(transformers.MixtralForCausalLM, config))
    model = found.config
    assert (model.arch, model.n_experts, model.qk_norm, model.norm_topk_prob) == ("mixtral", 8, False, True)
    assert model.router_aux_loss_coef == config.router_aux_loss_coef
    print(f"mixtral {case}: {found}")
    assert found.within(TOL)
    # the aux loss is really in the loss, weighted by the coefficient
    coef = model.router_aux_loss_coef
    assert found.ours_loss - found.lm_loss == pytest.approx(coef * found.ours_aux, rel=1e-4)
    assert found.ours_aux >= 1.0  # Switch's loss is 1 for a perfect balance


def test_the_router_renormalises_and_keeps_fp32_weights_whatever_the_config_says():
    """``norm_topk_prob`` is not a spec field: a ``kind: mixtral`` spec with its own sizes leaves it False,
    and the family fixes it (its modules and its counts)."""
    config = dataclasses.replace(ModelConfig(**MODEL_PRESETS["mixtral-tiny"]), norm_topk_prob=False)
    router = build_model(config, seed=0).layers["0"].feed_forward.router
    assert router.norm_topk_prob and router.fp32_weights
    assert layer_activation_bytes(config, micro_batch=1) == layer_activation_bytes(
        dataclasses.replace(config, norm_topk_prob=True), micro_batch=1
    )


# -- counts for the planner and MFU ------------------------------------------------------------------


def test_the_published_sizes():
    """Mixtral-8x7B: 46.7 B parameters, 12.9 B active; Mixtral-8x22B: 141 B, 39 B (Mistral's numbers). The
    active count is what a token is multiplied by (attention, router, 2 experts, head) plus its lookup."""
    counts = {}
    for preset in ("mixtral-8x7b", "mixtral-8x22b"):
        model = ModelConfig(**MODEL_PRESETS[preset])
        counts[preset] = (families.num_params(model), FAMILY.matmul_weights(model) + FAMILY.lookup_params(model))
    assert counts["mixtral-8x7b"] == (46_702_792_704, 12_879_659_008)
    assert counts["mixtral-8x22b"] == (140_630_071_296, 39_160_774_656)
    model = ModelConfig(**MODEL_PRESETS["mixtral-8x7b"])
    d, q, kv, e, f = 4096, 4096, 1024, 8, 14336
    per_layer = 2 * d * q + 2 * d * kv + 2 * d + e * d + 3 * e * d * f  # no q/k norms
    assert FAMILY.layer_params(model) == per_layer
    assert families.num_params(model) == 32 * per_layer + 2 * 32000 * d + d
    assert FAMILY.expert_params_per_layer(model) == 3 * e * d * f
    assert FAMILY.active_matmul_params_per_layer(model) == 2 * d * q + 2 * d * kv + e * d + 3 * 2 * d * f


@pytest.mark.parametrize("regime", ["fp32", "autocast", "bf16_params"])
@pytest.mark.parametrize(
    "variant",
    [{}, {"router_aux_loss_coef": 0.0, "n_kv_heads": 4, "experts_per_token": 3, "norm_topk_prob": False}],
    ids=["published", "no-loss-mha-top3"],
)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_activation_count_is_what_autograd_saves(regime, variant, compiled):
    """Qwen3-MoE's count without the q/k norms and with the routing weights in fp32, eager and compiled."""
    sizes = dict(n_layers=1, d_model=128, n_heads=4, n_kv_heads=2, vocab_size=256, seq_len=64, d_ff=64)
    model = ModelConfig(**{**MODEL_PRESETS["mixtral-tiny"], **sizes, **variant})
    saved = saved_activation_bytes(MixtralBlock(model), model, regime, compiled=compiled)
    assert saved == layer_activation_bytes(model, micro_batch=2, regime=regime, compiled=compiled)


# -- config.json in and out, refusals --------------------------------------------------------------

# mistralai/Mixtral-8x7B-v0.1's config.json as published (transformers 4.36 keys)
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}


def test_config_json_in_and_out():
    """The published config reads to the preset; what etrain writes, transformers reads back to the same
    sizes and etrain to the same ModelConfig, and so does transformers' own config.json of it."""
    assert model_config_from_hf(MIXTRAL_8X7B, seq_len=4096) == ModelConfig(**MODEL_PRESETS["mixtral-8x7b"])
    without_coef = {k: v for k, v in MIXTRAL_8X7B.items() if k != "router_aux_loss_coef"}
    assert model_config_from_hf(without_coef, seq_len=4096).router_aux_loss_coef == 0.001  # transformers' default
    for preset in ("mixtral-tiny", "mixtral-8x22b"):
        model = ModelConfig(**MODEL_PRESETS[preset])
        written = hf_config_dict(model)
        config = transformers.AutoConfig.for_model(**written)
        assert type(config).__name__ == "MixtralConfig"
        assert (config.num_local_experts, config.num_experts_per_tok, config.intermediate_size) == (
            model.n_experts,
            model.experts_per_token,
            model.ffn_dim,
        )
        assert (config.router_aux_loss_coef, config.router_jitter_noise, config.sliding_window) == (
            model.router_aux_loss_coef,
            0.0,
            None,
        )
        context = dataclasses.replace(model, max_position_embeddings=written["max_position_embeddings"])
        assert model_config_from_hf(written, seq_len=model.seq_len) == context
        own = json.loads(config.to_json_string())
        assert model_config_from_hf({**own, "architectures": ["MixtralForCausalLM"]}, seq_len=model.seq_len) == context


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"sliding_window": 1024}, "model.seq_len", "sliding_window=1024"),
        ({"router_jitter_noise": 0.01}, "model.hf", "router_jitter_noise=0.01"),
        ({"hidden_act": "gelu"}, "model.hf", "hidden_act='gelu'"),
        ({"num_local_experts": "eight"}, "model.hf", "mixture-of-experts setting"),
    ],
    ids=["sliding-window", "jitter", "gelu", "mangled-experts"],
)
def test_what_etrain_would_compute_differently_is_refused_naming_the_field(change, field, words):
    with pytest.raises(ConfigError) as info:
        model_config_from_hf({**MIXTRAL_8X7B, **change}, seq_len=4096)
    assert info.value.field == field and words in info.value.message and info.value.fix
    # a window no shorter than the context is full causal attention: accepted
    assert model_config_from_hf({**MIXTRAL_8X7B, "sliding_window": 4096}, seq_len=4096).seq_len == 4096


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"qk_norm": True}, "model.qk_norm"),
        ({"attention_bias": "qkv"}, "model.attention_bias"),
        ({"moe_d_ff": 16}, "model.moe_d_ff"),
    ],
)
def test_what_mixtral_does_not_have_is_refused_naming_the_field(change, field):
    model = dataclasses.replace(ModelConfig(**MODEL_PRESETS["mixtral-tiny"]), **change)
    assert [(e.field, bool(e.fix)) for e in FAMILY.shape_errors(model)] == [(field, True)]
    equal = dataclasses.replace(ModelConfig(**MODEL_PRESETS["mixtral-tiny"]), moe_d_ff=32)  # = d_ff: the same model
    assert FAMILY.shape_errors(equal) == []


# -- the spec, the planner, layouts ------------------------------------------------------------------


def _spec(model: dict, parallelism: dict | None = None, **training) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "mixtral",
            "model": model,
            "parallelism": parallelism or {},
            "training": {"steps": 2, "global_batch": 64, "micro_batch": 1, **training},
            "resources": {"device": "cuda", "gpus_per_worker": 1},
        }
    )


def test_the_spec_selects_the_family_and_the_planner_counts_it():
    tiny = _spec({"preset": "mixtral-tiny"})
    assert tiny.model.kind == "mixtral" and check_spec(tiny) == []
    sizes = dict(kind="mixtral", n_layers=2, d_model=64, n_heads=4, vocab_size=256, seq_len=32, d_ff=32)
    explicit = _spec({**sizes, "n_experts": 4, "experts_per_token": 2, "router_aux_loss_coef": 0.02})
    assert check_spec(explicit) == [] and explicit.model.to_config().arch == "mixtral"
    model = ModelConfig(**MODEL_PRESETS["mixtral-8x7b"])
    est = estimate(_spec({"preset": "mixtral-8x7b"}, {"dp": 8, "zero": 3, "ep": 8}, precision="bf16"))
    experts = model.n_layers * FAMILY.expert_params_per_layer(model)
    assert est.params_per_rank == pytest.approx(families.num_params(model) - experts + experts / 8, abs=1)
    assert est.flops_per_step == pytest.approx(FAMILY.flops_per_token(model) * 64 * model.seq_len)


@pytest.mark.parametrize(
    ("parallelism", "fields", "words"),
    [
        ({"dp": 2, "tp": 3, "zero": 3}, ["parallelism.tp"] * 3, "must divide both model.n_heads=32"),
        ({"dp": 2, "pp": 3, "zero": 3}, ["parallelism.pp"], "n_layers=32"),
        ({"dp": 6, "ep": 3, "zero": 3}, ["parallelism.ep"], "does not divide model.n_experts=8"),
    ],
    ids=["tp", "pp", "ep"],
)
def test_refused_layouts_name_the_field(parallelism, fields, words):
    problems = check_plan(_spec({"preset": "mixtral-8x7b"}, parallelism))
    refused = [p for p in problems if p.field.startswith("parallelism.") and p.field != "parallelism"]
    assert [p.field for p in refused] == fields and words in refused[0].message and refused[0].fix

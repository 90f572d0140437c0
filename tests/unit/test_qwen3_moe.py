"""Qwen3-MoE (``workers/families/qwen3_moe*.py``): numbers against ``transformers`` and against autograd.

* Numerics: a tiny random ``Qwen3MoeForCausalLM`` built here (never downloaded), its weights copied in;
  logits, the load-balancing loss (transformers' ``aux_loss``), the training loss (``output_router_logits=
  True``: LM loss + ``router_aux_loss_coef`` · aux) and every gradient equal within 1e-5 in fp32.
* The grouped matmul (the CPU loop op): equal to a matmul per expert, gradients included; an expert no token
  picks gets a zero gradient (DDP needs every parameter used). Compiled blocks, checkpointing and the
  chunked loss: tests/integration/test_qwen3_moe_hf.py.
* The planner's counts: the published sizes (30.5 B / 235 B parameters, 3.3 B / 22 B active), FLOPs of the
  active experts only, memory holding every expert, the activation count byte for byte against autograd.
* What the family reads from and writes to ``config.json``, what it refuses (layouts, configs, fields).
* Expert parallelism's planning (``parallelism.ep``): the experts and their AdamW state divided by ep, the
  all-to-all volume, the 422s naming ``parallelism.ep``, the elastic range kept to multiples of ep. Its
  training (equal to one process, checkpoints across ep): tests/integration/test_expert_parallel.py.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from etrain.service.decisions.job_policy import gang_for, policy_for  # noqa: E402
from etrain.service.decisions.supervisor_state import SupervisorConfig  # noqa: E402
from etrain.service.planning.estimate import estimate  # noqa: E402
from etrain.service.planning.plan_activations import layer_activation_bytes  # noqa: E402
from etrain.service.planning.plan_search import AutoPlan  # noqa: E402
from etrain.service.planning.planner import check_plan, resolve_auto  # noqa: E402
from etrain.service.planning.spec import JobSpec  # noqa: E402
from etrain.service.planning.spec_checks import check_spec  # noqa: E402
from etrain.workers import families  # noqa: E402
from etrain.workers.checkpoints.hf_config import hf_config_dict, model_config_from_hf  # noqa: E402
from etrain.workers.engine.init import build_model  # noqa: E402
from etrain.workers.families import MODEL_PRESETS  # noqa: E402
from etrain.workers.families import layout as family_layout  # noqa: E402
from etrain.workers.families.qwen3_moe_model import Qwen3MoeBlock, grouped_linear  # noqa: E402
from etrain.workers.protocol import layout_rules  # noqa: E402
from etrain.workers.protocol.errors import ConfigError  # noqa: E402
from etrain.workers.protocol.run_config import ModelConfig  # noqa: E402
from tests.moe_utils import (  # noqa: E402
    MEASURED_BLOCK,
    compare_with_transformers,
    random_hf_model,
    saved_activation_bytes,
)

FAMILY = families.family("qwen3_moe")
TOL = 1e-5
SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=64,
)
CASES = {
    "published": dict(head_dim=32, norm_topk_prob=True, router_aux_loss_coef=0.01, rms_norm_eps=1e-6),
    "unnormalised-bias-tied": dict(
        norm_topk_prob=False, attention_bias=True, tie_word_embeddings=True, num_experts_per_tok=3, rope_theta=1e6
    ),
}


# -- numerics against transformers ------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_logits_aux_loss_loss_and_gradients_equal_transformers(case):
    config = transformers.Qwen3MoeConfig(**{**SMALL, **CASES[case]})
    found = compare_with_transformers(*random_hf_model(transformers.Qwen3MoeForCausalLM, config))
    assert (found.config.arch, found.config.n_experts, found.config.qk_norm) == ("qwen3_moe", 8, True)
    print(f"{case}: {found}")
    assert found.within(TOL)
    # the aux loss is really in the loss: it is not small next to the coefficient's share
    coef = found.config.router_aux_loss_coef
    assert found.ours_loss - found.lm_loss == pytest.approx(coef * found.ours_aux, rel=1e-4)
    assert found.ours_aux >= 1.0  # Switch's loss is 1 for a perfect balance (times top-k with these counts)


def test_without_a_loss_weight_nothing_is_computed_for_it():
    config = dataclasses.replace(ModelConfig(**MODEL_PRESETS["qwen3-moe-tiny"]), router_aux_loss_coef=0.0)
    model = build_model(config, seed=1)
    tokens = torch.randint(0, config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(2))
    assert not isinstance(model.layers["0"](torch.randn(2, 16, config.d_model)), tuple)
    loss = model(tokens[:, :-1], targets=tokens[:, 1:])
    lm = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    assert model.last_load_balancing_loss is None and loss.item() == pytest.approx(lm.item(), abs=1e-6)


# -- the grouped matmul -----------------------------------------------------------------------------


def test_the_grouped_matmul_is_a_matmul_per_expert_with_every_expert_in_the_gradient():
    generator = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 2]  # expert 1 gets no rows
    x = torch.randn(sum(counts), 8, generator=generator, requires_grad=True)
    w = torch.randn(4, 6, 8, generator=generator, requires_grad=True)
    offsets = torch.cumsum(torch.tensor(counts), 0, dtype=torch.int32)
    out = grouped_linear(x, w, offsets)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    rows = torch.split(x2, counts)
    want = torch.cat([rows[e] @ w2[e].t() for e in range(4)])
    assert torch.allclose(out, want, atol=1e-6)
    grad = torch.randn_like(out)
    out.backward(grad)
    want.backward(grad)
    assert torch.allclose(x.grad, x2.grad, atol=1e-6) and torch.allclose(w.grad, w2.grad, atol=1e-6)
    assert w.grad is not None and torch.count_nonzero(w.grad[1]) == 0  # present, zero: DDP sees it used


# -- counts for the planner and MFU ------------------------------------------------------------------


def test_the_published_sizes():
    """Qwen3-30B-A3B: 30.5 B parameters, 3.3 B active; Qwen3-235B-A22B: 235 B, 22 B active (the names'
    numbers); the active count is what a token is multiplied by plus its embedding lookup."""
    counts = {}
    for preset in ("qwen3-30b-a3b", "qwen3-235b-a22b"):
        model = ModelConfig(**MODEL_PRESETS[preset])
        active = FAMILY.matmul_weights(model) + FAMILY.lookup_params(model)
        counts[preset] = (families.num_params(model), active)
    assert counts["qwen3-30b-a3b"][0] == 30_532_122_624
    assert counts["qwen3-30b-a3b"][1] == pytest.approx(3.35e9, rel=0.01)
    assert counts["qwen3-235b-a22b"][0] == 235_093_634_560
    assert counts["qwen3-235b-a22b"][1] == pytest.approx(22.2e9, rel=0.01)
    model = ModelConfig(**MODEL_PRESETS["qwen3-30b-a3b"])
    d, q, kv, e, f = 2048, 32 * 128, 4 * 128, 128, 768
    per_layer = d * q + 2 * d * kv + q * d + 2 * 128 + 2 * d + e * d + 3 * e * d * f
    assert FAMILY.layer_params(model) == per_layer  # every expert: no expert parallelism
    assert FAMILY.largest_param(model, first=False, last=False) == e * f * d  # one stacked projection
    assert FAMILY.active_matmul_params_per_layer(model) == 2 * d * q + 2 * d * kv + e * d + 3 * 8 * d * f


def test_flops_per_token_count_the_active_experts_only():
    model = ModelConfig(**MODEL_PRESETS["qwen3-moe-tiny"])
    model_all = dataclasses.replace(model, experts_per_token=model.n_experts)
    d, q, kv, s = model.d_model, model.n_heads * model.head_dim, model.kv_heads * model.head_dim, model.seq_len
    block = 2 * d * q + 2 * d * kv + model.n_experts * d + 3 * model.experts_per_token * d * model.expert_dim
    head = model.vocab_size * d
    want = 6 * (model.n_layers * block + head) + 12 * model.n_layers * q * s
    assert FAMILY.flops_per_token(model) == want
    every = 3 * model.n_experts * d * model.expert_dim
    assert FAMILY.flops_per_token(model_all) - FAMILY.flops_per_token(model) == 6 * model.n_layers * (
        every - 3 * model.experts_per_token * d * model.expert_dim
    )


def _gpu_spec(preset: str, parallelism: dict, **training) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "moe",
            "model": {"preset": preset},
            "parallelism": parallelism,
            "training": {"steps": 10, "global_batch": 64, "micro_batch": 1, "precision": "bf16", **training},
            "resources": {"device": "cuda", "gpus_per_worker": 1},
        }
    )


def test_the_planner_holds_every_expert_and_its_optimizer_state_and_times_the_active_ones():
    model = ModelConfig(**MODEL_PRESETS["qwen3-30b-a3b"])
    est = estimate(_gpu_spec("qwen3-30b-a3b", {"dp": 8, "zero": 3}))
    assert est.params_per_rank == families.num_params(model)  # one stage, tp 1: every expert
    assert est.memory.parameters == pytest.approx(4 * families.num_params(model) / 8)  # fp32 masters, sharded by FSDP2
    assert est.memory.optimizer_states == pytest.approx(8 * families.num_params(model) / 8)  # AdamW's two moments
    assert est.flops_per_step == pytest.approx(FAMILY.flops_per_token(model) * 64 * model.seq_len)
    assert FAMILY.flops_per_token(model) < 6.5 * 3.35e9 + 12 * 48 * 4096 * 4096  # active, not 30 B
    # full checkpointing runs each block's forward again: its active weights and attention
    ac = estimate(_gpu_spec("qwen3-30b-a3b", {"dp": 8, "zero": 3}, activation_checkpointing="full"))
    width = model.n_heads * model.head_dim
    block_forward = 2 * FAMILY.active_matmul_params_per_layer(model) + 4 * width * model.seq_len
    recompute = model.n_layers * block_forward * 64 * model.seq_len
    assert ac.flops_per_step_with_recompute == pytest.approx(est.flops_per_step + recompute)


@pytest.mark.parametrize("regime", ["fp32", "autocast", "bf16_params"])
@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"norm_topk_prob": False, "router_aux_loss_coef": 0.0, "n_kv_heads": 4, "moe_d_ff": 48},
        {"experts_per_token": 3, "attention_bias": "all"},
    ],
    ids=["published", "no-loss-mha", "top3-bias"],
)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_activation_count_is_what_autograd_saves(regime, variant, compiled):
    model = ModelConfig(**{**MEASURED_BLOCK, **variant})
    saved = saved_activation_bytes(Qwen3MoeBlock(model), model, regime, compiled=compiled)
    assert saved == layer_activation_bytes(model, micro_batch=2, regime=regime, compiled=compiled)


# -- layouts: refused with the field named ---------------------------------------------------------


def test_tensor_and_pipeline_parallelism_are_planned_and_a_tp_that_splits_no_expert_width_is_refused():
    model = ModelConfig(**MODEL_PRESETS["qwen3-30b-a3b"])
    problems = check_plan(_gpu_spec("qwen3-30b-a3b", {"dp": 2, "tp": 2, "pp": 2, "zero": 3}))
    assert [p for p in problems if p.field in ("parallelism.tp", "parallelism.pp")] == []
    # tp splits whole heads (32 query, 4 kv), each expert's width (768) and the vocabulary
    assert family_layout.valid_tps(model) == [1, 2, 4]
    assert family_layout.tp_problems(model, 2) == []
    with pytest.raises(ConfigError) as info:  # the engine asks the same rules (parallelize_stage)
        layout_rules.check(family_layout.tp_problems(model, 8))
    assert info.value.field == "parallelism.tp"
    # pipeline stages pass the routing statistics on with the activations: the pipeline rules are a dense model's
    pipeline = dict(n_layers=48, tie_embeddings=False, pp=2, virtual_stages=1, microbatches=4, schedule="1f1b")
    assert family_layout.pipeline_problems(**pipeline, model=model) == []
    five = family_layout.pipeline_problems(**{**pipeline, "pp": 5, "microbatches": 5}, model=model)
    assert [p.field for p in five] == ["parallelism.pp"]  # 48 layers do not split into 5 stages
    assert check_plan(_gpu_spec("qwen3-moe-tiny", {"dp": 8, "zero": 3})) == []
    assert check_plan(_gpu_spec("qwen3-moe-tiny", {"dp": 2, "tp": 2, "pp": 2, "zero": 3})) == []
    auto = _gpu_spec("qwen3-moe-tiny", {"auto": True, "max_workers": 8}, global_batch=8)
    assert isinstance(resolve_auto(auto), AutoPlan)


# -- the spec and config.json ------------------------------------------------------------------------


def _spec(model: dict) -> JobSpec:
    return JobSpec.model_validate({"name": "moe", "model": model, "training": {"steps": 2, "global_batch": 4}})


def test_the_spec_selects_the_family_and_checks_its_fields():
    tiny = _spec({"preset": "qwen3-moe-tiny"})
    assert tiny.model.kind == "qwen3_moe" and check_spec(tiny) == []
    assert tiny.model.to_config() == ModelConfig(**MODEL_PRESETS["qwen3-moe-tiny"])
    sizes = dict(kind="qwen3_moe", n_layers=2, d_model=64, n_heads=4, vocab_size=256, seq_len=32)
    explicit = _spec({**sizes, "n_experts": 4, "experts_per_token": 2, "moe_d_ff": 16, "router_aux_loss_coef": 0.02})
    config = explicit.model.to_config()
    assert (config.n_experts, config.experts_per_token, config.expert_dim, config.router_aux_loss_coef) == (
        4,
        2,
        16,
        0.02,
    )
    assert check_spec(explicit) == []
    cases = {
        "model.n_experts": {**sizes},  # an MoE kind without experts
        "model.experts_per_token": {**sizes, "n_experts": 4, "experts_per_token": 5},
    }
    for field, model in cases.items():
        assert [(p.field, p.fix is not None) for p in check_spec(_spec(model))] == [(field, True)], field
    [dense] = check_spec(_spec({"preset": "llama-tiny", "n_experts": 4}))
    assert dense.field == "model.n_experts" and "mixture-of-experts" in dense.message
    with pytest.raises(ValueError, match="experts_per_token"):
        _spec({"preset": "qwen3-moe-tiny", "experts_per_token": 0})
    with pytest.raises(ValueError, match="router_aux_loss_coef"):
        _spec({"preset": "qwen3-moe-tiny", "router_aux_loss_coef": -1.0})


# Qwen/Qwen3-30B-A3B's config.json as published (transformers 4.51 keys)
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_config_json_in_and_out():
    """The published config reads to the preset; what etrain writes, transformers reads back to the same
    sizes and etrain to the same ModelConfig; transformers' own config.json (``num_local_experts``) reads too."""
    assert model_config_from_hf(QWEN3_30B_A3B, seq_len=4096) == ModelConfig(**MODEL_PRESETS["qwen3-30b-a3b"])
    for preset in ("qwen3-moe-tiny", "qwen3-235b-a22b"):
        model = ModelConfig(**MODEL_PRESETS[preset])
        written = hf_config_dict(model)
        config = transformers.AutoConfig.for_model(**written)
        assert type(config).__name__ == "Qwen3MoeConfig"
        assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (
            model.n_experts,
            model.experts_per_token,
            model.expert_dim,
        )
        assert (config.norm_topk_prob, config.router_aux_loss_coef) == (True, 0.001)
        context = dataclasses.replace(model, max_position_embeddings=written["max_position_embeddings"])
        assert model_config_from_hf(written, seq_len=model.seq_len) == context
        own = json.loads(config.to_json_string())
        assert "num_local_experts" in own or "num_experts" in own
        assert model_config_from_hf({**own, "architectures": ["Qwen3MoeForCausalLM"]}, seq_len=model.seq_len) == context


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
        ({"mlp_only_layers": [0, 47]}, "mlp_only_layers=[0, 47]"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"num_experts": None}, "mixture-of-experts size"),
        ({"use_sliding_window": True, "sliding_window": 1024}, "sliding_window=1024"),
    ],
    ids=["sparse-step", "mlp-only-layers", "gelu", "no-experts", "sliding-window"],
)
def test_what_etrain_would_compute_differently_is_refused(change, words):
    with pytest.raises(ConfigError) as info:
        model_config_from_hf({**QWEN3_30B_A3B, **change}, seq_len=4096)
    assert info.value.field in ("model.hf", "model.seq_len") and words in info.value.message and info.value.fix


# -- expert parallelism: the planner, the spec and the refusals ---------------------------------------


def test_a_layout_that_does_not_fit_is_offered_cpu_offload_where_ep_allows_it():
    """The memory refusal's fixes offer ``parallelism.offload=cpu`` under expert parallelism where FSDP2 shards
    the experts (so it offloads them too), and not where it leaves them whole (offload is refused there)."""
    from etrain.service.planning.planner import check_plan

    sharded = check_plan(_gpu_spec("qwen3-30b-a3b", {"dp": 8, "zero": 3, "ep": 4}, micro_batch=8))
    assert [p.field for p in sharded] == ["parallelism"] and "parallelism.offload=cpu" in sharded[0].fix
    whole = check_plan(_gpu_spec("qwen3-30b-a3b", {"dp": 8, "zero": 3, "ep": 4, "dp_replicate": 2}, micro_batch=8))
    assert [p.field for p in whole] == ["parallelism"] and "parallelism.offload=cpu" not in whole[0].fix


def test_the_planner_divides_the_experts_and_their_state_by_ep_and_counts_the_all_to_alls():
    model = ModelConfig(**MODEL_PRESETS["qwen3-30b-a3b"])
    experts = model.n_layers * FAMILY.expert_params_per_layer(model)
    assert experts == model.n_layers * 3 * 128 * 2048 * 768
    dense = families.num_params(model) - experts
    zero3 = estimate(_gpu_spec("qwen3-30b-a3b", {"dp": 8, "zero": 3, "ep": 4}))
    assert zero3.layout == "pp1·dp8·tp1 ep4 zero=3" and zero3.ep == 4
    assert zero3.params_per_rank == pytest.approx(dense + experts / 4, abs=1)
    # FSDP2 shards the rest over dp, and the local experts (n_experts / ep) over the dp / ep = 2 ranks holding
    # the same ones: a rank holds 1/8 of them, with their AdamW state
    assert zero3.memory.parameters == pytest.approx(4 * (dense / 8 + experts / 8), abs=1)
    assert zero3.memory.gradients == pytest.approx(4 * (dense / 8 + experts / 8), abs=1)
    assert zero3.memory.optimizer_states == pytest.approx(8 * (dense / 8 + experts / 8), abs=1)
    # under HSDP with one rank per replica group holding each expert (dp_shard 4 = ep) FSDP2 leaves them out:
    # the local ones are held whole, with their AdamW state
    hsdp = estimate(_gpu_spec("qwen3-30b-a3b", {"dp": 8, "zero": 3, "ep": 4, "dp_replicate": 2}))
    assert hsdp.memory.parameters == pytest.approx(4 * (dense / 4 + experts / 4), abs=1)
    assert hsdp.memory.optimizer_states == pytest.approx(8 * (dense / 4 + experts / 4), abs=1)
    # with context parallelism the cp ranks of an edp rank hold the same experts too: dp4·cp2·ep4 shards a rank's
    # 32 experts over its cp pair (1/8 of them a rank, as at dp8·ep4), the dense weights over dp·cp = 8
    cp = estimate(_gpu_spec("qwen3-30b-a3b", {"dp": 4, "cp": 2, "zero": 3, "ep": 4}))
    assert cp.memory.parameters == pytest.approx(4 * (dense / 8 + experts / 8), abs=1)
    assert cp.memory.optimizer_states == pytest.approx(8 * (dense / 8 + experts / 8), abs=1)
    ddp = estimate(_gpu_spec("qwen3-30b-a3b", {"dp": 8, "ep": 8}))
    assert ddp.memory.parameters == pytest.approx(4 * (dense + experts / 8), abs=1)
    assert ddp.memory.buffer_parts["ddp_buckets"] == pytest.approx(4 * dense, abs=1)  # DDP leaves experts out
    # per MoE layer and micro-batch 2 all-to-alls forward and 2 backward of tokens·k·d·bytes, (ep-1)/ep sent
    tokens, micro = model.seq_len, 64 // 8
    buffer = tokens * model.experts_per_token * model.d_model * 2  # bf16 activations under FSDP2
    assert zero3.comm.ep == pytest.approx(micro * model.n_layers * 4 * buffer * 3 / 4, abs=1)
    assert zero3.comm.ep_ops == micro * model.n_layers * 5  # and the counts exchanged before each forward
    full = estimate(_gpu_spec("qwen3-30b-a3b", {"dp": 8, "zero": 3, "ep": 4}, activation_checkpointing="full"))
    assert full.comm.ep == pytest.approx(micro * model.n_layers * 6 * buffer * 3 / 4, abs=1)  # replayed forward
    assert zero3.step_time.ep_comm_s > 0 and zero3.to_dict()["comm_per_step"]["bytes"]["ep"] == zero3.comm.ep
    # ep = 1 is the layout of before: every expert, no exchange
    plain = estimate(_gpu_spec("qwen3-30b-a3b", {"dp": 8, "zero": 3}))
    assert (
        plain.params_per_rank == families.num_params(model)
        and plain.comm.ep == 0
        and plain.layout == "pp1·dp8·tp1 zero=3"
    )
    assert zero3.memory.total < plain.memory.total


@pytest.mark.parametrize(
    "preset, parallelism, field, words",
    [
        ("qwen3-30b-a3b", {"dp": 6, "ep": 3, "zero": 3}, "parallelism.ep", "does not divide model.n_experts=128"),
        ("qwen3-30b-a3b", {"dp": 2, "ep": 4, "zero": 3}, "parallelism.ep", "does not divide parallelism.dp=2"),
        (
            "qwen3-30b-a3b",
            {"dp": 4, "ep": 2, "zero": 3, "dp_replicate": 2, "offload": "cpu"},
            "parallelism.ep",
            "offload",
        ),
        ("llama3-8b", {"dp": 2, "ep": 2, "zero": 3}, "parallelism.ep", "dense model"),
    ],
    ids=["experts", "dp", "offload", "dense"],
)
def test_bad_expert_layouts_get_a_422_naming_parallelism_ep(preset, parallelism, field, words):
    problems = [p for p in check_plan(_gpu_spec(preset, parallelism)) if p.field == field]
    assert len(problems) == 1 and words in problems[0].message, problems
    assert problems[0].fix and ("ep" in problems[0].fix or "dp" in problems[0].fix)


@pytest.mark.parametrize(
    "parallelism",
    [{"dp": 4, "ep": 2, "zero": 3, "dp_replicate": 2}, {"dp": 4, "ep": 2, "zero": 1}],
    ids=["hsdp", "zero1"],
)
def test_ep_composes_with_hsdp_and_zero1(parallelism):
    assert [p for p in check_plan(_gpu_spec("qwen3-30b-a3b", parallelism)) if p.field == "parallelism.ep"] == []


def test_the_spec_carries_ep_and_keeps_every_elastic_size_a_multiple_of_it():
    def spec(parallelism: dict, resources: dict | None = None, **training) -> JobSpec:
        return JobSpec.model_validate(
            {
                "name": "moe",
                "model": {"preset": "qwen3-moe-tiny"},
                "parallelism": parallelism,
                "training": {"steps": 2, "global_batch": 8, **training},
                "resources": resources or {},
            }
        )

    ok = spec({"dp": 2, "ep": 2}, {"min_dp": 2, "max_dp": 4})
    assert check_spec(ok) == [] and check_plan(ok) == []
    config = ok.to_run_config(job_id="j", checkpoint_root="/tmp")
    assert config.parallel.ep == 2 and config.parallel.describe() == "pp1·dp2·tp1 ep2 zero=0"
    assert config.parallel.dp_multiple == 2 and not config.training.compile  # CPU: compile off by default
    # An elastic range with sizes that are not multiples of ep is fine: the supervisor resizes only to those
    # that are (and `scale` refuses the others), as for HSDP's dp_replicate.
    elastic = spec({"dp": 2, "ep": 2}, {"min_dp": 1, "max_dp": 4})
    assert check_spec(elastic) == []
    run_config = elastic.to_run_config(job_id="j", checkpoint_root="/tmp")
    supervised = SupervisorConfig.of(policy_for(elastic), run_config, job_id="j")
    assert supervised.elastic.legal_sizes() == [2, 4] and gang_for(elastic).dp_sizes == (2,)
    compiled = spec({"dp": 2, "ep": 2}, compile=True)  # the blocks compile around the token exchange
    assert check_spec(compiled) == [] and compiled.to_run_config(job_id="j", checkpoint_root="/tmp").training.compile
    on_cuda = spec({"dp": 2, "ep": 2}, resources={"device": "cuda", "gpus_per_worker": 1})
    assert on_cuda.compile_blocks  # left unset: on for CUDA, under ep too
    assert layout_rules.dp_multiple(dp_replicate=2, ep=4) == 4 and layout_rules.dp_multiple(dp_replicate=3, ep=2) == 6

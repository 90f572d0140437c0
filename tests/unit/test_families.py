"""The model-family registry: every family's declaration (pure) agrees with its modules (torch).

What a family declares for the control plane (parameter counts, the tensor-parallel plan as data, the
largest parameter, the matmul weights, the Hugging Face parameter names) is read here against the
modules its ``model_module`` builds, for every registered family and a few variants of each, so a new
family is checked by adding it to the registry (and a variant or two to ``VARIANTS``). The numerics
against ``transformers`` are tests/unit/test_family_numerics.py; the activation counts against autograd
tests/unit/test_planner.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from etrain.workers import families
from etrain.workers.families.base import TP_STYLES, ModelFamily, TPPlan
from etrain.workers.families.model import build_model_skeleton
from etrain.workers.protocol.errors import ConfigError
from etrain.workers.protocol.run_config import ModelConfig

BASE = dict(n_layers=2, d_model=48, n_heads=4, vocab_size=96, seq_len=16, d_ff=80)
#: A few shapes of each family: every option that changes a count or a name.
VARIANTS = {
    "gpt": [{}],
    "llama": [
        {"n_kv_heads": 2},
        {"n_kv_heads": 2, "attention_bias": "qkv", "tie_embeddings": True},
        {"n_kv_heads": 1, "attention_bias": "all", "qk_norm": True, "head_dim_override": 16},
    ],
    "olmo2": [
        {"n_kv_heads": 2},
        {"n_kv_heads": 2, "attention_bias": "all", "tie_embeddings": True},
        {"n_kv_heads": 4, "head_dim_override": 8},
    ],
    "qwen3_moe": [
        {"n_kv_heads": 2, "moe_d_ff": 24, "norm_topk_prob": True, "router_aux_loss_coef": 0.01},
        {"n_kv_heads": 1, "attention_bias": "all", "tie_embeddings": True, "head_dim_override": 16, "n_experts": 3},
    ],
    "mixtral": [
        {"n_kv_heads": 2, "norm_topk_prob": True, "router_aux_loss_coef": 0.02},
        {"n_kv_heads": 1, "tie_embeddings": True, "head_dim_override": 16, "n_experts": 3, "experts_per_token": 3},
    ],
}
#: What a family needs besides BASE (a mixture of experts: its experts and top-k).
FAMILY_BASE = {
    "qwen3_moe": {"n_experts": 4, "experts_per_token": 2},
    "mixtral": {"n_experts": 4, "experts_per_token": 2},
}
CASES = [(name, variant) for name, variants in VARIANTS.items() for variant in variants]
IDS = [f"{name}-{i}" for name, variants in VARIANTS.items() for i in range(len(variants))]
#: Per style: whether the module's weight and bias are split over the tp ranks (else replicated).
SHARDS = {
    "colwise": (True, True),
    "colwise_sharded_output": (True, True),
    "rowwise": (True, False),
    "width_norm": (True, True),
    "norm": (False, False),
    "head_norm": (False, False),
    "moe": (True, True),  # its parameters' names: experts.w1/w2/w3 split by width, router.weight (below) whole
}
#: Parameters a splitting style holds whole: the mixture of experts' router.
REPLICATED_UNDER = {"moe": ("router.weight",)}


def _config(name: str, variant: dict) -> ModelConfig:
    return ModelConfig(arch=name, **{**BASE, **FAMILY_BASE.get(name, {}), **variant})


def _skeleton(config: ModelConfig) -> torch.nn.Module:
    with torch.device("meta"):
        return build_model_skeleton(config)


def test_every_family_is_registered_once_and_complete():
    assert list(families.FAMILIES) == ["gpt", "llama", "olmo2", "qwen3_moe", "mixtral"] == list(VARIANTS)
    for name, found in families.FAMILIES.items():
        assert isinstance(found, ModelFamily) and found.name == name and found.summary and found.presets
        assert found.model_module == f"etrain.workers.families.{name}_model"
    assert families.MODEL_PRESETS == families.presets()
    assert all(families.MODEL_PRESETS[p]["arch"] == f.name for f in families.FAMILIES.values() for p in f.presets)
    assert {arch: traits["family"] for arch, traits in families.hf_architectures().items()} == {
        "LlamaForCausalLM": "llama",
        "MistralForCausalLM": "llama",
        "Qwen2ForCausalLM": "llama",
        "Qwen3ForCausalLM": "llama",
        "Olmo2ForCausalLM": "olmo2",
        "Qwen3MoeForCausalLM": "qwen3_moe",
        "MixtralForCausalLM": "mixtral",
    }
    assert families.hf_family("Olmo2ForCausalLM") is families.family("olmo2")
    assert families.hf_family("Qwen3MoeForCausalLM") is families.family("qwen3_moe")
    assert families.hf_family("MixtralForCausalLM") is families.family("mixtral")
    assert families.hf_family("GPT2LMHeadModel") is None


def test_an_unknown_family_is_a_config_error_naming_the_registered_ones():
    """The run config only names a family (the protocol never asks one): the registry refuses the name
    wherever a config is used: here the registry, the parameter count and the model builder; the spec at
    submit and ``/v1/plan`` (tests/unit/test_spec_model.py, tests/api/test_routes.py) and torchrun's config
    file (tests/unit/test_parallel_config.py)."""
    mamba = ModelConfig(arch="mamba", **BASE)
    for ask in (lambda: families.family("mamba"), lambda: families.num_params(mamba), lambda: _skeleton(mamba)):
        with pytest.raises(ConfigError) as info:
            ask()
        assert info.value.field == "model.kind" and "gpt, llama, olmo2, qwen3_moe, mixtral" in info.value.fix
    with pytest.raises(ValueError, match="unknown tensor-parallel styles"):
        TPPlan(block={"attention.wq": "diagonal"})


@pytest.mark.parametrize(("name", "variant"), CASES, ids=IDS)
def test_the_counts_are_the_modules(name, variant):
    config = _config(name, variant)
    found = families.family(name)
    model = _skeleton(config)
    assert families.num_params(config) == sum(p.numel() for p in model.parameters())
    block = model.layers["0"]
    numel = {n: p.numel() for n, p in model.named_parameters()}
    weights = [p for p in block.parameters() if p.ndim >= 2]  # projections (stacked experts too), not norms/biases
    assert found.matmul_params_per_layer(config) == sum(p.numel() for p in weights)
    assert found.largest_param(config) == max(numel.values())
    assert found.largest_param(config, first=False, last=False) == max(p.numel() for p in block.parameters())
    # lookups: the embeddings, but not a tied embedding (the output head multiplies by it)
    tokens = 0 if config.tie_embeddings else numel["tok_embeddings.weight"]
    assert found.lookup_params(config) == tokens + numel.get("pos_embeddings.weight", 0)
    assert found.position_params(config) == numel.get("pos_embeddings.weight", 0)
    assert found.embedding_params(config, 1) == numel["tok_embeddings.weight"] + numel.get("pos_embeddings.weight", 0)
    output = model.output.weight.numel()  # reported once (as the embedding's) when tied
    head = numel["norm.weight"] + numel.get("norm.bias", 0) + output
    assert found.head_params(config, 1) == head
    assert found.head_params(config, 1, with_embedding=True) == head - config.tie_embeddings * output


@pytest.mark.parametrize(("name", "variant"), CASES, ids=IDS)
def test_the_tp_plan_names_real_modules_and_shards_what_layer_params_counts(name, variant):
    """The plan is data: each name is a submodule, each style a known one, and the parameters the plan
    splits over tp ranks (and those it replicates) are what the planner's ``layer_params`` holds."""
    config = _config(name, variant)
    found = families.family(name)
    if "tp" in found.refused_axes:  # no plan to check: tp > 1 is refused, naming the field
        with pytest.raises(ConfigError) as info:
            found.tp_plan(config)
        assert info.value.field == "parallelism.tp"
        return
    model = _skeleton(config)
    plan = found.tp_plan(config)
    assert set(plan.root.values()) | set(plan.block.values()) <= set(TP_STYLES)
    assert {n for n in plan.root if getattr(model, n, None) is not None} == set(plan.root)
    block = model.layers["0"]
    modules = dict(block.named_modules())
    assert set(plan.block) <= set(modules)
    styled = {n: style for n, style in plan.block.items() if style in SHARDS}
    covered = {f"{n}.{p}" for n in styled for p, _ in modules[n].named_parameters()}
    assert covered == {n for n, _ in block.named_parameters()}, "every block parameter has a style"
    for tp in (1, 2, 4):
        held = 0.0
        for module_name, style in styled.items():
            weight_split, bias_split = SHARDS[style]
            for param_name, param in modules[module_name].named_parameters():
                split = weight_split if param_name == "weight" else bias_split
                split = split and param_name not in REPLICATED_UNDER.get(style, ())
                held += param.numel() / tp if split else param.numel()
        assert found.layer_params(config, tp) == pytest.approx(held), tp


@pytest.mark.parametrize(
    ("name", "variant"),
    [case for case in CASES if case[0] != "gpt"],
    ids=[i for i, case in zip(IDS, CASES) if case[0] != "gpt"],
)
def test_hugging_face_names_cover_the_model_and_map_back(name, variant):
    config = _config(name, variant)
    found = families.family(name)
    names = found.hf_parameter_names(config)
    shapes = {n: tuple(p.shape) for n, p in _skeleton(config).named_parameters()}  # a tied output once
    assert sorted(names) == sorted(shapes) and len(set(names)) == len(names)
    # each parameter is one tensor, or (stacked experts) one tensor per expert, each its slice
    tensors = [(fqn, *t) for fqn in names for t in found.hf_tensors(fqn, shapes[fqn], config)]
    mapped = [hf for _, hf, _, _ in tensors]
    assert len(set(mapped)) == len(mapped) and all(n.startswith(("model.", "lm_head.")) for n in mapped)
    assert [found.etrain_slice(hf) for _, hf, _, _ in tensors] == [(fqn, expert) for fqn, _, _, expert in tensors]
    for fqn, _, shape, expert in tensors:
        assert shape == (shapes[fqn] if expert is None else shapes[fqn][1:])
    stacked = [fqn for fqn in names if found.expert_template(fqn) is not None]
    assert len(mapped) == len(names) + (config.n_experts - 1) * len(stacked)
    assert bool(stacked) == found.mixture_of_experts
    with pytest.raises(KeyError):
        found.hf_name("layers.0.attention.rotary.weight")


def test_a_family_without_a_hugging_face_format_says_so():
    gpt = families.family("gpt")
    assert not gpt.has_hf_format and families.family("olmo2").has_hf_format
    with pytest.raises(ConfigError) as info:
        gpt.hf_config(_config("gpt", {}))
    assert info.value.field == "checkpoint.export"


@pytest.mark.parametrize("name", list(VARIANTS))
def test_shape_rules_are_the_familys(name):
    found = families.family(name)
    assert found.shape_errors(_config(name, {})) == []
    zero = dataclasses.replace(_config(name, {}), n_layers=0)
    assert [e.field for e in found.shape_errors(zero)] == ["model.n_layers"]
    if found.grouped_query_attention:
        assert [e.field for e in found.shape_errors(_config(name, {"n_kv_heads": 3}))] == ["model.n_kv_heads"]
    else:
        assert [e.field for e in found.shape_errors(_config(name, {"d_model": 50}))] == ["model.d_model"]


class _MutatingOps:
    """The mutating (in-place or ``out=``) ops run inside the model's blocks, by torch's own schema flag."""

    def __init__(self, model: torch.nn.Module):
        from torch.utils._python_dispatch import TorchDispatchMode

        found: list[str] = []
        self.found = found
        inside = [False]

        class Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if inside[0] and func._schema.is_mutable:
                    found.append(str(func))
                return func(*args, **(kwargs or {}))

        self.mode = Record()
        for block in model.layers.values():
            block.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
            block.register_forward_hook(lambda *_: inside.__setitem__(0, False))


@pytest.mark.parametrize(("name", "variant"), CASES, ids=IDS)
def test_no_block_runs_an_in_place_op(name, variant):
    """``training.compile`` with ``activation_checkpointing: selective`` hands torch.compile a checkpointed
    block with a policy, which torch accepts only for regions without in-place ops and says so in a warning
    (``torch._higher_order_ops.wrap``) that ``workers/engine/compile.py`` silences: this is the check it
    stands on, for every family, in fp32 and under bf16 autocast."""
    from etrain.workers.engine.init import build_model

    config = _config(name, variant)
    model = build_model(config, seed=0)
    ops = _MutatingOps(model)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_len), generator=torch.Generator().manual_seed(0))
    with ops.mode:
        model(tokens)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(tokens)
    assert ops.found == []
    # ... and the check sees one: a block that adds in place
    block = next(iter(model.layers.values()))
    block.register_forward_hook(
        lambda _m, _a, out: out.add_(1.0) if torch.is_tensor(out) else out[0].add_(1.0), prepend=True
    )
    with ops.mode, torch.no_grad():
        model(tokens)
    assert ops.found and "add_" in ops.found[0], ops.found


def test_compile_silences_only_torchs_in_place_warning():
    import logging

    from etrain.workers.engine.compile import silence_checked_warnings

    silence_checked_warnings()
    logger = logging.getLogger("torch._higher_order_ops.wrap")
    kept = []

    class Keep(logging.Handler):
        def emit(self, record):
            kept.append(record.getMessage())

    handler = Keep()
    logger.addHandler(handler)
    try:
        logger.warning(
            "\nDetected that context_fn is passed to torch.utils.checkpoint under torch.compile.\nPlease ..."
        )
        logger.warning("something else")
    finally:
        logger.removeHandler(handler)
    assert kept == ["something else"]

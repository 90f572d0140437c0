"""``parallelism: auto`` chooses context parallelism (cp) and expert parallelism (ep): the search, the choice
and its reasons, with numbers. Pure (no torch, no Ray): the planner's estimates only.

cp comes in only when no layout without it fits, and then the least cp that fits (``plan_search.choose_layout``
rule 1); ep is tried for a mixture of experts at every dp it divides, and the cost model picks among the same
(cp, pp, tp). A dense model at its usual sequence length gets the layout, and the reasons, it got before.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from etrain.service.errors import SpecRejected
from etrain.service.planning.estimate import case_for, evaluate
from etrain.service.planning.plan_memory import GiB
from etrain.service.planning.plan_problems import layout_problems
from etrain.service.planning.plan_search import (
    MAX_AUTO_LAYOUTS,
    candidate_groups,
    candidate_layouts,
    context_parallel_sizes,
    frugal_layout,
)
from etrain.service.planning.planner import check_plan, plan_report, resolve_auto
from etrain.service.planning.spec import JobSpec, ParallelismSpec
from etrain.service.planning.spec_checks import check_spec

REPO = Path(__file__).resolve().parents[2]


def auto_spec(preset: str, budget: int, *, seq_len: int | None = None, model: dict | None = None, **training):
    body = {
        "name": "auto-cp-ep",
        "model": model or {"preset": preset, **({"seq_len": seq_len} if seq_len else {})},
        "parallelism": {"auto": True, "max_workers": budget},
        "training": {"steps": 10, "global_batch": 512, "micro_batch": 1, "precision": "bf16", **training},
        "resources": {"device": "cuda", "gpus_per_worker": 1},  # 80 GiB per GPU: the planner's default
    }
    return JobSpec.model_validate(body)


def long_context(budget: int = 32, **training) -> JobSpec:
    """Llama 3 8B at its full 131072-token context, no activation checkpointing, 16 sequences per step."""
    return auto_spec("llama3-8b", budget, seq_len=131072, global_batch=16, **training)


def gib(value: int | float) -> float:
    return round(value / GiB, 1)


def estimates(spec: JobSpec, *, cp: int) -> list:
    """Every layout at this cp the search could consider (not pruned), estimated."""
    base = case_for(spec, ParallelismSpec())
    cases = candidate_layouts(spec, base, spec.parallelism.max_workers, cp=cp)
    return [evaluate(case) for case in cases if not layout_problems(case, max_dp=case.layout.dp)]


# -- context parallelism -----------------------------------------------------------------------------------------


def test_a_long_context_gets_the_least_cp_that_fits_and_says_why():
    """Eager blocks (``training.compile: false``): nothing fits without cp, nor with cp=2; cp=4 does."""
    spec = long_context(compile=False)
    plan = resolve_auto(spec)
    assert plan.estimate.layout == "pp1·dp1·tp8 cp4 zero=2 sp"
    assert (plan.layout.cp, plan.layout.tp, plan.layout.dp, plan.estimate.world_size) == (4, 8, 1, 32)
    assert plan.estimate.fits and gib(plan.estimate.memory.total) == 56.7
    # Without cp nothing fits: the smallest layout needs 173.9 GiB, 164.3 of them activations.
    without = estimates(spec, cp=1)
    assert without and not any(e.fits for e in without)
    smallest = min(without, key=lambda e: e.memory.total)
    assert (smallest.layout, gib(smallest.memory.total), gib(smallest.memory.activations)) == (
        "pp2·dp2·tp8 zero=2 1f1b sp",
        173.9,
        164.3,
    )
    # Nor with cp=2: the least cp that fits is 4. The ring's blocks run in torch's flash kernel on CUDA in
    # bf16, so no block's (seq_len/cp)² scores exist whole: the transient is a few copies of a rank's tokens
    # (computed on the math path, its 32768² fp32 scores would need 128 GiB, and cp=16 was the least).
    assert not any(e.fits for e in estimates(spec, cp=2))
    cp_reason = next(r for r in plan.reasons if r.startswith("cp="))
    assert cp_reason.startswith("cp=4: splits each sequence of 131072 tokens over 4 ranks (32768 each)")
    assert (
        "without it the activations of seq_len 131072 need 164.3 GiB/rank in the smallest layout "
        "(pp2·dp2·tp8 zero=2 1f1b sp), 173.9 GiB in all, above the device's 80.0 GiB" in cp_reason
    )
    assert "with cp=2 the smallest (pp2·dp1·tp8 cp2 zero=3 1f1b sp) needs 89.2 GiB" in cp_reason
    assert "transient 0.2 GiB per rank" in cp_reason
    assert "zero=2: shards optimizer states and gradients over dp·cp = 1·4" in " ".join(plan.reasons)
    assert "dp=1: world = pp·dp·cp·tp = 1·1·4·8 uses 32 of 32 workers" in plan.reasons
    # The chosen layout is one the service runs: its spec passes every check.
    chosen = spec.with_layout(plan.layout)
    assert check_spec(chosen) == [] and check_plan(chosen) == [] and not chosen.compile_blocks
    assert plan.candidates_considered <= MAX_AUTO_LAYOUTS


def test_compiled_blocks_need_less_cp():
    """Compiled (the default on CUDA), a block keeps the partitioner's count at a cp rank's tokens (the ring op
    inside its graph; measured on CPU: tests/integration/test_context_parallel.py), so cp=2 fits where eager
    blocks need cp=4 (above)."""
    spec = long_context()
    plan = resolve_auto(spec)
    assert spec.compile_blocks and plan.estimate.layout == "pp1·dp2·tp8 cp2 zero=2 sp"
    assert (gib(plan.estimate.memory.total), gib(plan.estimate.memory.activations)) == (79.8, 62.7)
    cp_reason = next(r for r in plan.reasons if r.startswith("cp="))
    assert cp_reason.startswith("cp=2: splits each sequence of 131072 tokens over 2 ranks (65536 each)")
    assert (
        "without it the activations of seq_len 131072 need 130.3 GiB/rank in the smallest layout "
        "(pp2·dp2·tp8 zero=2 1f1b sp), 139.9 GiB in all" in cp_reason
    )
    chosen = spec.with_layout(plan.layout)
    assert check_spec(chosen) == [] and check_plan(chosen) == [] and chosen.compile_blocks


def test_context_parallelism_places_the_405b_at_128k_on_16384_gpus():
    """Llama 3.1 405B at its 131072-token context (activation checkpointing): no layout of tp, pp and dp fits
    (the planner refused it before cp was searched), cp does: the least that fits is cp=2 now that the ring's
    blocks run in torch's flash kernel on CUDA (on the math path, whose 65536² fp32 scores per block would
    need far more than a GPU, it was cp=16, the degree Meta trained this model with at 128k)."""
    spec = auto_spec(
        "",
        16384,
        model={
            **{"kind": "llama", "n_layers": 126, "d_model": 16384, "n_heads": 128, "n_kv_heads": 8},
            **{"d_ff": 53248, "vocab_size": 128256, "seq_len": 131072},
        },
        global_batch=2048,
        activation_checkpointing="full",
    )
    plan = resolve_auto(spec)
    assert plan.estimate.layout == "pp14·dp64·tp8 cp2 zero=2 1f1b sp" and plan.estimate.world_size == 14336
    assert plan.candidates_considered <= MAX_AUTO_LAYOUTS
    assert any(r.startswith("cp=2: ") and "above the device's 80.0 GiB" in r for r in plan.reasons)


def test_cp_is_not_tried_when_the_budget_cannot_hold_it():
    """At 8 workers no cp the rules allow fits either: the refusal names the smallest layout, a cp one."""
    with pytest.raises(SpecRejected) as refused:
        resolve_auto(long_context(budget=8))
    message = refused.value.problems[0].message
    assert "no layout of at most 8 workers fits in 80.0 GiB/rank" in message
    assert "the smallest, pp1·dp1·tp2 cp4 zero=3 sp, needs 116.2 GiB/rank (activations 76.7 GiB)" in message


def test_cp_degrees_come_from_the_rules():
    base = case_for(long_context(), ParallelismSpec())
    assert context_parallel_sizes(long_context(), base, 32) == [1, 2, 4, 8, 16, 32]
    # selective checkpointing and compiled blocks run with cp too (the ring is one op to either)
    spec = auto_spec("llama3-8b", 32, seq_len=131072, global_batch=16, activation_checkpointing="selective")
    assert context_parallel_sizes(spec, case_for(spec, ParallelismSpec()), 32) == [1, 2, 4, 8, 16, 32]
    spec = auto_spec("llama3-8b", 32, seq_len=131072, global_batch=16, compile=True)
    assert context_parallel_sizes(spec, case_for(spec, ParallelismSpec()), 32) == [1, 2, 4, 8, 16, 32]
    # a mixture of experts has the ring too (Llama's attention; its load-balancing statistics summed over cp)
    moe = auto_spec("qwen3-30b-a3b", 32, seq_len=32768)
    assert context_parallel_sizes(moe, case_for(moe, ParallelismSpec()), 32) == [1, 2, 4, 8, 16, 32]


def test_the_frugal_layout_of_each_cp_group_needs_the_least_memory():
    """The cp search passes over a (cp, pp, tp) group when its frugal layout does not fit: checked here
    against every layout of every group of the long-context spec."""
    spec = long_context()
    base = case_for(spec, ParallelismSpec())
    checked = 0
    for group in candidate_groups(spec, base, 32):
        if group[0].layout.cp == 1:
            continue
        least = evaluate(frugal_layout(group)).memory.total
        assert all(evaluate(case).memory.total >= least for case in group)
        checked += len(group)
    assert checked > 500


# -- expert parallelism ------------------------------------------------------------------------------------------


def test_a_mixture_of_experts_gets_ep_when_nothing_fits_without_it():
    spec = auto_spec("qwen3-30b-a3b", 8, activation_checkpointing="full")
    plan = resolve_auto(spec)
    assert plan.estimate.layout == "pp1·dp8·tp1 ep8 zero=2" and gib(plan.estimate.memory.total) == 68.7
    ep_reason = next(r for r in plan.reasons if r.startswith("ep="))
    assert ep_reason.startswith(
        "ep=8: no layout with ep=1 fits; the smallest (pp1·dp8·tp1 zero=3) needs 177.1 GiB/rank > 80.0 GiB "
        "(buffers 117.4 GiB); each of the ep=8 ranks of a dp group holds 1/8 of the experts"
    )
    chosen = spec.with_layout(plan.layout)
    assert check_spec(chosen) == [] and check_plan(chosen) == [] and chosen.compile_blocks  # ep compiles (CUDA)


def test_ep_when_the_cost_model_finds_it_faster():
    """Eight sequences a step: ZeRO-3 without ep fits, but gathering every expert for each micro-batch costs
    more than ep's all-to-alls (before ep was searched, the planner chose pp1·dp8·tp1 zero=3)."""
    plan = resolve_auto(auto_spec("qwen3-30b-a3b", 8, activation_checkpointing="full", global_batch=8))
    assert plan.estimate.layout == "pp1·dp8·tp1 ep8 zero=2"
    assert any(
        r.startswith("ep=8: est. step 0.484 s vs 0.911 s for the best layout with ep=1 (pp1·dp8·tp1 zero=3)")
        for r in plan.reasons
    )


def test_ep_stays_1_with_its_reason_where_it_is_slower():
    plan = resolve_auto(auto_spec("qwen3-moe-tiny", 8, global_batch=512))
    assert plan.estimate.layout == "pp1·dp8·tp1 zero=0"
    assert any(
        r.startswith("ep=1: est. step ") and "with expert parallelism (pp1·dp8·tp1 ep8" in r for r in plan.reasons
    )


def test_mixtral_on_8_gpus_does_not_fit_even_with_ep_and_tp():
    with pytest.raises(SpecRejected) as refused:
        resolve_auto(auto_spec("mixtral-8x7b", 8, activation_checkpointing="full"))
    # tensor parallelism splits every expert's width too: 91.1 GiB with tp=4 (98.7 GiB at pp1·dp8·tp1 ep8 zero=3)
    problem = refused.value.problems[0]
    assert "the smallest, pp1·dp2·tp4 ep2 zero=3 sp, needs 91.1 GiB/rank" in problem.message
    # The search leaves CPU offload out, but the fix names the searched layout that fits with it, with its numbers
    # (FSDP2 holds the experts there, so it offloads them too), and that layout passes the plan check as given.
    assert problem.fix.endswith(
        "; or set parallelism.offload: cpu (auto searches without it: host memory is slower), where "
        "pp1·dp2·tp4 ep2 zero=3 sp offload=cpu needs 25.7 GiB/rank on the device and 87.0 GiB/rank of host memory"
    ), problem.fix
    layout = ParallelismSpec(dp=2, tp=4, ep=2, zero=3, sequence_parallel=True, offload="cpu")
    offloaded = auto_spec("mixtral-8x7b", 8, activation_checkpointing="full").with_layout(layout)
    assert check_spec(offloaded) == [] and check_plan(offloaded) == []


def test_no_offload_is_offered_where_it_would_not_fit_either():
    spec = auto_spec("mixtral-8x7b", 2, activation_checkpointing="full")
    with pytest.raises(SpecRejected) as refused:
        resolve_auto(spec)
    assert "offload" not in refused.value.problems[0].fix, refused.value.problems[0].fix
    # on two GPUs even the offloaded experts' gathered blocks and unsharded gradients overflow the device
    offloaded = check_plan(spec.with_layout(ParallelismSpec(dp=2, ep=2, zero=3, offload="cpu")))
    assert [p.field for p in offloaded] == ["parallelism"] and "97.4 GiB" in offloaded[0].message


# -- what does not change, and what every search keeps ----------------------------------------------------------


def test_a_short_context_dense_spec_keeps_its_layout_and_reasons():
    """Pinned from the planner before cp and ep were searched: the same layouts, counts and words."""
    plan = resolve_auto(auto_spec("llama3-8b", 16))
    assert (plan.estimate.layout, plan.candidates_considered, plan.candidates_fitting) == (
        "pp1·dp8·tp2 zero=1 sp",
        44,
        26,
    )
    assert plan.reasons == [
        "budget: at most 16 workers; 44 valid layouts considered, 26 fit in 80.0 GiB/rank",
        "tp=2: est. step 19.4 s vs 38.3 s for the best layout with tp=1 (pp1·dp8·tp1 zero=3)",
        "pp=1: the model fits without pipeline parallelism",
        "zero=1: shards optimizer states over dp=8; at zero=0 optimizer states take 29.9 GiB/rank and the total "
        "83.9 GiB/rank exceeds 80.0 GiB; now 57.8 GiB",
        "sequence_parallel: shards the norms' activations over tp=2 at no extra communication volume",
        "dp=8: world = dp·tp·pp = 8·2·1 uses 16 of 16 workers",
        "chosen pp1·dp8·tp2 zero=1 sp: 57.8 of 80.0 GiB/rank, est. step 19.4 s (compute 16.9, comm 2.5, bubble 0.0%)",
    ]
    example = JobSpec.model_validate(yaml.safe_load((REPO / "examples" / "llama-70b-plan.yaml").read_text()))
    seventy = resolve_auto(example)
    assert (seventy.estimate.layout, seventy.candidates_considered, seventy.candidates_fitting) == (
        "pp1·dp8·tp8 zero=2 sp",
        76,
        3,
    )
    assert seventy.reasons[1] == (
        "tp=8: no layout with tp=1 fits; the smallest (pp1·dp64·tp1 zero=3) needs 294.6 GiB/rank > 80.0 GiB "
        "(buffers 270.2 GiB)"
    )
    assert not any(r.startswith(("cp=", "ep=")) for r in plan.reasons + seventy.reasons)


@pytest.mark.parametrize(
    "spec",
    [
        long_context(),
        auto_spec("qwen3-30b-a3b", 8, activation_checkpointing="full"),
        auto_spec("llama3-8b", 16),
        auto_spec("qwen3-30b-a3b", 16, compile=True),
    ],
    ids=["llama3-8b-128k", "qwen3-30b-a3b", "llama3-8b", "qwen3-compiled"],
)
def test_every_candidate_passes_the_layout_rules_within_the_cap(spec):
    base = case_for(spec, ParallelismSpec())
    cases = list(candidate_layouts(spec, base, spec.parallelism.max_workers))
    assert 0 < len(cases) <= MAX_AUTO_LAYOUTS
    for case in cases:
        assert layout_problems(case, max_dp=case.layout.dp) == [], case.layout
        assert check_spec(spec.with_layout(case.layout)) == [], case.layout
        assert case.compiled == spec.compile_blocks
    axes = {(case.layout.cp > 1, case.layout.ep > 1) for case in cases}
    if spec.model.preset and "a3b" in spec.model.preset:  # a mixture of experts: cp and ep compose
        assert (True, True) in axes, axes


def test_post_plan_answers_the_cp_layout():
    report = plan_report(long_context())
    assert report["feasible"] is True and report["problems"] == []
    assert report["layout"] == "pp1·dp2·tp8 cp2 zero=2 sp"
    assert report["auto"]["layout"]["cp"] == 2 and report["estimate"]["parallelism"]["cp"] == 2
    assert report["estimate"]["comm_per_step"]["bytes"]["cp"] > 0


def test_under_ep_a_compiled_mixture_of_experts_keeps_its_eager_activation_count():
    """With ep > 1 the token exchange and the experts it calls run eagerly between a block's graphs, so the
    planner counts the block's activations eagerly (an overestimate for the rest of it); at ep=1 the compiled
    count applies, and is smaller."""
    from etrain.service.planning.plan_memory import stage_memory
    from etrain.workers.families import MODEL_PRESETS
    from etrain.workers.protocol.run_config import ModelConfig

    model = ModelConfig(**MODEL_PRESETS["qwen3-30b-a3b"])
    common = dict(
        stage=0, pp=1, layers=model.n_layers, virtual_stages=1, held=1, dp=8, tp=1, zero=3, micro_batch=1,
        microbatches=1, precision="bf16", checkpointing="none", device="cuda", overhead=0,
    )  # fmt: skip
    for ep in (1, 2, 8):
        eager = stage_memory(model, **common, ep=ep).activations
        compiled = stage_memory(model, **common, ep=ep, compiled=True).activations
        assert (compiled == eager) is (ep > 1), (ep, compiled, eager)
        if ep == 1:
            assert compiled < 0.8 * eager

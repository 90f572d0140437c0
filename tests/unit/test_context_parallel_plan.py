"""Context parallelism (``parallelism.cp``) in the spec, the layout rules, the planner and ``/v1/plan``.

The engine's side (the ring, equal to one process, checkpoints across cp, the activations a cp rank saves
against these counts) is tests/integration/test_context_parallel.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from etrain.service.planning.estimate import estimate
from etrain.service.planning.plan_comm import cp_traffic
from etrain.service.planning.planner import plan_report
from etrain.service.planning.spec import JobSpec
from etrain.service.planning.spec_checks import check_spec
from etrain.workers.families import MODEL_PRESETS
from etrain.workers.families import layout as family_layout
from etrain.workers.protocol.run_config import ModelConfig, ParallelConfig

LLAMA = {"kind": "llama", "n_layers": 4, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256}


def _spec(*, seq_len: int = 64, model: dict | None = None, training: dict | None = None, **parallelism) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "cp",
            "model": {**(model or LLAMA), "seq_len": seq_len},
            "parallelism": {"dp": 1, **parallelism},
            "training": {"steps": 2, "global_batch": 4, "micro_batch": 2, **(training or {})},
        }
    )


def _fields(problems) -> list[str]:
    return [p["field"] if isinstance(p, dict) else p.field for p in problems]


def test_cp_is_in_the_run_config_world_and_description():
    config = _spec(cp=2, dp=2).to_run_config(job_id="j", checkpoint_root="/tmp/j")
    assert config.parallel.cp == 2 and config.parallel.world_size == 4
    assert config.parallel.describe() == "pp1·dp2·tp1 cp2 zero=0"
    assert ParallelConfig(dp=2).describe() == "pp1·dp2·tp1 zero=0"  # nothing printed at cp=1
    assert not _spec(cp=2).compile_blocks  # the ring does not compile: off by default under cp


def test_the_ring_volume_per_layer_and_micro_batch():
    """Forward: K and V of (cp-1)/cp of the sequence; backward: them again and their fp32 gradients cp times."""
    tokens, kv, layers, m = 2 * 64, 32, 3, 2
    block = tokens / 4 * 2 * kv  # one rank's K and V elements at cp=4
    volume, ops = cp_traffic(
        cp=4, microbatches=m, layers=layers, tokens=tokens, kv_width=kv, elem_bytes=2, checkpointing="none"
    )
    assert volume == m * layers * (3 * block * 2 + 3 * block * 2 + 4 * block * 4)
    assert ops == m * layers * (3 + 3 + 4)
    replayed, replayed_ops = cp_traffic(
        cp=4, microbatches=m, layers=layers, tokens=tokens, kv_width=kv, elem_bytes=2, checkpointing="full"
    )
    assert replayed == volume + m * layers * 3 * block * 2 and replayed_ops == ops + m * layers * 3
    assert cp_traffic(
        cp=1, microbatches=m, layers=layers, tokens=tokens, kv_width=kv, elem_bytes=2, checkpointing="none"
    ) == (0.0, 0)


def test_the_plan_divides_activations_by_cp_and_keeps_the_parameters():
    one, two = estimate(_spec()), estimate(_spec(cp=2))
    assert two.world_size == 2 and two.cp == 2 and two.layout == "pp1·dp1·tp1 cp2 zero=0"
    assert two.params_per_rank == one.params_per_rank  # replicated over cp
    assert two.memory.parameters == one.memory.parameters
    assert two.memory.optimizer_states == one.memory.optimizer_states
    # the sequence-proportional activations halve; the ring keeps a little more than the fused kernel
    assert 0.45 * one.memory.activations < two.memory.activations < 0.6 * one.memory.activations
    assert two.memory.logits == pytest.approx(one.memory.logits / 2, rel=0.01)
    model = ModelConfig(arch="llama", seq_len=64, **{k: v for k, v in LLAMA.items() if k != "kind"})
    want, want_ops = cp_traffic(
        cp=2,
        microbatches=2,
        layers=4,
        tokens=2 * 64,
        kv_width=model.kv_heads * model.head_dim,
        elem_bytes=4,
        checkpointing="none",
    )
    assert two.comm.cp == want and two.comm.cp_ops == want_ops and one.comm.cp == 0
    assert two.comm.dp > 0 and one.comm.dp == 0  # DDP all-reduces over the dp·cp ranks
    assert two.memory.transient > 0  # one block's scores while the ring computes it
    report = plan_report(_spec(cp=2))
    assert report["feasible"], report["problems"]
    assert report["estimate"]["parallelism"]["cp"] == 2
    assert report["estimate"]["comm_per_step"]["bytes"]["cp"] == two.comm.cp


def test_fsdp_shards_over_dp_times_cp():
    """zero 3 at dp=1 is refused, but not with cp=2: FSDP2 then shards over the two cp ranks."""
    assert _fields(plan_report(_spec(zero=3))["problems"]) == ["parallelism.zero"]
    sharded = estimate(_spec(cp=2, zero=3))
    assert plan_report(_spec(cp=2, zero=3))["feasible"]
    assert sharded.memory.optimizer_states == pytest.approx(estimate(_spec(cp=2)).memory.optimizer_states / 2, rel=0.01)


@pytest.mark.parametrize(
    "spec, words",
    [
        (dict(cp=3), "needs model.seq_len divisible by 2·cp = 6"),
        (dict(cp=2, seq_len=30), "needs model.seq_len divisible by 2·cp = 4"),
    ],
    ids=["seq_len", "seq_len_cp2"],
)
def test_bad_context_layouts_get_a_422_naming_parallelism_cp(spec, words):
    report = plan_report(_spec(**spec))
    assert not report["feasible"]
    problems = [p for p in report["problems"] if p["field"] == "parallelism.cp"]
    assert problems and any(words in p["message"] for p in problems), report["problems"]
    assert all(p["fix"] for p in problems)


def test_cp_runs_with_compiled_blocks_and_every_checkpointing():
    assert check_spec(_spec(cp=2, training={"compile": True})) == []  # the ring op compiles in the graph
    for mode in ("none", "full", "selective"):  # selective keeps the ring op's outputs
        assert check_spec(_spec(cp=2, training={"activation_checkpointing": mode})) == [], mode


def test_every_family_has_the_ring_and_the_rule_names_them_for_one_without(monkeypatch):
    from etrain.workers.families import family

    moe = ModelConfig(**{**MODEL_PRESETS["qwen3-moe-tiny"], "seq_len": 16})
    assert family_layout.cp_problems(moe, cp=2) == []  # a mixture of experts too
    assert family_layout.cp_problems(dataclasses.replace(moe, arch="mixtral"), cp=2) == []
    monkeypatch.setattr(family("qwen3_moe"), "context_parallel", False)  # a family without it
    (problem,) = family_layout.cp_problems(moe, cp=2)
    assert problem.field == "parallelism.cp" and "has no ring attention" in problem.message
    assert "'qwen3_moe'" not in problem.message.split("runs on the families")[1] and "'llama'" in problem.message


def test_the_gpt_plan_keeps_its_position_embedding_whole():
    """cp splits the GPT's activations, not its (seq_len x d_model) position embedding."""
    gpt = {"kind": "gpt", "n_layers": 2, "d_model": 64, "n_heads": 4, "vocab_size": 256}
    one, two = estimate(_spec(model=gpt)), estimate(_spec(model=gpt, cp=2))
    assert two.memory.parameters == one.memory.parameters and two.params_per_rank == one.params_per_rank
    assert two.memory.activations < 0.6 * one.memory.activations


def test_the_service_counts_every_cp_rank_in_its_gang_supervisor_and_straggler_stages():
    """A cp job goes through the service like any layout: admission places pp * cp tp groups per replica,
    the supervisor expects pp * dp * cp * tp ranks, and every rank of a stage (cp slices included) is a
    straggler peer of the others."""
    from etrain.service.decisions.job_policy import gang_for, policy_for
    from etrain.service.decisions.stragglers import stage_map
    from etrain.service.decisions.supervisor_state import SupervisorConfig

    spec = _spec(cp=2)
    assert check_spec(spec) == [] and plan_report(spec)["feasible"]
    layout = spec.layout
    config = spec.to_run_config(job_id="j", checkpoint_root="/tmp")
    supervised = SupervisorConfig.of(policy_for(spec), config, job_id="j")
    assert supervised.world_size(layout.dp) == config.parallel.world_size == layout.pp * layout.dp * 2 * layout.tp
    assert gang_for(spec).ranks(layout.dp) == config.parallel.world_size
    stages = stage_map(pp=2, dp=2, tp=1, cp=2)
    assert stages == {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1, 7: 1}


def test_tensor_parallelism_composes_and_sequence_parallelism_splits_a_cp_rank_s_tokens():
    tp = estimate(_spec(cp=2, tp=2))
    assert plan_report(_spec(cp=2, tp=2))["feasible"] and tp.world_size == 4
    assert tp.comm.cp == estimate(_spec(cp=2)).comm.cp / 2  # a tp rank's ring carries its kv heads
    mha = {**LLAMA, "n_kv_heads": 4}
    # seq 12, cp 2: a rank holds 6 tokens, which tp=4 cannot split (12 itself would be)
    report = plan_report(_spec(seq_len=12, model=mha, cp=2, tp=4, sequence_parallel=True))
    (problem,) = [p for p in report["problems"] if p["field"] == "parallelism.sequence_parallel"]
    assert "12 / 2 = 6 is not divisible by parallelism.tp=4" in problem["message"]


def test_pipeline_parallelism_composes():
    pipelined = estimate(_spec(cp=2, pp=2))
    assert plan_report(_spec(cp=2, pp=2))["feasible"] and pipelined.world_size == 4
    assert pipelined.comm.pp == estimate(_spec(pp=2)).comm.pp / 2  # the stages pass a cp rank's tokens on


def test_zero1_shards_the_optimizer_state_over_dp_times_cp():
    assert plan_report(_spec(cp=2, zero=1))["feasible"]
    states = estimate(_spec(cp=2, zero=1)).memory.optimizer_states
    assert states == pytest.approx(estimate(_spec(cp=2)).memory.optimizer_states / 2, rel=0.01)


def test_hsdp_shards_within_a_replica_s_dp_shard_times_cp_ranks():
    spec = _spec(cp=2, dp=2, zero=3, dp_replicate=2, training={"global_batch": 8})
    assert plan_report(spec)["feasible"], plan_report(spec)["problems"]
    # two replicas of dp_shard·cp = 1·2 ranks: the states split in 2, as FSDP2 over the cp pair alone
    assert estimate(spec).memory.optimizer_states == estimate(_spec(cp=2, zero=3)).memory.optimizer_states

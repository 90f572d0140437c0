"""Expert parallelism (``parallelism.ep``) on real gloo ranks: equal to one process, and resharded by checkpoints.

The tiny Qwen3-MoE preset (8 experts, top-2, the load-balancing loss weighted 0.01 so that it moves the
router), at a 16-token context, trained as one process is the reference. On two ranks (one spawn, several
Trainers on the same process group):

* the reference's step-2 weights, exported to the Hugging Face layout, load into ep=2 bit for bit, each
  rank reading the dense weights and its own 4 experts' tensors;
* ep=2 with DDP (zero 0), with FSDP2 (zero 3; and with CPU offload), and with FSDP2 (zero 2) under full activation
  checkpointing (the backward replays the all-to-alls), each rank holding 4 of the 8 experts of each
  layer, train the reference's losses, gradient norms and final parameters within the equivalence
  tolerances (1e-5 relative on losses);
* ep=2 restored from the reference's step-2 checkpoint trains on to its losses (ep=1 -> ep=2), and one
  process restored from the ep=2 run's step-2 checkpoint trains on to the same losses (ep=2 -> ep=1);
* ep=2 with ZeRO-1 (the dense weights' optimizer state sharded over dp, the experts' AdamW beside it)
  trains the reference's numbers, and its checkpoint reshards both ways as well.

On four ranks: ep=2 × dp=4 (two pairs of ranks, each pair splitting the experts, the expert gradients
averaged over the pairs) equals one process too, with DDP and with HSDP (dp_replicate=2) for the dense
weights; and under FSDP2, which then shards each pair's experts over the two ranks holding them (a rank
holds 2 of the 8, reads only those from a Hugging Face folder, and holds what the planner counts), with
ZeRO-3, ZeRO-2 under full checkpointing, CPU offload and compiled blocks. On eight ranks, dp4·tp2·ep2 under
ZeRO-3 with sequence parallelism, FSDP2 sharding the experts split by expert and width, and dp8·ep2 under HSDP
(two replica groups of four), FSDP2 sharding each group's experts within it. The tiny Mixtral preset trains one process's numbers at
ep=2 under DDP and FSDP2 as well, and with compiled blocks (``aot_eager``: the exchange runs eagerly
between each block's graphs). The refusals are checked before any process group.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from etrain.service.planning.plan_memory import stage_memory
from etrain.workers import families
from etrain.workers.families import MODEL_PRESETS
from etrain.workers.protocol.errors import ConfigError
from etrain.workers.protocol.memory_resume import replica_key
from etrain.workers.protocol.run_config import ModelConfig, ParallelConfig
from tests.dist_utils import run_distributed
from tests.equivalence_utils import LOSS_RTOL, RunResult, assert_equivalent, save_and_commit, small_config
from tests.moe_utils import MEASURED_BLOCK
from tests.state_utils import full_state_dict

STEPS, SAVE_AT = 4, 2
MOE = dataclasses.replace(ModelConfig(**MODEL_PRESETS["qwen3-moe-tiny"]), seq_len=16, router_aux_loss_coef=0.01)
BASE = small_config(steps=STEPS, model=MOE)


def _config(parallel: ParallelConfig):
    return dataclasses.replace(BASE, parallel=parallel)


def _result(trainer, history) -> RunResult:
    return RunResult(
        rank=trainer.rank,
        losses=[m.loss for m in history],
        grad_norms=[m.grad_norm for m in history],
        params=full_state_dict(trainer),
    )


def _train(config, rank: int, world_size: int, *, save_root: str | None = None, restore: str | None = None, **training):
    from etrain.workers.checkpoints.checkpoint_commit import step_dir
    from etrain.workers.engine.train import Trainer

    torch.manual_seed(0)
    config = dataclasses.replace(config, training=dataclasses.replace(config.training, **training))
    trainer = Trainer(config, rank=rank, world_size=world_size, device=torch.device("cpu"))
    start = trainer.restore(step_dir(restore, SAVE_AT)) if restore else 0
    history = trainer.run(start, SAVE_AT) if start < SAVE_AT else []
    if save_root:
        save_and_commit(trainer, save_root, world_size)
    history += trainer.run(trainer.next_step, STEPS)
    return _result(trainer, history)


def _two_ranks(rank: int, world_size: int, root: str) -> dict:
    """Hugging Face weights into ep=2; ep=2 under DDP (saving at step 2) and FSDP2; ep=2 restored from the
    one-process checkpoint."""
    from etrain.workers.checkpoints.hf_io import load_hf_weights
    from etrain.workers.engine.train import Trainer

    trainer = Trainer(_config(ParallelConfig(dp=2, ep=2)), rank=rank, world_size=world_size, device=torch.device("cpu"))
    (model,) = trainer.model_parts
    experts = model.layers["0"].feed_forward.experts.w1
    local_experts = experts.to_local().shape[0]
    report = load_hf_weights(trainer.model_parts, f"{root}/hf", MOE)  # each rank reads its own experts' tensors
    loaded = full_state_dict(trainer)
    del trainer
    return {
        "local_experts": local_experts,
        "hf_read": (report.elements_read, report.local_elements),
        "hf_loaded": loaded,
        "ddp": _train(_config(ParallelConfig(dp=2, ep=2)), rank, world_size, save_root=f"{root}/ep2"),
        "fsdp": _train(_config(ParallelConfig(dp=2, ep=2, zero=3)), rank, world_size),
        # dp = ep: FSDP2 holds the experts on one edp rank only to move them to host memory
        "offload": _train(_config(ParallelConfig(dp=2, ep=2, zero=3, offload="cpu")), rank, world_size),
        # full checkpointing replays each block's forward in the backward, its all-to-alls included
        "recompute": _train(
            _config(ParallelConfig(dp=2, ep=2, zero=2)), rank, world_size, activation_checkpointing="full"
        ),
        "restored": _train(_config(ParallelConfig(dp=2, ep=2)), rank, world_size, restore=f"{root}/one"),
        # ZeRO-1 over the dense weights, an AdamW of their own for the experts; saved at step 2
        "zero1": _train(_config(ParallelConfig(dp=2, ep=2, zero=1)), rank, world_size, save_root=f"{root}/ep2z1"),
        "zero1_restored": _train(_config(ParallelConfig(dp=2, ep=2, zero=1)), rank, world_size, restore=f"{root}/one"),
    }


def _experts_sharded_over_edp(rank: int, world_size: int, root: str) -> dict:
    """dp4·ep2 under FSDP2: each rank holds 2 of the 8 experts (4 per ep rank, halved over edp=2), loads its
    own experts' Hugging Face tensors and nothing more, and trains one process's numbers under ZeRO-3, ZeRO-2
    with full checkpointing (the recompute gathers the experts again), ZeRO-3 with CPU offload and ZeRO-3
    with compiled blocks (the experts run eagerly between the graphs, their gathers too); its checkpoint
    restores into one process."""
    from etrain.workers.checkpoints.hf_io import load_hf_weights
    from etrain.workers.engine.train import Trainer

    parallel = ParallelConfig(dp=4, ep=2, zero=3)
    trainer = Trainer(_config(parallel), rank=rank, world_size=world_size, device=torch.device("cpu"))
    (model,) = trainer.model_parts
    w1 = model.layers["0"].feed_forward.experts.w1
    report = load_hf_weights(trainer.model_parts, f"{root}/hf", MOE)
    loaded = full_state_dict(trainer)
    del trainer
    return {
        "local_experts": w1.to_local().shape[0],
        "placements": str(w1.placements),
        "hf_read": (report.elements_read, report.local_elements),
        "hf_loaded": loaded,
        "zero3": _train(_config(parallel), rank, world_size, save_root=f"{root}/dp4ep2z3"),
        "zero2": _train(_config(ParallelConfig(dp=4, ep=2, zero=2)), rank, world_size, activation_checkpointing="full"),
        "offload": _train(_config(ParallelConfig(dp=4, ep=2, zero=3, offload="cpu")), rank, world_size),
        "compiled": _train(_config(parallel), rank, world_size, compile=True),
        # context parallelism: dp2·cp2·ep2, the two cp ranks of an edp index hold the same experts, so FSDP2
        # shards them over those two (edp·cp, flattened over the ep dimension between them)
        "cp_held": _held(_config(ParallelConfig(dp=2, cp=2, ep=2, zero=3)), rank, world_size),
        "cp": _train(_config(ParallelConfig(dp=2, cp=2, ep=2, zero=3)), rank, world_size, save_root=f"{root}/cp2ep2"),
    }


def _held(config, rank: int, world_size: int, *, train_steps: int = 0) -> tuple:
    """The local shapes of a rank's first layer's w1 and w2 experts, the parameter elements it holds, its local
    shard of those w1 experts after ``train_steps`` steps, and those steps' results."""
    from etrain.workers.engine.train import Trainer

    torch.manual_seed(0)
    trainer = Trainer(config, rank=rank, world_size=world_size, device=torch.device("cpu"))
    (model,) = trainer.model_parts
    experts = model.layers["0"].feed_forward.experts
    shapes = [tuple(experts.w1.to_local().shape), tuple(experts.w2.to_local().shape)]
    held = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    history = trainer.run(0, train_steps)
    return shapes, held, experts.w1.to_local().detach().clone(), _result(trainer, history)


def _eight_ranks(rank: int, world_size: int, root: str) -> dict:
    """Three layouts of eight ranks under FSDP2, the first two saved at step 2:

    * dp4·tp2·ep2: every expert split by width over tp, the experts by expert over ep, and FSDP2 shards each
      rank's over the two edp ranks holding the same ones (an (edp, ep, tp) spec);
    * dp8·ep2 under HSDP (2 replica groups of 4): FSDP2 shards each rank's experts over the two ranks of its
      replica group holding the same ones, and replicates them over the groups;
    * dp4·cp2·ep2 under HSDP (2 replica groups of dp2·cp2): one rank of a group holds each ep index's experts
      on each cp index, so FSDP2 shards them over the group's cp pair."""
    tp2 = _config(ParallelConfig(dp=4, tp=2, ep=2, zero=3, sequence_parallel=True))
    hsdp = _config(ParallelConfig(dp=8, ep=2, zero=3, dp_replicate=2))
    hsdp = dataclasses.replace(hsdp, training=dataclasses.replace(hsdp.training, micro_batch=1))  # 8 sequences
    hsdp_cp = _config(ParallelConfig(dp=4, cp=2, ep=2, zero=3, dp_replicate=2))
    return {
        "hsdp_cp": _held(hsdp_cp, rank, world_size, train_steps=STEPS),
        "tp2": _held(tp2, rank, world_size),
        "hsdp": _held(hsdp, rank, world_size, train_steps=2),
        "zero3_sp": _train(tp2, rank, world_size, save_root=f"{root}/tp2ep2"),
        "hsdp_run": _train(hsdp, rank, world_size, save_root=f"{root}/hsdp-ep2"),
    }


def _four_ranks(rank: int, world_size: int) -> tuple[RunResult, dict, RunResult, dict]:
    import torch.distributed as dist

    from etrain.workers.engine.mesh import build_device_mesh
    from etrain.workers.protocol.topology import Topology

    mesh = build_device_mesh(Topology(pp=1, dp=4, tp=1), "cpu", ep=2)
    groups = {axis: tuple(dist.get_process_group_ranks(mesh.get_group(axis))) for axis in ("ep", "edp")}
    hsdp = _train(_config(ParallelConfig(dp=4, ep=2, zero=3, dp_replicate=2)), rank, world_size)
    return (
        _train(_config(ParallelConfig(dp=4, ep=2)), rank, world_size),
        groups,
        hsdp,
        {
            # tensor parallelism with expert parallelism: each expert split by width over tp, the experts by
            # expert over ep (a (edp, ep, tp) DTensor); DDP-style replicate, then FSDP2 with sequence parallelism
            "dp2_tp2_ep2": _train(_config(ParallelConfig(dp=2, tp=2, ep=2)), rank, world_size),
            "dp2_tp2_ep2_zero3_sp": _train(
                _config(ParallelConfig(dp=2, tp=2, ep=2, zero=3, sequence_parallel=True)), rank, world_size
            ),
            "dp2_tp2_zero3": _train(_config(ParallelConfig(dp=2, tp=2, zero=3)), rank, world_size),
            # pipeline stages pass the routing statistics on with the activations; with ep, and with tp (3D)
            "pp2_dp2_ep2": _train(_config(ParallelConfig(pp=2, dp=2, ep=2)), rank, world_size),
            "pp2_tp2": _train(_config(ParallelConfig(pp=2, tp=2)), rank, world_size),
        },
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[RunResult, str]:
    """One process (no process group), saving at step 2: the reference, and the ep=1 checkpoint."""
    root = str(tmp_path_factory.mktemp("ep"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(BASE, 0, 1, save_root=f"{root}/one"), root
    finally:
        torch.set_num_threads(threads)


def _assert_losses(reference: RunResult, losses: list[float], *, first: int, layout: str) -> None:
    for offset, got in enumerate(losses):
        want = reference.losses[first + offset]
        assert abs(got - want) <= LOSS_RTOL * abs(want), f"{layout} step {first + offset}: {got} vs one process {want}"


def _assert_loaded_the_reference_at_save(ranks: list[dict], root: str) -> None:
    """Every rank's model after loading the exported Hugging Face folder is the reference's at step 2, bit
    for bit (gathered whole)."""
    from etrain.workers.checkpoints.checkpoint_commit import step_dir
    from etrain.workers.engine.train import Trainer

    at_save = Trainer(BASE, rank=0, world_size=1, device=torch.device("cpu"))
    at_save.restore(step_dir(f"{root}/one", SAVE_AT))
    want = full_state_dict(at_save)
    for r in ranks:
        assert r["hf_loaded"].keys() == want.keys()
        assert all(torch.equal(r["hf_loaded"][k], v) for k, v in want.items())


def test_ep2_trains_like_one_process_and_reshards(reference):
    from etrain.workers.checkpoints.checkpoint_commit import step_dir
    from etrain.workers.checkpoints.hf_io import export_hf

    one, root = reference
    export_hf(step_dir(f"{root}/one", SAVE_AT), f"{root}/hf", MOE)  # the step-2 weights in the hub's layout
    ranks = run_distributed(_two_ranks, 2, root, timeout_s=240)
    assert [r["local_experts"] for r in ranks] == [4, 4]  # 8 experts split over 2 ranks
    experts = MOE.n_layers * 3 * MOE.n_experts * MOE.d_model * MOE.expert_dim
    for r in ranks:  # every rank reads the dense weights and its 4 experts' tensors, nothing more
        assert r["hf_read"][0] == r["hf_read"][1] == families.num_params(MOE) - experts // 2
    _assert_loaded_the_reference_at_save(ranks, root)
    print(f"qwen3_moe ep2: losses {ranks[0]['ddp'].losses} vs one process {one.losses}")
    assert_equivalent(one, [r["ddp"] for r in ranks], layout="qwen3_moe dp2 ep2 zero=0")
    assert_equivalent(one, [r["fsdp"] for r in ranks], layout="qwen3_moe dp2 ep2 zero=3")
    assert_equivalent(one, [r["offload"] for r in ranks], layout="qwen3_moe dp2 ep2 zero=3 offload=cpu")
    assert_equivalent(one, [r["recompute"] for r in ranks], layout="qwen3_moe dp2 ep2 zero=2 full checkpointing")
    assert_equivalent(one, [r["zero1"] for r in ranks], layout="qwen3_moe dp2 ep2 zero=1")
    # ep=1 (one process) -> ep=2: the steps after the restore are the uninterrupted run's
    for r in ranks:
        _assert_losses(one, r["restored"].losses, first=SAVE_AT, layout="ep1 -> ep2")
        _assert_losses(one, r["zero1_restored"].losses, first=SAVE_AT, layout="ep1 -> ep2 zero=1")
    # ep=2 -> ep=1: one process restores the ep=2 checkpoint and trains on to the same losses
    restored = _train(BASE, 0, 1, restore=f"{root}/ep2")
    _assert_losses(one, restored.losses, first=SAVE_AT, layout="ep2 -> ep1")
    assert len(restored.losses) == STEPS - SAVE_AT
    # ep=2 with ZeRO-1 (two optimizers: the dense weights' sharded, the experts') -> one process
    restored = _train(BASE, 0, 1, restore=f"{root}/ep2z1")
    _assert_losses(one, restored.losses, first=SAVE_AT, layout="ep2 zero=1 -> ep1")
    assert len(restored.losses) == STEPS - SAVE_AT


def _planned_elements(*, dp: int, tp: int, ep: int, dp_replicate: int = 1, cp: int = 1) -> float:
    """The parameter elements the planner counts on a rank of the tiny MoE under ZeRO-3."""
    planned = stage_memory(
        MOE,
        stage=0,
        pp=1,
        layers=MOE.n_layers,
        virtual_stages=1,
        held=1,
        dp=dp,
        tp=tp,
        zero=3,
        micro_batch=1,
        microbatches=1,
        precision="fp32",
        checkpointing="none",
        device="cpu",
        overhead=0.0,
        ep=ep,
        dp_replicate=dp_replicate,
        cp=cp,
    )
    return planned.parameters / 4


def test_fsdp2_shards_the_experts_over_the_ranks_holding_the_same_ones(reference, monkeypatch):
    from etrain.workers.checkpoints.checkpoint_commit import step_dir
    from etrain.workers.checkpoints.hf_io import export_hf

    one, root = reference
    monkeypatch.setenv("ETRAIN_COMPILE_BACKEND", "aot_eager")  # the ranks inherit it
    if not os.path.isdir(f"{root}/hf"):
        export_hf(step_dir(f"{root}/one", SAVE_AT), f"{root}/hf", MOE)
    ranks = run_distributed(_experts_sharded_over_edp, 4, root, timeout_s=240)
    assert [r["local_experts"] for r in ranks] == [2, 2, 2, 2], [r["placements"] for r in ranks]
    experts = MOE.n_layers * 3 * MOE.n_experts * MOE.d_model * MOE.expert_dim
    dense = families.num_params(MOE) - experts
    for r in ranks:  # its quarter of the dense weights (ZeRO-3) and its own 2 experts' tensors, nothing more
        assert r["hf_read"][0] == r["hf_read"][1] == dense // 4 + experts // 4
    assert _planned_elements(dp=4, tp=1, ep=2) == dense // 4 + experts // 4  # what the planner counts a rank holds
    _assert_loaded_the_reference_at_save(ranks, root)
    assert_equivalent(one, [r["zero3"] for r in ranks], layout="qwen3_moe dp4 ep2 zero=3 (experts sharded over edp)")
    assert_equivalent(
        one, [r["zero2"] for r in ranks], layout="qwen3_moe dp4 ep2 zero=2 full checkpointing (experts sharded)"
    )
    assert_equivalent(one, [r["compiled"] for r in ranks], layout="qwen3_moe dp4 ep2 zero=3 compiled (experts sharded)")
    assert_equivalent(one, [r["offload"] for r in ranks], layout="qwen3_moe dp4 ep2 zero=3 offload=cpu")
    restored = _train(BASE, 0, 1, restore=f"{root}/dp4ep2z3")  # the sharded experts -> one process
    _assert_losses(one, restored.losses, first=SAVE_AT, layout="dp4 ep2 zero=3 -> one process")
    # dp2·cp2·ep2: 2 of the 8 experts a rank (4 per ep rank, halved over the cp pair), what the planner counts
    e, d, f = MOE.n_experts, MOE.d_model, MOE.expert_dim
    assert all(r["cp_held"][0] == [(e // 4, f, d), (e // 4, d, f)] for r in ranks), ranks[0]["cp_held"]
    assert [r["cp_held"][1] for r in ranks] == [dense // 4 + experts // 4] * 4
    assert _planned_elements(dp=2, tp=1, ep=2, cp=2) == dense // 4 + experts // 4
    assert_equivalent(one, [r["cp"] for r in ranks], layout="qwen3_moe dp2 cp2 ep2 zero=3 (experts sharded over cp)")
    restored = _train(BASE, 0, 1, restore=f"{root}/cp2ep2")
    _assert_losses(one, restored.losses, first=SAVE_AT, layout="dp2 cp2 ep2 zero=3 -> one process")


def test_fsdp2_shards_experts_under_tensor_parallelism_and_hsdp(reference):
    one, root = reference
    ranks = run_distributed(_eight_ranks, 8, root, timeout_s=300)
    e, d, f = MOE.n_experts, MOE.d_model, MOE.expert_dim
    # 8 experts: 4 per ep rank, 2 per rank holding the same ones (over edp; under HSDP within a replica group);
    # under tp each also split by width. A rank holds what the planner counts.
    assert all(r["tp2"][0] == [(e // 4, f // 2, d), (e // 4, d, f // 2)] for r in ranks), ranks[0]["tp2"]
    assert all(r["hsdp"][0] == [(e // 4, f, d), (e // 4, d, f)] for r in ranks), ranks[0]["hsdp"]
    assert [r["tp2"][1] for r in ranks] == [_planned_elements(dp=4, tp=2, ep=2)] * 8
    assert [r["hsdp"][1] for r in ranks] == [_planned_elements(dp=8, tp=1, ep=2, dp_replicate=2)] * 8
    assert_equivalent(one, [r["zero3_sp"] for r in ranks], layout="qwen3_moe dp4 tp2 ep2 zero=3 sp (experts sharded)")
    # eight ranks take one sequence each: the reference too (the load-balancing loss is per micro-batch)
    single = dataclasses.replace(BASE, training=dataclasses.replace(BASE.training, micro_batch=1))
    one_by_one = _train(single, 0, 1)
    assert_equivalent(
        one_by_one, [r["hsdp_run"] for r in ranks], layout="qwen3_moe dp8 ep2 zero=3 hsdp=2 (experts sharded)"
    )
    # An in-place repair restores a lost rank from a rank with the same state key (memory_resume.replica_key):
    # under HSDP with the experts sharded, those hold the very same expert shard after training, and no other
    # rank holds it.
    keys = [replica_key(rank, dp=8, zero=3, dp_replicate=2, ep=2) for rank in range(8)]
    for a in range(8):
        for b in range(a + 1, 8):
            same = torch.equal(ranks[a]["hsdp"][2], ranks[b]["hsdp"][2])
            assert same == (keys[a] == keys[b]), (a, b, keys[a], keys[b])
    assert len(set(keys)) == 4  # four distinct shards, each held by one rank of each replica group
    # dp4·cp2·ep2 under HSDP: 2 of the 8 experts a rank, equal to one process; the ranks with the same state key
    # (data group index dp_index · cp + cp_index = the rank here) hold the same expert shard, and no others
    assert all(r["hsdp_cp"][0] == [(e // 4, f, d), (e // 4, d, f)] for r in ranks), ranks[0]["hsdp_cp"]
    assert [r["hsdp_cp"][1] for r in ranks] == [_planned_elements(dp=4, tp=1, ep=2, dp_replicate=2, cp=2)] * 8
    assert_equivalent(one, [r["hsdp_cp"][3] for r in ranks], layout="qwen3_moe dp4 cp2 ep2 zero=3 hsdp=2")
    keys = [replica_key(rank, dp=4, zero=3, dp_replicate=2, ep=2, cp=2) for rank in range(8)]
    for a in range(8):
        for b in range(a + 1, 8):
            same = torch.equal(ranks[a]["hsdp_cp"][2], ranks[b]["hsdp_cp"][2])
            assert same == (keys[a] == keys[b]), (a, b, keys[a], keys[b])
    assert len(set(keys)) == 4
    for reference_run, config, name in ((one, BASE, "tp2ep2"), (one_by_one, single, "hsdp-ep2")):
        restored = _train(config, 0, 1, restore=f"{root}/{name}")  # the shards -> one process
        _assert_losses(reference_run, restored.losses, first=SAVE_AT, layout=f"{name} zero=3 -> one process")


def test_ep2_dp4_trains_like_one_process_with_ddp_and_hsdp(reference):
    one, _ = reference
    ranks = run_distributed(_four_ranks, 4, timeout_s=240)
    # an ep group is a run of ep consecutive dp ranks; the ranks holding the same experts are ep apart
    assert [groups for _, groups, _, _ in ranks] == [
        {"ep": (0, 1), "edp": (0, 2)},
        {"ep": (0, 1), "edp": (1, 3)},
        {"ep": (2, 3), "edp": (0, 2)},
        {"ep": (2, 3), "edp": (1, 3)},
    ]
    results = [result for result, _, _, _ in ranks]
    print(f"qwen3_moe dp4 ep2: losses {results[0].losses} vs one process {one.losses}")
    assert_equivalent(one, results, layout="qwen3_moe dp4 ep2 zero=0")
    # HSDP (2 replicas x 2 shards) for the dense weights, the experts split over ep=2 beside it
    assert_equivalent(one, [hsdp for _, _, hsdp, _ in ranks], layout="qwen3_moe dp4 ep2 zero=3 dp_replicate=2")
    for layout in ("dp2_tp2_ep2", "dp2_tp2_ep2_zero3_sp", "dp2_tp2_zero3", "pp2_dp2_ep2", "pp2_tp2"):
        assert_equivalent(one, [tp[layout] for _, _, _, tp in ranks], layout=f"qwen3_moe {layout}")


#: One block measured at tp=2 against the planner's count (``layer_activation_bytes``), as at tp=1 in
#: tests/unit/test_qwen3_moe.py.
MEASURED = ModelConfig(**MEASURED_BLOCK)


def _saved_at_tp2(sequence_parallel: bool, regime: str, compiled: bool = False) -> tuple[int, float]:
    """(what autograd saves for one block at tp=2 on this rank, what the planner counts), in bytes;
    ``compiled``: under inductor's min-cut partitioner (``aot_eager_decomp_partition``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from etrain.service.planning.plan_activations import layer_activation_bytes
    from etrain.workers.engine.init import initialize_parameters
    from etrain.workers.engine.parallelize import apply_tp
    from etrain.workers.families.qwen3_moe_model import Qwen3Moe
    from tests.autograd_utils import record_local_storage
    from tests.moe_utils import SummedBlock

    model = Qwen3Moe(MEASURED)
    initialize_parameters(model, seed=0, n_layers=1)
    apply_tp(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), sequence_parallel=sequence_parallel)
    block = model.layers["0"]
    local = [p.to_local() if isinstance(p, DTensor) else p for p in block.parameters()]
    skip = {t.untyped_storage().data_ptr() for t in local}
    saved: dict[int, int] = {}

    pack = record_local_storage(saved, skip)

    tokens = MEASURED.seq_len // 2 if sequence_parallel else MEASURED.seq_len  # a sequence shard under SP
    run = block
    if compiled:
        torch._dynamo.reset()
        # graph breaks at the experts' tensor-parallel collectives, as parallelize_stage compiles them
        run = torch.compile(block, backend="aot_eager_decomp_partition", fullgraph=False)
    for hooks in ((lambda t: t, lambda t: t), (pack, lambda tensor: tensor))[0 if compiled else 1 :]:
        saved.clear()  # compiled: a first pass compiles, the second is measured
        x = torch.randn(2, tokens, MEASURED.d_model, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(*hooks):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=regime == "autocast"):
                out = SummedBlock(run)(x)
            out.backward()
    # less what is counted elsewhere: the cached fp32 RoPE tables (module state; both regimes rotate in fp32
    # after Qwen3's q/k norms; compiled, only the inverse frequencies, a graph constant) and autocast's bf16
    # weight casts (weights)
    rope = MEASURED.head_dim // 2 * 4 if compiled else families.family("qwen3_moe").rope_table_bytes(MEASURED)
    casts = sum(2 * t.numel() for t in local if t.ndim >= 2) if regime == "autocast" else 0
    want = layer_activation_bytes(
        MEASURED, micro_batch=2, tp=2, sequence_parallel=sequence_parallel, regime=regime, compiled=compiled
    )
    return sum(saved.values()) - rope - casts, want


def _reduced_over_tp(sequence_parallel: bool) -> tuple[list[int], int, list[int]]:
    """The sizes (elements) of the all-reduces one mixture-of-experts block's experts run over tp=2, forward and
    backward (fp32, a micro-batch of 2), how many reduce-scatters the block's forward runs, and the sizes of
    the hand-written reduce-scatters (the experts' input gradient under sequence parallelism)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from etrain.workers.engine.init import initialize_parameters
    from etrain.workers.engine.parallelize import apply_tp
    from etrain.workers.families.qwen3_moe_model import Qwen3Moe
    from tests.moe_utils import SummedBlock

    model = Qwen3Moe(MEASURED)
    initialize_parameters(model, seed=0, n_layers=1)
    from torch.distributed.tensor.debug import CommDebugMode

    apply_tp(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), sequence_parallel=sequence_parallel)
    sizes: list[int] = []
    scattered: list[int] = []
    all_reduce, reduce_scatter = dist.all_reduce, dist.reduce_scatter_tensor

    def counted(tensor, *args, **kwargs):
        sizes.append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)

    def counted_scatter(output, tensor, *args, **kwargs):
        scattered.append(tensor.numel())
        return reduce_scatter(output, tensor, *args, **kwargs)

    # the experts' hand-written collectives call these; DTensor's run elsewhere
    dist.all_reduce, dist.reduce_scatter_tensor = counted, counted_scatter
    tokens = MEASURED.seq_len // 2 if sequence_parallel else MEASURED.seq_len  # a sequence shard under SP
    try:
        with CommDebugMode() as comms:
            out = SummedBlock(model.layers["0"])(torch.randn(2, tokens, MEASURED.d_model))
        out.backward()
    finally:
        dist.all_reduce, dist.reduce_scatter_tensor = all_reduce, reduce_scatter
    scatters = sum(n for op, n in comms.get_comm_counts().items() if "reduce_scatter" in str(op))
    return sizes, scatters, scattered


def _tensor_parallel_ranks(rank: int, world_size: int, root: str) -> dict:
    """Hugging Face weights into tp=2; tp=2 training (saving at step 2), with sequence parallelism; one
    block's saved activations at tp=2 against the planner's count; pp=2 (saving at step 2) and GPipe."""
    from etrain.workers.checkpoints.hf_io import load_hf_weights
    from etrain.workers.engine.train import Trainer

    trainer = Trainer(_config(ParallelConfig(tp=2)), rank=rank, world_size=world_size, device=torch.device("cpu"))
    report = load_hf_weights(trainer.model_parts, f"{root}/hf-tp", MOE)
    loaded = full_state_dict(trainer)
    experts = trainer.model_parts[0].layers["0"].feed_forward.experts
    widths = [tuple(getattr(experts, name).to_local().shape) for name in ("w1", "w2")]
    del trainer
    return {
        "hf_loaded": loaded,
        "hf_read": (report.elements_read, report.local_elements),
        "local_widths": widths,
        "tp2": _train(_config(ParallelConfig(tp=2)), rank, world_size, save_root=f"{root}/tp2"),
        "tp2_sp": _train(_config(ParallelConfig(tp=2, sequence_parallel=True)), rank, world_size),
        # two pipeline stages (1F1B), saving at step 2, and GPipe
        "pp2": _train(_config(ParallelConfig(pp=2)), rank, world_size, save_root=f"{root}/pp2"),
        "pp2_gpipe": _train(_config(ParallelConfig(pp=2, pp_schedule="gpipe")), rank, world_size),
        "reduced": {sp: _reduced_over_tp(sp) for sp in (False, True)},
        "saved": {
            (sp, regime, compiled): _saved_at_tp2(sp, regime, compiled)
            for sp in (False, True)
            for regime in ("fp32", "autocast")
            for compiled in (False, True)
        },
    }


def test_tensor_and_pipeline_parallel_experts_train_like_one_process_load_hf_and_reshard(reference):
    """Expert tensor parallelism (``MoEParallel``): every expert split by width over tp=2 (gate/up by rows of
    the width, down by its columns), the router replicated, one all-reduce per layer of the tokens' summed
    outputs (not of the k picked rows per token). It loads
    Hugging Face weights exactly, trains one process's numbers with and without sequence parallelism
    (with ep and FSDP2 too: the four-rank test), its checkpoint restores into one process, and the planner's
    activation count is what a tp=2 block saves, exactly. Pipeline parallelism (pp=2, 1F1B and GPipe; with
    ep and with tp in the four-rank test): the routing statistics ride with the activations to the last
    stage, whose load-balancing loss is one process's; its checkpoint restores into one process."""
    from etrain.workers.checkpoints.checkpoint_commit import step_dir
    from etrain.workers.checkpoints.hf_io import export_hf

    one, root = reference
    export_hf(step_dir(f"{root}/one", SAVE_AT), f"{root}/hf-tp", MOE)
    ranks = run_distributed(_tensor_parallel_ranks, 2, root, timeout_s=240)
    e, d, f = MOE.n_experts, MOE.d_model, MOE.expert_dim
    assert all(r["local_widths"] == [(e, f // 2, d), (e, d, f // 2)] for r in ranks)  # half of each width
    for r in ranks:  # a rank reads the slices it holds, nothing more (the experts' halves included)
        assert r["hf_read"][0] == r["hf_read"][1] < families.num_params(MOE), r["hf_read"]
    _assert_loaded_the_reference_at_save(ranks, root)
    print(f"qwen3_moe tp2: losses {ranks[0]['tp2'].losses} vs one process {one.losses}")
    assert_equivalent(one, [r["tp2"] for r in ranks], layout="qwen3_moe tp2")
    assert_equivalent(one, [r["tp2_sp"] for r in ranks], layout="qwen3_moe tp2 sequence parallel")
    restored = _train(BASE, 0, 1, restore=f"{root}/tp2")  # tp=2 -> one process
    _assert_losses(one, restored.losses, first=SAVE_AT, layout="tp2 -> tp1")
    assert len(restored.losses) == STEPS - SAVE_AT
    # pipeline stages: the last one's load-balancing loss sums every layer's routing, as one process's
    assert_equivalent(one, [r["pp2"] for r in ranks], layout="qwen3_moe pp2 1f1b")
    assert_equivalent(one, [r["pp2_gpipe"] for r in ranks], layout="qwen3_moe pp2 gpipe")
    restored = _train(BASE, 0, 1, restore=f"{root}/pp2")  # pp=2 -> one process
    _assert_losses(one, restored.losses, first=SAVE_AT, layout="pp2 -> pp1")
    # One all-reduce of the experts' [tokens, d] output forward, and backward of their input's gradient and of
    # the routing weights' ([tokens, k]): not of the tokens·k picked rows, k times as many (before:
    # 2·tokens·k·d). Under sequence parallelism the forward's is a reduce-scatter along the sequence instead.
    tokens, k, d = 2 * MEASURED.seq_len, MEASURED.experts_per_token, MEASURED.d_model
    reduced, scatters, by_hand = ranks[0]["reduced"][False]
    assert sorted(reduced) == sorted([tokens * d, tokens * d, tokens * k]) and scatters == 0, (reduced, scatters)
    assert by_hand == []
    reduced, scatters, by_hand = ranks[0]["reduced"][True]
    # (two reduce-scatters in the forward: attention's output projection's, as for every SP block, and the
    # experts'); the input's gradient: the experts' partial share reduce-scattered along the sequence
    # ([tokens, d] in, a shard out: half an all-reduce's bytes), the router's whole share sliced, not reduced
    assert sorted(reduced) == [tokens * k] and scatters == 2, (reduced, scatters)
    assert by_hand == [tokens * d], by_hand
    for r in ranks:
        wrong = {case: (got, planned) for case, (got, planned) in r["saved"].items() if got != planned}
        assert not wrong, f"tp=2 (sequence_parallel, regime, compiled): (saved, planned) bytes: {wrong}"


MIXTRAL = dataclasses.replace(ModelConfig(**MODEL_PRESETS["mixtral-tiny"]), seq_len=16, router_aux_loss_coef=0.01)


def _mixtral_ep2(rank: int, world_size: int) -> dict:
    from etrain.workers.engine.compile import compiled_frames
    from etrain.workers.engine.train import Trainer

    base = small_config(steps=STEPS, model=MIXTRAL)
    out = {
        zero: _train(dataclasses.replace(base, parallel=ParallelConfig(dp=2, ep=2, zero=zero)), rank, world_size)
        for zero in (0, 3)
    }
    # Compiled blocks (aot_eager here): the token exchange runs eagerly between each block's graphs.
    compiled = dataclasses.replace(
        base, parallel=ParallelConfig(dp=2, ep=2), training=dataclasses.replace(base.training, compile=True)
    )
    torch.manual_seed(0)
    trainer = Trainer(compiled, rank=rank, world_size=world_size, device=torch.device("cpu"))
    history = trainer.run(0, 1)
    frames = compiled_frames()
    history += trainer.run(1, STEPS)
    out["compiled"] = _result(trainer, history)
    out["frames"] = (frames, compiled_frames())
    # under full checkpointing the blocks compile inside the (eager) checkpoint: the same graphs as without it
    # (compiled around it, the break would run each whole block eagerly: no graph but the loss's)
    torch._dynamo.reset()
    before = compiled_frames()
    full = dataclasses.replace(
        compiled, training=dataclasses.replace(compiled.training, activation_checkpointing="full")
    )
    torch.manual_seed(0)
    trainer = Trainer(full, rank=rank, world_size=world_size, device=torch.device("cpu"))
    out["compiled_full"] = _result(trainer, trainer.run(0, STEPS))
    out["frames_full"] = compiled_frames() - before
    # and under tensor parallelism: the experts' tp collectives run eagerly between the graphs too
    compiled_tp = dataclasses.replace(compiled, parallel=ParallelConfig(tp=2))
    out["compiled_tp2"] = _train(compiled_tp, rank, world_size)
    return out


def test_mixtral_ep2_trains_like_one_process_eager_and_compiled(monkeypatch):
    """The second family with experts (Mixtral: its own router and block, Qwen3-MoE's expert modules)
    splits its experts over ep=2 under DDP and FSDP2 and trains one process's numbers; with compiled
    blocks too, the exchange running eagerly between their graphs, nothing recompiled after step 1; and
    under full checkpointing, the same graphs compiled inside each block's checkpoint."""
    monkeypatch.setenv("ETRAIN_COMPILE_BACKEND", "aot_eager")  # the ranks inherit it
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = _train(small_config(steps=STEPS, model=MIXTRAL), 0, 1)
    finally:
        torch.set_num_threads(threads)
    ranks = run_distributed(_mixtral_ep2, 2, timeout_s=300)
    print(f"mixtral ep2: losses {ranks[0][0].losses} vs one process {one.losses}")
    assert_equivalent(one, [r[0] for r in ranks], layout="mixtral dp2 ep2 zero=0")
    assert_equivalent(one, [r[3] for r in ranks], layout="mixtral dp2 ep2 zero=3")
    assert_equivalent(one, [r["compiled"] for r in ranks], layout="mixtral dp2 ep2 zero=0 compiled")
    assert_equivalent(one, [r["compiled_tp2"] for r in ranks], layout="mixtral tp2 compiled")
    assert_equivalent(one, [r["compiled_full"] for r in ranks], layout="mixtral dp2 ep2 compiled full checkpointing")
    for r in ranks:
        after_first, at_end = r["frames"]
        assert after_first > 0 and at_end == after_first  # compiled at step 1, graph breaks included; no more
        assert r["frames_full"] == after_first, (r["frames_full"], after_first)


@pytest.mark.parametrize(
    "parallel, model, field, words",
    [
        (ParallelConfig(dp=2, ep=3), MOE, "parallelism.ep", "does not divide model.n_experts=8"),
        (ParallelConfig(dp=2, ep=4), MOE, "parallelism.ep", "does not divide parallelism.dp=2"),
        (ParallelConfig(dp=4, ep=2, zero=3, dp_replicate=2, offload="cpu"), MOE, "parallelism.ep", "offload"),
        (
            ParallelConfig(dp=2, ep=2),
            ModelConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64, seq_len=16),
            "parallelism.ep",
            "dense model",
        ),
    ],
    ids=["experts", "dp", "offload", "dense"],
)
def test_bad_expert_layouts_are_refused_before_any_group(parallel, model, field, words):
    from etrain.workers.engine.train import Trainer

    config = dataclasses.replace(BASE, model=model, parallel=parallel)
    with pytest.raises(ConfigError) as caught:
        Trainer(config, rank=0, world_size=parallel.world_size, device=torch.device("cpu"))
    assert caught.value.field == field and words in str(caught.value), str(caught.value)
    assert caught.value.fix

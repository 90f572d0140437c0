"""A checkpoint saved under one parallel layout restores exactly under another (resharding).

A tiny GPT trains two AdamW steps under a layout, is saved with ``save_checkpoint``, committed with
``etrain.workers.checkpoints.checkpoint_commit.commit`` (the supervisor's job), and loaded into a
*differently initialised* model under another layout. The full parameters and the optimizer's
``exp_avg`` / ``exp_avg_sq`` / ``step`` (gathered to full tensors by an independent helper, not by the
checkpoint code) must equal the saved ones within 1e-6, and the restored state must train on.

Layouts are built here, not by the engine: DDP, FSDP2 ``fully_shard`` (ZeRO-3), TP via
``parallelize_module``, ZeRO-1 (DDP + ``ZeroRedundancyOptimizer``), pipeline stages (the model with
other layers deleted, a manual send/recv pipeline; ``pp_virtual`` runs two stages per rank under
ONE optimizer), FSDP2 x TP on four ranks, and a single process. Every optimizer has three parameter
groups (one holding a single parameter, so ZeRO leaves one rank's share of it empty), and restore
targets are built with another learning rate: the checkpoint's hyperparameters must win.

Pairs proven: single -> FSDP2(2); DDP(2), ZeRO-1(2), PP-virtual(2) -> FSDP2(2); FSDP2(2) -> ZeRO-1(2)
and -> PP-virtual(2); TP(2) -> PP(2); FSDP2, TP, PP, ZeRO-1, PP-virtual (2) -> one process;
FSDP2xTP(2x2) -> FSDP2(4) and -> one process; async FSDP2(2) -> DDP(2). To keep the run short, one 2-rank run saves every 2-rank
layout, one 2-rank run loads every pair into 2 ranks, single-process saves and loads run in the
test process itself (no process group), and one 2-rank run covers async save and corruption.

A tied-embedding Llama (GQA, q/k/v biases, q/k norms; one weight under two FQNs) is saved under
FSDP2, TP and ZeRO-1 and restored into each other and into one process, in one more 2-rank run.
"""

from __future__ import annotations

import math
import os
import random
import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import etrain.workers.checkpoints.checkpoint_io as checkpoint_io
from etrain.workers.checkpoints.checkpoint import AsyncCheckpointer, load_checkpoint, save_checkpoint
from etrain.workers.checkpoints.checkpoint_commit import commit, list_steps, prune, step_dir, verify
from etrain.workers.checkpoints.checkpoint_state import capture_rng_state, restore_rng_state
from etrain.workers.engine.init import build_model
from etrain.workers.families.model import cross_entropy_loss
from etrain.workers.protocol.errors import CheckpointError
from etrain.workers.protocol.manifest import ShardReport
from etrain.workers.protocol.run_config import ModelConfig
from tests.dist_utils import run_distributed

MODEL = ModelConfig(n_layers=4, d_model=16, n_heads=2, vocab_size=32, seq_len=8)
#: Same vocabulary, context and depth as MODEL, so batches and stages are shared; tied (Qwen2-style).
LLAMA = ModelConfig(
    arch="llama",
    n_layers=4,
    d_model=16,
    n_heads=4,
    n_kv_heads=2,
    d_ff=32,
    vocab_size=32,
    seq_len=8,
    attention_bias="qkv",
    qk_norm=True,
    tie_embeddings=True,
)
LLAMA_LAYOUTS = ("fsdp", "tp", "zero1")
LLAMA_PAIRS = (("fsdp", "tp"), ("tp", "zero1"), ("zero1", "fsdp"))
TRAIN_STEPS = 2
LR = 1e-2
TOL = 1e-6
TIMEOUT_S = 120.0
TWO_RANK_LAYOUTS = ("ddp", "fsdp", "tp", "zero1", "pp", "pp_virtual")
# (saved under, loaded into) on two ranks; "single" was saved by one process.
TWO_RANK_PAIRS = (
    ("single", "fsdp"),
    ("ddp", "fsdp"),
    ("zero1", "fsdp"),
    ("fsdp", "zero1"),  # ZeRO-3 -> ZeRO-1
    ("pp_virtual", "fsdp"),
    ("tp", "pp"),
    ("fsdp", "pp_virtual"),
)
SINGLE_PAIRS = (("fsdp", "single"), ("tp", "single"), ("pp", "single"), ("zero1", "single"), ("pp_virtual", "single"))


# -- layouts --------------------------------------------------------------------------------------


def _stage(model: nn.Module, index: int, num_stages: int) -> nn.Module:
    """Pipeline stage ``index``: the model with the other stages' layers (and ends) deleted."""
    per_stage = MODEL.n_layers // num_stages
    owned = range(index * per_stage, (index + 1) * per_stage)
    for key in list(model.layers.keys()):
        if int(key) not in owned:
            del model.layers[key]
    if index != 0:
        model.tok_embeddings = model.pos_embeddings = None
    if index != num_stages - 1:
        model.norm = model.output = None
    return model


def _stage_ids(layout: str, rank: int, world_size: int) -> tuple[int, ...]:
    return {"pp": (rank,), "pp_virtual": (rank, rank + world_size)}.get(layout, ())


def _num_stages(layout: str, world_size: int) -> int:
    return {"pp": world_size, "pp_virtual": 2 * world_size}.get(layout, 1)


def _build(
    layout: str, seed: int, lr: float = LR, model_config: ModelConfig = MODEL
) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
    """Model parts and optimizers of ``layout`` on this rank, from weights initialised with ``seed``.

    Restore targets use another ``lr`` too: the checkpoint's hyperparameters must win.
    """

    def _adamw(modules) -> torch.optim.Optimizer:
        return torch.optim.AdamW(_param_groups(modules, lr), lr=lr)

    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if layout in ("pp", "pp_virtual"):
        num_stages = _num_stages(layout, world_size)
        parts = [_stage(build_model(MODEL, seed), s, num_stages) for s in _stage_ids(layout, rank, world_size)]
        if layout == "pp":
            return parts, [_adamw([part]) for part in parts]
        return parts, [_adamw(parts)]  # one optimizer over both parts
    model = build_model(model_config, seed)
    if layout == "single":
        return [model], [_adamw([model])]
    if layout == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
        return [model], [_adamw([model])]
    if layout == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        model = nn.parallel.DistributedDataParallel(model)
        zero = ZeroRedundancyOptimizer(_param_groups([model], lr), optimizer_class=torch.optim.AdamW, lr=lr)
        return [model], [zero]
    if layout == "fsdp_tp":  # 2D: TP inside pairs of adjacent ranks, FSDP2 across them
        mesh_2d = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
        _apply_tp(model, mesh_2d["tp"])
        _apply_fsdp(model, mesh_2d["dp"])
        return [model], [_adamw([model])]
    mesh = init_device_mesh("cpu", (world_size,))
    if layout == "fsdp":
        _apply_fsdp(model, mesh)
        return [model], [_adamw([model])]
    if layout == "tp":
        _apply_tp(model, mesh)
        return [model], [_adamw([model])]
    raise AssertionError(f"unknown layout {layout}")


def _param_groups(modules, lr: float) -> list[dict]:
    """Three groups as a real trainer might have: decayed matrices, undecayed vectors, and one
    parameter alone at half the rate. The lone group is the edge case: ZeRO on two ranks leaves one
    rank's share of it empty, and pipeline stages without the embeddings have no such group."""
    groups = {"matrix": [], "vector": [], "alone": []}
    for module in modules:
        for name, param in module.named_parameters():
            kind = "alone" if name.endswith("pos_embeddings.weight") else "matrix" if param.ndim == 2 else "vector"
            groups[kind].append(param)
    settings = {
        "matrix": dict(weight_decay=0.01),
        "vector": dict(weight_decay=0.0),
        "alone": dict(weight_decay=0.0, lr=lr / 2),
    }
    return [dict(params=params, **settings[kind]) for kind, params in groups.items() if params]


def _apply_fsdp(model: nn.Module, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _apply_tp(model: nn.Module, mesh) -> None:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
    if model.config.arch == "llama":  # SwiGLU's up projection; q/k norms on head-sharded activations
        plan["feed_forward.w3"] = ColwiseParallel()
        if model.config.qk_norm:
            plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    for block in model.layers.values():
        parallelize_module(block, mesh, plan)


def _batch(layout: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel ranks see different rows; TP and PP ranks must see the same ones."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    row_seed = {"ddp": rank, "fsdp": rank, "zero1": rank, "fsdp_tp": rank // 2}.get(layout, 0)
    generator = torch.Generator().manual_seed(1000 * step + row_seed)
    tokens = torch.randint(0, MODEL.vocab_size, (2, MODEL.seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _train(layout: str, parts, optimizers, steps: int, first_step: int = 0) -> float:
    loss = torch.tensor(0.0)
    for step in range(first_step, first_step + steps):
        inputs, targets = _batch(layout, step)
        if layout in ("pp", "pp_virtual"):
            loss = _pipeline_forward_backward(layout, parts, inputs, targets)
        else:
            loss = cross_entropy_loss(parts[0](inputs), targets)
            loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def _pipeline_forward_backward(layout, parts, inputs, targets) -> torch.Tensor:
    """One micro-batch through stages laid round-robin over ranks, with blocking send/recv."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    num_stages = _num_stages(layout, world_size)
    by_stage = dict(zip(_stage_ids(layout, rank, world_size), parts))
    hidden_shape = (*inputs.shape, MODEL.d_model)
    saved, loss = {}, torch.tensor(0.0)
    for stage in range(num_stages):
        if stage not in by_stage:
            continue
        if stage == 0:
            x = inputs
        else:
            x = torch.empty(hidden_shape)
            dist.recv(x, src=(stage - 1) % world_size)
            x.requires_grad_()
        out = by_stage[stage](x)
        saved[stage] = (x, out)
        if stage < num_stages - 1:
            dist.send(out.detach().contiguous(), dst=(stage + 1) % world_size)
    for stage in reversed(range(num_stages)):
        if stage not in by_stage:
            continue
        x, out = saved[stage]
        if stage == num_stages - 1:
            loss = cross_entropy_loss(out, targets)
            loss.backward()
        else:
            grad = torch.empty(hidden_shape)
            dist.recv(grad, src=(stage + 1) % world_size)
            out.backward(grad)
        if stage > 0:
            dist.send(x.grad.contiguous(), dst=(stage - 1) % world_size)
    return loss


# -- an independent view of the full state ----------------------------------------------------------


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach().clone()


def _snapshot(parts, optimizers) -> dict[str, torch.Tensor]:
    """Full parameters, AdamW moments and learning rates by FQN, merged over ranks (read straight from the modules
    and ``optimizer.state``, never through the checkpoint code)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    local: dict[str, torch.Tensor] = {}
    names = {}
    for part in parts:
        module = part.module if isinstance(part, nn.parallel.DistributedDataParallel) else part
        for name, param in module.named_parameters():
            names[param] = name
            local[f"param/{name}"] = _full(param)
    for optimizer in optimizers:
        for group in optimizer.param_groups:  # ZeRO's outer groups: its step copies them inward
            for param in group["params"]:
                local[f"lr/{names[param]}"] = torch.tensor(group["lr"])
        inner = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                for key, value in inner.state[param].items():
                    local[f"{key}/{names[param]}"] = _full(value)
    if not dist.is_initialized():
        return local
    gathered: list[dict[str, torch.Tensor]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    merged: dict[str, torch.Tensor] = {}
    for rank_state in gathered:
        for key, value in rank_state.items():
            assert key not in merged or torch.equal(merged[key], value), f"replicas of {key} differ"
            merged[key] = value
    return merged


def _extra(step: int) -> dict:
    return {"step": step, "data": {"epoch": 0, "samples_seen": 4 * step}, "rng": capture_rng_state()}


def _gather_reports(report: ShardReport) -> list[ShardReport]:
    reports: list[ShardReport] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    return reports


# -- rank programs --------------------------------------------------------------------------------


def _save_every_layout(rank: int, world_size: int, root: str) -> dict:
    torch.manual_seed(99)
    out = {}
    for layout in TWO_RANK_LAYOUTS:
        parts, optimizers = _build(layout, seed=0)
        _train(layout, parts, optimizers, TRAIN_STEPS)
        snapshot = _snapshot(parts, optimizers)
        report = save_checkpoint(
            step_dir(os.path.join(root, layout), TRAIN_STEPS), parts, optimizers, _extra(TRAIN_STEPS)
        )
        out[layout] = (snapshot if rank == 0 else None, report)
    return out


def _load_pairs(rank: int, world_size: int, root: str, pairs) -> dict:
    out = {}
    for source, target in pairs:
        parts, optimizers = _build(target, seed=1, lr=LR / 2)
        extra = load_checkpoint(step_dir(os.path.join(root, source), TRAIN_STEPS), parts, optimizers)
        snapshot = _snapshot(parts, optimizers)
        loss = _train(target, parts, optimizers, steps=1, first_step=TRAIN_STEPS)
        out[(source, target)] = (snapshot if rank == 0 else None, extra, loss)
    return out


def _save_2d_then_load_dp4(rank: int, world_size: int, root: str) -> dict:
    """FSDP2 x TP on 4 ranks saves; FSDP2 over all 4 ranks (pure data parallel) restores."""
    directory = step_dir(os.path.join(root, "fsdp_tp"), TRAIN_STEPS)
    parts, optimizers = _build("fsdp_tp", seed=0)
    _train("fsdp_tp", parts, optimizers, TRAIN_STEPS)
    saved = _snapshot(parts, optimizers)
    reports = _gather_reports(save_checkpoint(directory, parts, optimizers, _extra(TRAIN_STEPS)))
    if rank == 0:
        commit(directory, TRAIN_STEPS, "dp2·tp2 zero=3", world_size, reports)
    dist.barrier()
    parts, optimizers = _build("fsdp", seed=1, lr=LR / 2)
    load_checkpoint(directory, parts, optimizers)
    loaded = _snapshot(parts, optimizers)
    loss = _train("fsdp", parts, optimizers, steps=1, first_step=TRAIN_STEPS)
    return {"saved": saved, "loaded": loaded, "loss": loss} if rank == 0 else None


def _async_and_corruption(rank: int, world_size: int, root: str) -> dict:
    directory = step_dir(root, TRAIN_STEPS)
    parts, optimizers = _build("fsdp", seed=0)
    _train("fsdp", parts, optimizers, TRAIN_STEPS)
    saved = _snapshot(parts, optimizers)
    # Hold the background write until the next training step has changed every parameter and
    # moment: what lands on disk must be the state at save() time (staged), not the live tensors.
    gate = threading.Event()
    write_data = checkpoint_io._RecordingWriter.write_data

    def gated_write_data(self, plan, planner):
        assert gate.wait(timeout=60.0), "the test never opened the gate"
        return write_data(self, plan, planner)

    checkpoint_io._RecordingWriter.write_data = gated_write_data
    checkpointer = AsyncCheckpointer()
    pending = checkpointer.save(directory, parts, optimizers, _extra(TRAIN_STEPS))
    _train("fsdp", parts, optimizers, steps=1, first_step=TRAIN_STEPS)
    in_flight = not pending.done()
    gate.set()
    report = pending.wait(timeout_s=60.0)
    checkpointer.close(timeout_s=60.0)
    reports = _gather_reports(report)
    if rank == 0:
        commit(directory, TRAIN_STEPS, "fsdp2", world_size, reports)
    dist.barrier()

    parts, optimizers = _build("ddp", seed=1, lr=LR / 2)
    load_checkpoint(directory, parts, optimizers)
    loaded = _snapshot(parts, optimizers)

    errors = {}
    try:  # a committed step is never overwritten
        save_checkpoint(directory, parts, optimizers, _extra(TRAIN_STEPS))
    except CheckpointError as exc:
        errors["overwrite"] = str(exc)
    if rank == 0:  # flip one byte of rank 1's shard after the commit
        with open(os.path.join(directory, "__1_0.distcp"), "r+b") as stream:
            stream.seek(10)
            byte = stream.read(1)
            stream.seek(10)
            stream.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    try:  # every rank refuses (rank 0 verifies and tells the others), none hangs
        load_checkpoint(directory, parts, optimizers)
    except CheckpointError as exc:
        errors["corrupt"] = str(exc)
    return {
        "saved": saved if rank == 0 else None,
        "loaded": loaded if rank == 0 else None,
        "report": report,
        "errors": errors,
        "in_flight": in_flight,
    }


def _llama_save_and_load(rank: int, world_size: int, root: str) -> tuple[dict, dict] | None:
    """The tied Llama saved under every LLAMA_LAYOUTS layout, then each LLAMA_PAIRS pair restored."""
    torch.manual_seed(99)
    saved = {}
    for layout in LLAMA_LAYOUTS:
        parts, optimizers = _build(layout, seed=0, model_config=LLAMA)
        _train(layout, parts, optimizers, TRAIN_STEPS)
        saved[layout] = _snapshot(parts, optimizers)
        directory = step_dir(os.path.join(root, layout), TRAIN_STEPS)
        reports = _gather_reports(save_checkpoint(directory, parts, optimizers, _extra(TRAIN_STEPS)))
        if rank == 0:
            commit(directory, TRAIN_STEPS, layout, world_size, reports)
        dist.barrier()
    loaded = {}
    for source, target in LLAMA_PAIRS:
        parts, optimizers = _build(target, seed=1, lr=LR / 2, model_config=LLAMA)
        load_checkpoint(step_dir(os.path.join(root, source), TRAIN_STEPS), parts, optimizers)
        snapshot = _snapshot(parts, optimizers)
        loaded[(source, target)] = (snapshot, _train(target, parts, optimizers, steps=1, first_step=TRAIN_STEPS))
    return (saved, loaded) if rank == 0 else None


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, dict[str, dict[str, torch.Tensor]]]:
    """Every layout trained, saved and committed: (root, {layout: full snapshot at save time})."""
    root = str(tmp_path_factory.mktemp("checkpoints"))
    snapshots = {"single": _save_single(root)}
    results = run_distributed(_save_every_layout, 2, root, timeout_s=TIMEOUT_S)
    for layout in TWO_RANK_LAYOUTS:
        reports = [rank_result[layout][1] for rank_result in results]
        commit(step_dir(os.path.join(root, layout), TRAIN_STEPS), TRAIN_STEPS, layout, 2, reports)
        snapshots[layout] = results[0][layout][0]
    return root, snapshots


def _save_single(root: str) -> dict[str, torch.Tensor]:
    parts, optimizers = _build("single", seed=0)
    _train("single", parts, optimizers, TRAIN_STEPS)
    directory = step_dir(os.path.join(root, "single"), TRAIN_STEPS)
    report = save_checkpoint(directory, parts, optimizers, _extra(TRAIN_STEPS))
    commit(directory, TRAIN_STEPS, "single", 1, [report])
    return _snapshot(parts, optimizers)


@pytest.fixture(scope="module")
def loaded_on_two_ranks(saved) -> dict:
    root, _ = saved
    return run_distributed(_load_pairs, 2, root, TWO_RANK_PAIRS, timeout_s=TIMEOUT_S)[0]


def _assert_same_state(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(loaded) == sorted(expected)
    kinds = {key.split("/")[0] for key in expected}
    assert kinds == {"param", "exp_avg", "exp_avg_sq", "step", "lr"}
    for key, value in expected.items():
        torch.testing.assert_close(loaded[key], value, atol=TOL, rtol=0, msg=lambda m, key=key: f"{key}: {m}")


# -- tests ----------------------------------------------------------------------------------------


def test_every_layout_commits_a_verifying_manifest(saved):
    root, snapshots = saved
    for layout in ("single", *TWO_RANK_LAYOUTS):
        manifest = verify(step_dir(os.path.join(root, layout), TRAIN_STEPS))
        names = {entry.path for entry in manifest.files}
        assert {".metadata", "extra.pt", "__0_0.distcp"} <= names
        assert manifest.world_size == (1 if layout == "single" else 2)
    # every layout trained to a real, non-trivial state
    assert float(snapshots["fsdp"]["step/layers.0.attention.wq.weight"]) == TRAIN_STEPS
    assert snapshots["fsdp"]["exp_avg_sq/output.weight"].abs().sum() > 0


@pytest.mark.parametrize(("source", "target"), TWO_RANK_PAIRS, ids=[f"{s}->{t}" for s, t in TWO_RANK_PAIRS])
def test_two_rank_layout_restores_saved_state(saved, loaded_on_two_ranks, source, target):
    _, snapshots = saved
    snapshot, extra, loss_after = loaded_on_two_ranks[(source, target)]
    _assert_same_state(snapshot, snapshots[source])
    assert extra["step"] == TRAIN_STEPS and extra["data"] == {"epoch": 0, "samples_seen": 4 * TRAIN_STEPS}
    assert torch.isfinite(torch.tensor(loss_after))


@pytest.mark.parametrize(("source", "target"), SINGLE_PAIRS, ids=[f"{s}->{t}" for s, t in SINGLE_PAIRS])
def test_single_process_restores_sharded_checkpoint(saved, source, target):
    root, snapshots = saved
    parts, optimizers = _build(target, seed=1, lr=LR / 2)
    assert not torch.equal(parts[0].output.weight, snapshots[source]["param/output.weight"])
    extra = load_checkpoint(step_dir(os.path.join(root, source), TRAIN_STEPS), parts, optimizers)
    _assert_same_state(_snapshot(parts, optimizers), snapshots[source])
    assert extra["step"] == TRAIN_STEPS
    # the restored optimizer keeps stepping from the restored moments
    _train(target, parts, optimizers, steps=1, first_step=TRAIN_STEPS)
    assert float(optimizers[0].state[parts[0].output.weight]["step"]) == TRAIN_STEPS + 1


def test_2d_fsdp_tp_checkpoint_restores_on_four_data_parallel_ranks_and_one_process(tmp_path):
    result = run_distributed(_save_2d_then_load_dp4, 4, str(tmp_path), timeout_s=TIMEOUT_S)[0]
    _assert_same_state(result["loaded"], result["saved"])
    assert torch.isfinite(torch.tensor(result["loss"]))
    parts, optimizers = _build("single", seed=1, lr=LR / 2)
    load_checkpoint(step_dir(os.path.join(str(tmp_path), "fsdp_tp"), TRAIN_STEPS), parts, optimizers)
    _assert_same_state(_snapshot(parts, optimizers), result["saved"])


def test_tied_llama_checkpoint_restores_across_layouts_and_in_one_process(tmp_path):
    saved, loaded = run_distributed(_llama_save_and_load, 2, str(tmp_path), timeout_s=TIMEOUT_S)[0]
    for layout in LLAMA_LAYOUTS:  # trained to a real state; the tied output is not a second parameter
        assert float(saved[layout]["step/layers.0.attention.q_norm.weight"]) == TRAIN_STEPS
        assert saved[layout]["exp_avg_sq/tok_embeddings.weight"].abs().sum() > 0
        assert "param/output.weight" not in saved[layout]
    for (source, target), (snapshot, loss_after) in loaded.items():
        _assert_same_state(snapshot, saved[source])
        assert math.isfinite(loss_after), (source, target)
    for source in LLAMA_LAYOUTS:
        parts, optimizers = _build("single", seed=1, lr=LR / 2, model_config=LLAMA)
        load_checkpoint(step_dir(os.path.join(str(tmp_path), source), TRAIN_STEPS), parts, optimizers)
        _assert_same_state(_snapshot(parts, optimizers), saved[source])
        model = parts[0]
        assert model.output.weight is model.tok_embeddings.weight, f"{source}: restoring untied the embeddings"


def test_extra_state_and_rng_round_trip(tmp_path):
    parts, optimizers = _build("single", seed=0)
    random.seed(5)
    torch.manual_seed(5)
    np.random.seed(5)
    rng = capture_rng_state()
    expected = (random.random(), torch.rand(3), np.random.rand(3))
    directory = step_dir(tmp_path, 7)
    extra = {"step": 7, "data": {"position": 56}, "rng": rng, "note": "plain types survive"}
    report = save_checkpoint(directory, parts, optimizers, extra)
    commit(directory, 7, "single", 1, [report])
    random.seed(0)
    torch.manual_seed(0)
    np.random.seed(0)
    restored = load_checkpoint(directory, *_build("single", seed=1))
    assert restored["step"] == 7 and restored["data"] == {"position": 56} and restored["note"] == extra["note"]
    restore_rng_state(restored["rng"])
    again = (random.random(), torch.rand(3), np.random.rand(3))
    assert again[0] == expected[0] and torch.equal(again[1], expected[1]) and (again[2] == expected[2]).all()


def test_extra_that_would_not_load_back_is_refused_at_save_time(tmp_path):
    parts, optimizers = _build("single", seed=0)
    with pytest.raises(CheckpointError, match="extra state cannot be restored safely"):
        save_checkpoint(step_dir(tmp_path, 1), parts, optimizers, {"config": MODEL})  # a dataclass


def test_uncommitted_or_corrupt_checkpoint_is_refused(tmp_path):
    parts, optimizers = _build("single", seed=0)
    directory = step_dir(tmp_path, 3)
    report = save_checkpoint(directory, parts, optimizers, {"step": 3})
    with pytest.raises(CheckpointError, match="not committed"):
        load_checkpoint(directory, parts, optimizers)
    commit(directory, 3, "single", 1, [report])
    os.truncate(os.path.join(directory, "__0_0.distcp"), 100)
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(directory, parts, optimizers)


def test_partial_directory_is_cleared_before_saving(tmp_path):
    parts, optimizers = _build("single", seed=0)
    directory = step_dir(tmp_path, 4)
    os.makedirs(directory)
    for stale in ("__3_0.distcp", ".metadata"):  # left by a crashed attempt with 4 ranks
        with open(os.path.join(directory, stale), "wb") as stream:
            stream.write(b"stale")
    report = save_checkpoint(directory, parts, optimizers, {"step": 4})
    assert not os.path.exists(os.path.join(directory, "__3_0.distcp"))
    assert [entry.path for entry in report.files] == ["__0_0.distcp", ".metadata", "extra.pt"]
    commit(directory, 4, "single", 1, [report])
    assert load_checkpoint(directory, *_build("single", seed=1))["step"] == 4


def test_a_save_killed_mid_write_is_deleted_by_its_jobs_next_prune_and_no_other_jobs(tmp_path):
    """A save names its job in ``writer.json`` (in the manifest once it commits): a step directory left by
    a kill before the commit is then the job's own, and the prune after its next commit deletes it. The
    same leftover of another job, in a directory this job has been given, stays."""
    key = b"k" * 32
    parts, optimizers = _build("single", seed=0)
    killed = save_checkpoint(step_dir(tmp_path, 4), parts, optimizers, {"step": 4}, owner="job-a")  # never committed
    assert [entry.path for entry in killed.files] == ["__0_0.distcp", ".metadata", "extra.pt", "writer.json"]
    async_killed = AsyncCheckpointer()
    async_killed.save(step_dir(tmp_path, 5), parts, optimizers, {"step": 5}, owner="job-a").wait(timeout_s=60)
    async_killed.close()
    save_checkpoint(step_dir(tmp_path, 6), parts, optimizers, {"step": 6}, owner="job-b")
    report = save_checkpoint(step_dir(tmp_path, 8), parts, optimizers, {"step": 8}, owner="job-a")
    manifest = commit(step_dir(tmp_path, 8), 8, "single", 1, [report], key=key, job_id="job-a")
    assert "writer.json" in {entry.path for entry in manifest.files}

    deleted = prune(tmp_path, keep_last=3, key=key, owner="job-a")

    assert deleted == [step_dir(tmp_path, 4), step_dir(tmp_path, 5)]
    assert [step for step, _ in list_steps(tmp_path)] == [6, 8]
    assert load_checkpoint(step_dir(tmp_path, 8), *_build("single", seed=1))["step"] == 8


def test_async_save_snapshot_survives_training_and_corruption_is_refused_on_every_rank(tmp_path):
    results = run_distributed(_async_and_corruption, 2, str(tmp_path), timeout_s=TIMEOUT_S)
    assert all(r["in_flight"] for r in results)  # save() returned before the files were written
    _assert_same_state(results[0]["loaded"], results[0]["saved"])
    assert [r["report"].rank for r in results] == [0, 1]
    for rank_result in results:
        assert "refusing to overwrite" in rank_result["errors"]["overwrite"]
        assert "__1_0.distcp sha256 mismatch" in rank_result["errors"]["corrupt"]


def test_resaving_over_a_corrupted_commit_quarantines_it(tmp_path):
    """After a fallback restore, the re-run of a corrupted step saves again; the bad copy is kept aside."""
    import torch
    from torch import nn

    from etrain.workers.checkpoints.checkpoint import save_checkpoint
    from etrain.workers.checkpoints.checkpoint_commit import commit, list_steps, step_dir, verify

    model = nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    directory = step_dir(tmp_path, 8)
    report = save_checkpoint(directory, [model], [optimizer], {"step": 8})
    commit(directory, step=8, layout="pp1·dp1·tp1 zero=0", world_size=1, reports=[report])
    shard = next(p for p in __import__("pathlib").Path(directory).iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    report = save_checkpoint(directory, [model], [optimizer], {"step": 8})
    commit(directory, step=8, layout="pp1·dp1·tp1 zero=0", world_size=1, reports=[report])
    assert verify(directory).step == 8
    quarantined = [p.name for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert len(quarantined) == 1 and quarantined[0].startswith("step_00000008.corrupt-")
    assert [step for step, _ in list_steps(tmp_path)] == [8]  # the quarantined copy is not a step


def _save_twice_with_the_cached_plan_then_load(rank: int, world_size: int, root: str) -> dict:
    """FSDP2 (ranks hold different shards) trains, saves, trains, saves again: the second save runs on
    DCP's cached plan. A fresh model loads the second one."""
    from torch.distributed.checkpoint.planner import SavePlanner

    cache = checkpoint_io.new_plan_cache()  # each rank its own: a key only has to be fresh on every rank
    parts, optimizers = _build("fsdp", seed=0)
    _train("fsdp", parts, optimizers, TRAIN_STEPS)
    uncached = cache not in SavePlanner._cached_save_plan
    first = _gather_reports(save_checkpoint(step_dir(root, 2), parts, optimizers, _extra(2), plan_cache=cache))
    cached_after_first = cache in SavePlanner._cached_save_plan
    _train("fsdp", parts, optimizers, TRAIN_STEPS, first_step=TRAIN_STEPS)
    second = _gather_reports(save_checkpoint(step_dir(root, 4), parts, optimizers, _extra(4), plan_cache=cache))
    if rank == 0:
        commit(step_dir(root, 2), 2, "cached", world_size, first)
        commit(step_dir(root, 4), 4, "cached", world_size, second)
    dist.barrier()
    expected = _snapshot(parts, optimizers)
    fresh_parts, fresh_optimizers = _build("fsdp", seed=1, lr=LR / 2)
    load_checkpoint(step_dir(root, 4), fresh_parts, fresh_optimizers)
    return {
        "uncached": uncached,
        "cached_after_first": cached_after_first,
        "expected": expected,
        "loaded": _snapshot(fresh_parts, fresh_optimizers),
    }


def test_a_save_on_dcps_cached_plan_restores_exactly(tmp_path):
    """A plan_cache turns DCP's plan cache on (a rank whose plan did not change sends an empty one): the
    second save of a sharded state, planned from the cache, still restores bit for bit."""
    results = run_distributed(_save_twice_with_the_cached_plan_then_load, 2, str(tmp_path), timeout_s=TIMEOUT_S)
    assert all(r["uncached"] and r["cached_after_first"] for r in results), "the first save filled the plan cache"
    for r in results:
        assert sorted(r["loaded"]) == sorted(r["expected"])
        for name, value in r["expected"].items():
            assert torch.equal(r["loaded"][name], value), name

"""Context parallelism (``parallelism.cp``) on real gloo ranks: equal to one process, and checkpoints that
restore across cp.

The tiny Llama of the equivalence tests (grouped-query attention: 4 query heads on 2 kv heads, q/k norms,
q/k/v bias), 16-token context, trained as one process is the reference. Each cp rank holds two 4-token
chunks of every sequence (chunks i and 3 − i of 4), attention runs as a ring over the cp ranks.

On two ranks (one spawn, several Trainers on the same process group):

* ring attention (grouped-query) at each rank's chunks against causal SDPA over the whole sequence: the
  output and dQ/dK/dV within 1e-5, its blocks in the CPU flash kernel and on the math path, and the FLOPs
  it multiplies (its own block whole, every other block half: the rows that see each other) exact;
* cp=2 with DDP over the cp ranks (zero 0, saving at step 2), with ZeRO-1 sharding AdamW over them, and
  with FSDP2 over them (zero 3), train the
  reference's losses, gradient norms and final parameters (the FSDP2 run under full activation
  checkpointing, whose backward replays the ring; and DDP under selective checkpointing, which keeps the
  ring op's outputs) within the equivalence tolerances (1e-5 relative on losses);
* what each checkpointed block keeps on a cp=2 rank equals the planner's count, and the ring's forward
  runs once per step under selective checkpointing, twice under full;
* cp=2 restored from the reference's step-2 checkpoint trains on to its losses (cp=1 -> cp=2), and one
  process restored from the cp=2 run's step-2 checkpoint trains on to the same losses (cp=2 -> cp=1);
* compiled blocks, the ring op inside each block's graph (``fullgraph``), train the reference's numbers under
  none, selective and full checkpointing without recompiling, running the ring as often as eagerly, and
  what a compiled block keeps equals the planner's compiled count at cp=2.

On four ranks: the ring alone over all four (cp=4) against whole-sequence SDPA, forward and backward; and
cp=2 × dp=2 (two dp replicas reading different samples, each split over a cp pair, the
gradients averaged over all four) equals one process too, and its groups are Megatron's order with cp
between dp and tp; cp=2 × tp=2 (each tp rank's ring over its own heads) under FSDP2 with sequence
parallelism, compiled and with selective checkpointing, cp=2 × pp=2 (1F1B), and HSDP (2 replicas of dp_shard·cp = 2 ranks), equal it too. A
mixture of experts (Qwen3-MoE, whose load-balancing loss is a product of means over every token of the
batch: the cp ranks' routing statistics are summed first) trains one process's losses at cp=2 (DDP),
cp=2 × dp=2 (FSDP2) and cp=2 × dp=2 with its experts split over ep=2 (each ep pair one cp index), whose
checkpoint restores into one process. The refusals are checked before any process group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools

import pytest
import torch

from etrain.workers.families import MODEL_PRESETS
from etrain.workers.protocol.errors import ConfigError
from etrain.workers.protocol.run_config import ModelConfig, ParallelConfig
from tests.dist_utils import run_distributed
from tests.equivalence_utils import (
    LOSS_RTOL,
    TINY_GPT,
    TINY_LLAMA,
    RunResult,
    assert_equivalent,
    run_reference,
    save_and_commit,
    small_config,
)
from tests.state_utils import full_state_dict

STEPS, SAVE_AT = 4, 2
BASE = small_config(steps=STEPS, model=TINY_LLAMA)
GPT_BASE = small_config(steps=STEPS, model=TINY_GPT)  # learned positions: embedded at each token's true one
#: OLMo 2: Llama's attention with q/k norms over the whole width, norms after attention and MLP
OLMO_BASE = small_config(
    steps=STEPS, model=dataclasses.replace(ModelConfig(**MODEL_PRESETS["olmo2-tiny"]), n_layers=2, seq_len=16)
)
#: Qwen3-MoE (8 experts, top-2, q/k norms): its load-balancing loss is over every token of the batch, so the
#: cp ranks' routing statistics are summed before it; a weight large enough that the term moves the losses.
MOE_BASE = small_config(
    steps=STEPS,
    model=dataclasses.replace(ModelConfig(**MODEL_PRESETS["qwen3-moe-tiny"]), seq_len=16, router_aux_loss_coef=0.05),
)
#: Blocks measured on a cp=2 rank against the planner's count: grouped-query, and multi-head with Qwen3's
#: q/k norms (q and k then reach the ring in fp32 under autocast).
_BLOCK = dict(arch="llama", n_layers=1, d_model=64, n_heads=4, vocab_size=256, seq_len=64)
MEASURED_BLOCKS = {
    "gqa": ModelConfig(**_BLOCK, n_kv_heads=2),
    "mha_qk_norm": ModelConfig(**_BLOCK, n_kv_heads=4, qk_norm=True, head_dim_override=16),
    "gpt": ModelConfig(**{**_BLOCK, "arch": "gpt"}),
    "olmo2": ModelConfig(**{**_BLOCK, "arch": "olmo2"}, n_kv_heads=2),
}
#: A whole model measured on a cp=2 rank against the planner's activations (its memory plan for cp=2).
MEASURED_MODEL = ModelConfig(**{**_BLOCK, "n_layers": 2, "d_ff": 128, "vocab_size": 512, "seq_len": 128}, n_kv_heads=2)


def _config(parallel: ParallelConfig):
    return dataclasses.replace(BASE, parallel=parallel)


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
    return RunResult(
        rank=trainer.rank,
        losses=[m.loss for m in history],
        grad_norms=[m.grad_norm for m in history],
        params=full_state_dict(trainer),
    )


def _ring_against_whole_sequence(rank: int, world_size: int) -> dict[str, tuple[dict[str, float], int]]:
    """Ring attention at this rank's chunks against causal SDPA over the whole sequence (grouped-query,
    4 query heads on 2 kv heads, 24 tokens), its blocks in the CPU flash kernel and, forced, on the math path
    (which CUDA runs in fp32): per path, the outputs' and the gradients of q, k and v's largest |Δ| each, and
    the FLOPs of the ring's forward and backward on this rank (torch's ``FlopCounterMode``)."""
    from etrain.workers.families import ring_attention

    paths = {"kernel": _ring_check(rank, world_size)}
    chosen = ring_attention.block_kernel
    ring_attention.block_kernel = lambda *_: "math"
    try:
        paths["math"] = _ring_check(rank, world_size)
    finally:
        ring_attention.block_kernel = chosen
    return paths


def _ring_check(rank: int, world_size: int) -> tuple[dict[str, float], int]:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

    from etrain.workers.families import ring_attention as ring_attention_module
    from etrain.workers.families.ring_attention import ring_attention, shard_sequence

    generator = torch.Generator().manual_seed(5)
    q, k, v, grad = (torch.randn(2, heads, 24, 8, generator=generator) for heads in (4, 2, 2, 4))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(
        whole[0], whole[1].repeat_interleave(2, 1), whole[2].repeat_interleave(2, 1), is_causal=True
    )
    want.backward(grad)
    local = [shard_sequence(t, world_size, rank, dim=2).requires_grad_() for t in (q, k, v)]
    # torch counts its CUDA attention kernels (two matmuls forward, five backward, causal or not); the CPU
    # flash kernel the ring runs here is the same computation
    aten = torch.ops.aten
    cpu_kernels = {
        aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *_, **__: sdpa_flop_count(q, k, v),
        aten._scaled_dot_product_flash_attention_for_cpu_backward: lambda grad, q, k, v, *_, **__: (
            sdpa_backward_flop_count(grad, q, k, v)
        ),
    }
    local_grad = shard_sequence(grad, world_size, rank, dim=2)
    got = ring_attention(*local, group=dist.group.WORLD, seq_len=24)
    got.backward(local_grad)
    # the ring is one op to a dispatch mode: count what its forward and backward run inside, called directly
    inputs = [t.detach() for t in local]
    with FlopCounterMode(display=False, custom_mapping=cpu_kernels) as counter:
        out, lse = ring_attention_module._ring_forward(*inputs, dist.group.WORLD, 24)
        ring_attention_module._ring_backward(local_grad, *inputs, out, lse, dist.group.WORLD)
    diffs = {"out": (got - shard_sequence(want, world_size, rank, dim=2)).abs().max().item()}
    for name, mine, full in zip("qkv", local, whole):
        diffs[f"d{name}"] = (mine.grad - shard_sequence(full.grad, world_size, rank, dim=2)).abs().max().item()
    return diffs, counter.get_total_flops()


def _ring_flops(cp: int, *, batch: int = 2, heads: int = 4, seq_len: int = 24, head_dim: int = 8) -> int:
    """What a ring rank multiplies (:func:`_ring_against_whole_sequence`'s shapes): per K/V block two matmuls
    forward (q·kᵀ, P·v) and five backward (q·kᵀ again, Pᵀ·dO, dO·vᵀ, dS·k, dSᵀ·q), each ``2·rows·keys·head_dim``
    per head; its own block all ``c × c`` rows and keys (``c = S/cp``), every other block half of them, the
    rows that see each other."""
    c = seq_len // cp
    pairs = c * c + (cp - 1) * c * c // 2
    return 7 * 2 * batch * heads * head_dim * pairs


def _block_classes() -> dict:
    from etrain.workers.families.gpt_model import TransformerBlock
    from etrain.workers.families.llama_model import LlamaBlock
    from etrain.workers.families.olmo2_model import Olmo2Block

    return {"gpt": TransformerBlock, "llama": LlamaBlock, "olmo2": Olmo2Block}


def _saved_bytes(module, run, *, autocast: bool = False) -> int:
    """Distinct storages autograd saves for ``run()``'s backward, less the parameters and the RoPE tables
    each attention caches (module state, the planner's ``rope_tables``)."""
    skip = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = run()
        out.float().sum().backward()
    for attention in (m for m in module.modules() if hasattr(m, "_rope_cache")):
        skip |= {t.untyped_storage().data_ptr() for pair in attention._rope_cache.values() for t in pair}
    return sum(nbytes for ptr, nbytes in saved.items() if ptr not in skip)


def _measured_activations(rank: int, world_size: int) -> dict:
    """What autograd saves on one cp=2 rank: each Llama block variant in each compute regime, and a whole
    two-layer model's forward and loss (fp32), for the planner's counts (test below)."""
    import torch.distributed as dist

    from etrain.workers.families import ring_attention
    from etrain.workers.families.llama_model import Llama
    from etrain.workers.families.ring_attention import shard_sequence

    torch.manual_seed(0)
    blocks = {}
    for name, model in MEASURED_BLOCKS.items():
        for regime in ("fp32", "autocast", "bf16_params"):
            dtype = torch.bfloat16 if regime == "bf16_params" else torch.float32
            block = _block_classes()[model.arch](model).to(dtype)
            x = torch.randn(3, model.seq_len // world_size, model.d_model, dtype=dtype, requires_grad=True)
            run = lambda b=block, x=x: b(x)  # noqa: E731
            plain = _saved_bytes(block, run, autocast=regime == "autocast")  # the fused kernel, S/cp tokens
            block.attention.cp_group = dist.group.WORLD
            blocks[name, regime] = (_saved_bytes(block, run, autocast=regime == "autocast"), plain)
            if regime == "fp32":  # and on the math path, as CUDA runs an fp32 ring (a GPU's count, on CPU)
                chosen, ring_attention.block_kernel = ring_attention.block_kernel, lambda *_: "math"
                try:
                    blocks[name, "fp32_math"] = (_saved_bytes(block, run), plain)
                finally:
                    ring_attention.block_kernel = chosen
    model = Llama(MEASURED_MODEL)
    for layer in model.layers.values():
        layer.attention.cp_group = dist.group.WORLD
    tokens = torch.randint(0, MEASURED_MODEL.vocab_size, (2, MEASURED_MODEL.seq_len + 1))
    inputs, targets = (shard_sequence(t, world_size, rank) for t in (tokens[:, :-1], tokens[:, 1:]))
    whole = _saved_bytes(model, lambda: model(inputs, targets=targets))
    return {"blocks": blocks, "model": whole}


@contextlib.contextmanager
def _counting_ring_runs():
    """A list that grows by one each time the ring's forward runs (the op's implementation looks
    ``_ring_forward`` up at each call)."""
    from etrain.workers.families import ring_attention

    runs: list[int] = []
    ring_forward = ring_attention._ring_forward

    def counted(*args, **kwargs):
        runs.append(1)
        return ring_forward(*args, **kwargs)

    ring_attention._ring_forward = counted
    try:
        yield runs
    finally:
        ring_attention._ring_forward = ring_forward


def _measured_checkpointing(rank: int, world_size: int) -> dict:
    """Each measured block on a cp=2 rank under selective and full checkpointing, in each compute regime:
    ``{(block, regime, mode): (bytes kept for the backward, times the ring's forward ran)}``. Under selective
    checkpointing what is kept is what autograd saves plus the outputs the policy's cache holds (the ops it
    saves: the matmuls and the ring op)."""
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils import _pytree
    from torch.utils.checkpoint import _RECOMPUTE

    from etrain.workers.engine.parallelize import _selective_contexts

    found = {}
    with _counting_ring_runs() as ring_runs:
        for (name, model), regime, mode in itertools.product(
            MEASURED_BLOCKS.items(), ("fp32", "autocast", "bf16_params"), ("selective", "full")
        ):
            torch.manual_seed(0)
            dtype = torch.bfloat16 if regime == "bf16_params" else torch.float32
            block = _block_classes()[model.arch](model).to(dtype)
            block.attention.cp_group = dist.group.WORLD
            weights = {p.untyped_storage().data_ptr() for p in block.parameters()}
            caches: list = []

            def contexts(caches=caches):
                forward, recompute = _selective_contexts()
                caches.append(forward.storage)
                return forward, recompute

            run = checkpoint_wrapper(
                block, preserve_rng_state=False, **({"context_fn": contexts} if mode == "selective" else {})
            )
            saved: dict[int, int] = {}

            def pack(tensor, saved=saved, weights=weights):
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in weights:
                    saved[storage.data_ptr()] = storage.nbytes()
                return tensor

            x = torch.randn(3, model.seq_len // world_size, model.d_model, dtype=dtype, requires_grad=True) * 1
            ring_runs.clear()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=regime == "autocast"):
                    out = run(x)
                for cache in caches:
                    for outputs in (o for per_op in cache.values() for o in per_op.values() if o is not _RECOMPUTE):
                        for leaf in _pytree.tree_leaves(outputs):
                            pack(getattr(leaf, "val", leaf))
                out.float().sum().backward()
            found[name, regime, mode] = (sum(saved.values()), len(ring_runs))
    return found


def _two_ranks(rank: int, world_size: int, root: str) -> dict:
    return {
        "saved": _measured_activations(rank, world_size),
        "checkpointing": _measured_checkpointing(rank, world_size),
        "ring": _ring_against_whole_sequence(rank, world_size),
        "ddp": _train(_config(ParallelConfig(cp=2)), rank, world_size, save_root=f"{root}/cp2"),
        # full checkpointing replays each block's forward, its ring included, inside the backward
        "fsdp": _train(_config(ParallelConfig(cp=2, zero=3)), rank, world_size, activation_checkpointing="full"),
        # selective keeps the ring op's output and log-sum-exp: its recompute runs no ring
        "selective": _train(_config(ParallelConfig(cp=2)), rank, world_size, activation_checkpointing="selective"),
        "restored": _train(_config(ParallelConfig(cp=2)), rank, world_size, restore=f"{root}/one"),
        "zero1": _train(_config(ParallelConfig(cp=2, zero=1)), rank, world_size),  # AdamW state over dp·cp
        # and the loss in chunks of a cp rank's tokens (16 per micro-batch, chunks of 8)
        "gpt": _train(
            dataclasses.replace(GPT_BASE, parallel=ParallelConfig(cp=2)), rank, world_size, loss_chunk_tokens=8
        ),
        "olmo2": _train(dataclasses.replace(OLMO_BASE, parallel=ParallelConfig(cp=2)), rank, world_size),
        "moe": _train(dataclasses.replace(MOE_BASE, parallel=ParallelConfig(cp=2)), rank, world_size),
    }


def _four_ranks(rank: int, world_size: int, root: str) -> tuple[dict, dict]:
    import torch.distributed as dist

    from etrain.workers.engine.mesh import build_device_mesh
    from etrain.workers.protocol.topology import Topology

    mesh = build_device_mesh(Topology(pp=1, dp=2, cp=2, tp=1), "cpu")
    groups = {axis: tuple(dist.get_process_group_ranks(mesh.get_group(axis))) for axis in ("dp", "cp", "dp_cp")}
    groups["ring"] = _ring_against_whole_sequence(rank, world_size)  # a ring of 4: three hops each way
    results = {
        "dp2": _train(_config(ParallelConfig(dp=2, cp=2)), rank, world_size),
        # each tp rank runs the ring over its own heads (GQA: one kv head each), the norms on a tp slice of a
        # cp rank's tokens; FSDP2 over dp_cp with TP's DTensors (the DDP-style replicate path is the same ring
        # and was checked by hand: tp2 with DTensors over 4 ranks costs ~15 s here); compiled blocks (the
        # ring op inside each graph, beside TP's collectives) under selective checkpointing
        "tp2_sp_fsdp": _train(
            _config(ParallelConfig(cp=2, tp=2, zero=3, sequence_parallel=True)),
            rank,
            world_size,
            compile=True,
            activation_checkpointing="selective",
        ),
        # HSDP: two replicas, each FSDP2-sharding over its dp_shard·cp = 2 ranks
        "hsdp": _train(_config(ParallelConfig(dp=2, cp=2, zero=3, dp_replicate=2)), rank, world_size),
        # the stages pass a cp rank's chunks on (4 micro-batches through 2 stages of 2 layers)
        "pp2": _train(_config(ParallelConfig(cp=2, pp=2)), rank, world_size),
        # a mixture of experts over two dp replicas of a cp pair, FSDP2 over all four
        "moe_dp2_zero3": _train(
            dataclasses.replace(MOE_BASE, parallel=ParallelConfig(dp=2, cp=2, zero=3)), rank, world_size
        ),
        # and its experts split over the two dp replicas (ep=2: each ep pair is one cp index), saved at step 2
        "moe_ep2": _train(
            dataclasses.replace(MOE_BASE, parallel=ParallelConfig(dp=2, cp=2, ep=2)),
            rank,
            world_size,
            save_root=f"{root}/ep2cp2",
        ),
    }
    return results, groups


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[RunResult, str]:
    """One process (no process group), saving at step 2: the reference, and the cp=1 checkpoint."""
    root = str(tmp_path_factory.mktemp("cp"))
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


@pytest.fixture(scope="module")
def two_ranks(reference) -> list[dict]:
    """One spawn of two ranks for the ring, the layouts, the checkpoints and the measured activations."""
    _, root = reference
    return run_distributed(_two_ranks, 2, root, timeout_s=240)


def test_cp2_trains_like_one_process_and_restores_across_cp(reference, two_ranks):
    one, root = reference
    ranks = two_ranks
    for r in ranks:  # the ring itself: forward and the reverse ring's dK/dV against the whole sequence
        for path, (diffs, flops) in r["ring"].items():
            assert max(diffs.values()) < 1e-5, (path, diffs)
            assert flops == _ring_flops(2), (path, flops, _ring_flops(2))  # 3/4 of every block computed whole
    print(f"llama cp2: losses {ranks[0]['ddp'].losses} vs one process {one.losses}")
    assert_equivalent(one, [r["ddp"] for r in ranks], layout="llama cp2 zero=0")
    assert_equivalent(one, [r["fsdp"] for r in ranks], layout="llama cp2 zero=3 full checkpointing")
    assert_equivalent(one, [r["selective"] for r in ranks], layout="llama cp2 zero=0 selective checkpointing")
    assert_equivalent(one, [r["zero1"] for r in ranks], layout="llama cp2 zero=1")
    assert_equivalent(run_reference(GPT_BASE), [r["gpt"] for r in ranks], layout="gpt cp2 zero=0 chunked loss")
    # OLMo 2 at cp2: a few embedding elements of tokens seen twice sit in AdamW's eps regime (measured over data
    # seeds 3-6, in the sampler's old order and its new one: the largest |Δ| 1.1e-5 to 2.4e-4, in 2-4 of 16,384
    # elements; the losses within LOSS_RTOL every time)
    assert_equivalent(
        run_reference(OLMO_BASE), [r["olmo2"] for r in ranks], layout="olmo2 cp2 zero=0", eps_regime_elements=8
    )
    # a mixture of experts: the load-balancing loss over both ranks' tokens, as one process computes it
    assert_equivalent(run_reference(MOE_BASE), [r["moe"] for r in ranks], layout="qwen3-moe cp2 zero=0")
    # cp=1 (one process) -> cp=2: the steps after the restore are the uninterrupted run's
    for r in ranks:
        _assert_losses(one, r["restored"].losses, first=SAVE_AT, layout="cp1 -> cp2")
    # cp=2 -> cp=1: one process restores the cp=2 checkpoint and trains on to the same losses
    restored = _train(BASE, 0, 1, restore=f"{root}/cp2")
    _assert_losses(one, restored.losses, first=SAVE_AT, layout="cp2 -> cp1")
    assert len(restored.losses) == STEPS - SAVE_AT


def test_cp2_dp2_trains_like_one_process(reference, monkeypatch):
    monkeypatch.setenv("ETRAIN_COMPILE_BACKEND", "aot_eager")  # the tp2 row's compiled blocks; the ranks inherit it
    one, root = reference
    ranks = run_distributed(_four_ranks, 4, root, timeout_s=240)
    for _, groups in ranks:  # the ring over 4 ranks against the whole sequence
        for path, (diffs, flops) in groups.pop("ring").items():
            assert max(diffs.values()) < 1e-5, (path, diffs)
            assert flops == _ring_flops(4), (path, flops, _ring_flops(4))  # 5/8 of every block computed whole
    # rank = (dp_index * cp + cp_index) * tp + tp_index: a cp pair is adjacent, dp replicas are cp apart
    assert [groups for _, groups in ranks] == [
        {"dp": (0, 2), "cp": (0, 1), "dp_cp": (0, 1, 2, 3)},
        {"dp": (1, 3), "cp": (0, 1), "dp_cp": (0, 1, 2, 3)},
        {"dp": (0, 2), "cp": (2, 3), "dp_cp": (0, 1, 2, 3)},
        {"dp": (1, 3), "cp": (2, 3), "dp_cp": (0, 1, 2, 3)},
    ]
    results = [result for result, _ in ranks]
    print(f"llama dp2 cp2: losses {results[0]['dp2'].losses} vs one process {one.losses}")
    assert_equivalent(one, [r["dp2"] for r in results], layout="llama dp2 cp2 zero=0")
    assert_equivalent(one, [r["tp2_sp_fsdp"] for r in results], layout="llama cp2 tp2 sp zero=3 compiled selective")
    assert_equivalent(one, [r["pp2"] for r in results], layout="llama cp2 pp2 1f1b")
    assert_equivalent(one, [r["hsdp"] for r in results], layout="llama dp2 cp2 zero=3 hsdp=2")
    moe_one = run_reference(MOE_BASE)
    assert_equivalent(moe_one, [r["moe_dp2_zero3"] for r in results], layout="qwen3-moe dp2 cp2 zero=3")
    assert_equivalent(moe_one, [r["moe_ep2"] for r in results], layout="qwen3-moe dp2 cp2 ep2")
    # the ep2 x cp2 checkpoint (experts sharded over ep, replicated over cp) restores into one process
    restored = _train(MOE_BASE, 0, 1, restore=f"{root}/ep2cp2")
    _assert_losses(moe_one, restored.losses, first=SAVE_AT, layout="qwen3-moe ep2 cp2 -> one process")
    assert len(restored.losses) == STEPS - SAVE_AT


@pytest.mark.parametrize(
    "parallel, model, field, words",
    [
        (ParallelConfig(cp=3), TINY_LLAMA, "parallelism.cp", "divisible by 2·cp = 6"),
    ],
    ids=["seq_len"],
)
def test_bad_context_layouts_are_refused_before_any_group(parallel, model, field, words):
    from etrain.workers.engine.train import Trainer

    config = dataclasses.replace(BASE, model=model, parallel=parallel)
    with pytest.raises(ConfigError) as caught:
        Trainer(config, rank=0, world_size=parallel.world_size, device=torch.device("cpu"))
    assert caught.value.field == field and words in str(caught.value), str(caught.value)
    assert caught.value.fix


def test_checkpointed_blocks_keep_what_the_planner_counts_and_selective_runs_the_ring_once(two_ranks):
    """On a cp=2 rank, each measured block (grouped-query Llama, Qwen3-style q/k norms, the GPT, OLMo 2) in each
    compute regime: what selective and full checkpointing keep equals the planner's per-block count byte for
    byte, and the ring's forward runs once per step under selective (its recompute takes the op's kept
    outputs: no exchange again) and twice under full (the backward replays the block)."""
    from etrain.service.planning.plan_activations import layer_activation_bytes

    for (name, regime, mode), (kept, ring_runs) in two_ranks[0]["checkpointing"].items():
        precision = "fp32" if regime == "fp32" else "bf16"
        model = MEASURED_BLOCKS[name]
        count = layer_activation_bytes(
            model, micro_batch=3, precision=precision, regime=regime, cp=2, checkpointing=mode, device="cpu"
        )
        assert kept == count, (name, regime, mode, kept, count)
        assert ring_runs == (1 if mode == "selective" else 2), (name, regime, mode, ring_runs)


def _opchecks(rank: int, world_size: int) -> dict[str, dict[str, str]]:
    """torch's ``opcheck`` of the ring's two ops on one rank (no exchange: its own block), with contiguous and
    with strided (token-major) q/k/v: the schema, the autograd registration, the fakes against the real
    outputs (shapes, dtypes and strides) and tracing forward and backward through AOT dispatch."""
    import torch.distributed as dist

    from etrain.workers.families import ring_attention  # noqa: F401 - registers the ops

    generator = torch.Generator().manual_seed(0)
    group, found = dist.group.WORLD.group_name, {}
    for layout in ("contiguous", "strided"):
        q, k, v = (torch.randn(2, 16, heads, 8, generator=generator) for heads in (4, 2, 2))
        q, k, v = (t.transpose(1, 2) if layout == "strided" else t.transpose(1, 2).contiguous() for t in (q, k, v))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        forward = torch.library.opcheck(torch.ops.etrain.ring_attention.default, (q, k, v, group, 16))
        out, lse = torch.ops.etrain.ring_attention(q, k, v, group, 16)
        grad = torch.randn(out.shape, generator=generator)
        inputs = (grad, *(t.detach() for t in (q, k, v, out, lse)), group)
        backward = torch.library.opcheck(torch.ops.etrain.ring_attention_backward.default, inputs)
        for name, results in (("forward", forward), ("backward", backward)):
            found[f"{layout} {name}"] = {test: str(result) for test, result in results.items()}
    return found


def test_the_ring_ops_pass_torchs_opcheck():
    (found,) = run_distributed(_opchecks, 1, timeout_s=120)
    failed = {case: tests for case, tests in found.items() if set(tests.values()) != {"SUCCESS"}}
    assert len(found) == 4 and not failed, failed


#: Blocks whose compiled count is measured on a cp=2 rank: the Llama variants (RoPE at the rank's positions;
#: q and k fp32 after the q/k norms under autocast) and the GPT (its positions embedded before the blocks).
COMPILED_BLOCKS = ("gqa", "mha_qk_norm", "gpt")
REGIMES = ("fp32", "autocast", "bf16_params")


def _compiled_kept(rank: int, world_size: int) -> dict:
    """What each compiled block keeps for its backward on a cp=2 rank (``{(block, regime, mode): bytes}``), under
    inductor's partitioner (``aot_eager_decomp_partition``: the same saved tensors as inductor, in seconds
    instead of a C++ build), less autocast's bf16 weight casts where autograd keeps them (the planner counts
    those apart). The block input is not a leaf, as in a model."""
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from etrain.workers.engine.parallelize import _selective_contexts
    from tests.autograd_utils import saved_bytes

    found = {}
    for name, regime, mode in itertools.product(COMPILED_BLOCKS, REGIMES, ("none", "selective")):
        if name == "gpt" and regime != "autocast":
            continue  # no ring term of its own: one regime shows its compiled count holds at cp=2
        model = MEASURED_BLOCKS[name]
        torch.manual_seed(0)
        dtype = torch.bfloat16 if regime == "bf16_params" else torch.float32
        block = _block_classes()[model.arch](model).to(dtype)
        block.attention.cp_group = dist.group.WORLD
        run = (
            block
            if mode == "none"
            else checkpoint_wrapper(block, preserve_rng_state=False, context_fn=_selective_contexts)
        )
        torch._dynamo.reset()  # a case per block, regime and mode: more than dynamo's recompile limit
        compiled = torch.compile(run, backend="aot_eager_decomp_partition", fullgraph=True)

        class NotALeaf(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = compiled

            def forward(self, h):
                return self.inner(h * 1)

        x = torch.randn(3, model.seq_len // world_size, model.d_model, requires_grad=True, dtype=dtype)
        autocast = regime == "autocast"
        saved_bytes(NotALeaf(), x, autocast=autocast)  # compiles
        kept = saved_bytes(NotALeaf(), x, autocast=autocast)
        if autocast and mode == "none":
            weights = [p for n, p in block.named_parameters() if "norm" not in n and n.endswith("weight")]
            kept -= 2 * sum(p.numel() for p in weights)
        found[name, regime, mode] = kept
    return found


def _compiled_cp2(rank: int, world_size: int) -> dict:
    """The compiled counts, then cp=2 trained with compiled blocks under each checkpointing mode: its numbers,
    the frames compiled after the first step and at the end, and the ring's forward runs in the last step."""
    from etrain.workers.engine.compile import compiled_frames
    from etrain.workers.engine.train import Trainer

    found = {"kept": _compiled_kept(rank, world_size)}
    with _counting_ring_runs() as ring_runs:
        for mode in ("none", "selective", "full"):
            torch._dynamo.reset()
            config = _config(ParallelConfig(cp=2))
            training = dataclasses.replace(config.training, compile=True, activation_checkpointing=mode)
            torch.manual_seed(0)
            trainer = Trainer(
                dataclasses.replace(config, training=training),
                rank=rank,
                world_size=world_size,
                device=torch.device("cpu"),
            )
            before = compiled_frames()
            history = trainer.run(0, STEPS - 1)
            frames = compiled_frames()
            ring_runs.clear()
            history += trainer.run(STEPS - 1, STEPS)
            found[mode] = {
                "result": RunResult(
                    rank=trainer.rank,
                    losses=[m.loss for m in history],
                    grad_norms=[m.grad_norm for m in history],
                    params=full_state_dict(trainer),
                ),
                "frames": (before, frames, compiled_frames()),
                "ring_runs": len(ring_runs),
            }
    return found


def test_cp2_compiles_whole_blocks_that_train_like_one_process_and_keep_what_the_planner_counts(reference, monkeypatch):
    """Compiled blocks (``aot_eager``) with the ring op inside each block's graph (``fullgraph``: a graph break
    would fail the compile): one process's numbers under none, selective and full checkpointing, nothing
    recompiled after the first step, and the ring's forward run once per block and micro-batch (twice under
    full checkpointing, whose backward replays the block), as eagerly. What a compiled block keeps on a cp=2
    rank under inductor's partitioner equals the planner's compiled count at cp=2 for the Llama variants and
    the GPT in every regime (plus RoPE's inverse frequencies, a constant the graph holds, and at most a
    scalar)."""
    from etrain.service.planning.plan_activations import layer_activation_bytes

    monkeypatch.setenv("ETRAIN_COMPILE_BACKEND", "aot_eager")  # the ranks inherit it
    one, _ = reference
    ranks = run_distributed(_compiled_cp2, 2, timeout_s=300)
    per_step = BASE.model.n_layers * BASE.training.global_batch // BASE.training.micro_batch  # dp = 1
    for mode in ("none", "selective", "full"):
        assert_equivalent(one, [r[mode]["result"] for r in ranks], layout=f"cp2 compiled, {mode} checkpointing")
        for r in ranks:
            before, after_first, at_end = r[mode]["frames"]
            assert after_first > before and at_end == after_first, (mode, r[mode]["frames"])
            assert r[mode]["ring_runs"] == per_step * (2 if mode == "full" else 1), (mode, r[mode]["ring_runs"])
    for (name, regime, mode), kept in ranks[0]["kept"].items():
        model = MEASURED_BLOCKS[name]
        precision = "fp32" if regime == "fp32" else "bf16"
        count = layer_activation_bytes(
            model,
            micro_batch=3,
            precision=precision,
            regime=regime,
            cp=2,
            checkpointing=mode,
            compiled=True,
            device="cpu",
        )
        inv_freq = 0 if model.arch == "gpt" else model.head_dim // 2 * 4
        assert 0 <= kept - count - inv_freq <= 16, (name, regime, mode, kept, count + inv_freq)


def test_planned_activations_of_cp2_match_what_a_cp2_rank_saves(two_ranks):
    """What the ring keeps beyond the fused kernel (``ModelFamily.ring_attention_bytes``) is exactly what a
    cp=2 rank's block saves beyond the same block at ``seq_len / 2`` without cp, for the Llama (grouped-query,
    and multi-head with q/k norms) and the GPT blocks in every regime; the planner's per-block count at cp=2
    equals autograd's saved tensors byte for byte (every regime; the GPT's in fp32, where its own count is
    exact); and its activation plan for a whole two-layer model (``estimate``: the layers, the final
    norm, and of the logits' plan the fp32 log-softmax the loss saves) is within 15% of what that rank saves
    for its forward and loss."""
    from etrain.service.planning.estimate import estimate
    from etrain.service.planning.plan_activations import layer_activation_bytes
    from etrain.service.planning.spec import JobSpec
    from etrain.workers.families import family

    measured = two_ranks[0]["saved"]
    for (name, regime), (saved, plain) in measured["blocks"].items():
        model = MEASURED_BLOCKS[name]
        local = dataclasses.replace(model, seq_len=model.seq_len // 2)
        if regime == "fp32_math":  # the math path: the count for an fp32 ring on a GPU
            extra, _ = family(model.arch).ring_attention_bytes(local, micro_batch=3, regime="fp32", device="cuda")
            assert saved - plain == extra, (name, regime, saved - plain, extra)
            continue
        precision = "fp32" if regime == "fp32" else "bf16"
        extra, _ = family(model.arch).ring_attention_bytes(local, micro_batch=3, regime=regime, device="cpu")
        assert saved - plain == extra, (name, regime, saved - plain, extra)  # what the ring keeps beyond the kernel
        if name in ("gpt", "olmo2") and regime != "fp32":
            continue  # these families' own counts are exact in fp32 only (checked against the ring's part above)
        count = layer_activation_bytes(model, micro_batch=3, precision=precision, regime=regime, cp=2, device="cpu")
        casts = 0  # under autocast autograd also keeps each projection's bf16 weight (the planner's weight_casts)
        if regime == "autocast":
            block = _block_classes()[model.arch](model)
            casts = 2 * sum(m.weight.numel() for m in block.modules() if isinstance(m, torch.nn.Linear))
        assert saved == count + casts, (name, regime, saved, count + casts)

    m = MEASURED_MODEL
    sizes = {k: getattr(m, k) for k in ("n_layers", "d_model", "n_heads", "n_kv_heads", "vocab_size", "seq_len")}
    spec = JobSpec.model_validate(
        {
            "name": "cp-plan",
            "model": {"kind": "llama", "d_ff": m.d_ff, **sizes},
            "parallelism": {"dp": 1, "cp": 2},
            "training": {"steps": 1, "global_batch": 2, "micro_batch": 2, "precision": "fp32"},
        }
    )
    plan = estimate(spec)
    log_softmax = 4 * 2 * (m.seq_len // 2) * m.vocab_size  # a rank's tokens x vocab, fp32
    planned = plan.memory.activations + log_softmax
    print(f"cp2 activations: planned {planned} B, measured {measured['model']} B")
    assert planned == pytest.approx(measured["model"], rel=0.15)

"""Memory per rank: the parameters each rank holds and the peak of a training step, by component.

Each formula is tested on its own in tests/unit/test_planner.py:

* ZeRO memory per parameter (``bytes_per_param``): the ZeRO table of
  ``distributed-training-mathematics`` (Rajbhandari et al. 2020).
* What a stage holds (``stage_params``, ``stage_memory``), as below; its activations and logits come
  from ``service/planning/plan_activations.py``.

service/planning/estimate.py applies them to a spec's layout.

What a rank holds (``stage_memory``), as the engine runs (``workers/engine/parallelize.py``,
``workers/engine/train.py``, ``workers/engine/optim.py``, ``workers/engine/init.py``); every byte count is per rank:

* Master weights, gradients and AdamW's two moments are fp32 in every precision mode
  (``precision_bytes``: 4 + 4 + 8). ``training.precision: bf16`` adds bf16 *compute copies*: under
  FSDP2 (ZeRO-2/3) a ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` all-gathers bf16
  unsharded parameters; on the DDP / ZeRO-1 / TP / PP paths ``torch.autocast`` casts each matmul
  weight to bf16 once per forward and autograd keeps the cast until the backward.
* ZeRO shards over the sharding group (``dp``, or ``dp / dp_replicate`` under HSDP): stage 1 the
  optimizer states (``ZeroRedundancyOptimizer`` over all dp ranks), 2 and 3 (FSDP2) parameters,
  gradients and states. DDP (ZeRO-0/1 without TP) keeps its gradient buckets beside the gradients
  (``gradient_as_bucket_view`` is off): another 4 bytes per parameter.
* FSDP2 at the peak (``buffers``): ZeRO-2 keeps the whole stage gathered from forward to backward;
  ZeRO-3 keeps the root unit (embeddings, final norm, output) gathered from forward to backward
  (FSDP2 never reshards the root after forward) plus the block being computed and the one
  prefetched; a pipeline keeps the stage gathered until its last backward. Gradient accumulation
  runs without gradient sync, so with more than one micro-batch per step the stage's unsharded
  gradients (fp32, the reduce dtype) live until the last micro-step's reduce-scatter; with one,
  only the unit being reduced and its reduce-scatter input.
* Expert parallelism (``ep`` > 1, :func:`expert_split`): a rank holds ``n_experts / ep`` experts of
  each MoE layer whole (weights, gradients, AdamW moments: 16 bytes per element), replicated over the
  ``dp / ep`` ranks holding the same ones; DDP's buckets and FSDP2's gathers and shards leave them out,
  and autocast casts only the local ones. Where FSDP2 shards them over those ranks too
  (``layout_rules.expert_fsdp_shards``) a rank holds ``1 / (dp / ep)`` of them, and FSDP2 gathers and
  reduces each block's local experts with the block (its ``gathered_params`` and ``unsharded_grads``). Activations add the exchange's two int64 indexes per pick (the
  regrouping permutation and its inverse), the routing assumed balanced.
* Tensor parallelism as measured: the token embedding's gradient arrives replicated (full
  vocabulary) on every tp rank, though its weight is a vocab shard (``gradients`` counts it).
* CPU offload (``offload: cpu``, FSDP2's ``CPUOffloadPolicy``): sharded parameters, gradients and
  optimizer states live in host memory (``host_bytes``); the device keeps the gathered parameters,
  unsharded gradients, activations and logits.
* Initialisation builds on the meta device and materialises the rank's shards; each parameter's
  full fp32 initial value is drawn once on the rank's device (``workers/engine/init.py``) before the rank
  copies out its slice: shards plus the largest single parameter (and its slice, when sharded)
  (``init`` phase).
* The optimizer step: fused AdamW (``workers/engine/optim.py``, on CUDA and on CPU parameters alike: CPU
  runs and offload) updates the states in place and holds no temporary. (Until 2026-12 a CPU step used
  ``foreach`` kernels, which held one the size of the second moments; ``make bench`` measured it.) The
  ``optimizer_step`` phase is also the end of the last backward, with the same states, gradients and
  buffers: when micro-batches accumulate without FSDP2, the largest parameter's fresh gradient is held there
  beside the accumulated one (its ``transient``; measured on CPU, where the embedding is a large part).
* The peak is the largest of three phases (``MemoryBreakdown.phases``): ``init``,
  ``forward_backward`` (states + buffers + activations + logits of the micro-batches in flight) and
  ``optimizer_step`` (states + gradients + buffers at the end of the last backward, with the fresh
  gradient held while accumulating; fused AdamW adds nothing). ``overhead`` is the runtime itself
  (CUDA context and communicator buffers; on CPU the Python + torch process, measured by
  ``make bench`` as an empty rank's RSS). Memory is in bytes and GiB; ``device_memory_gb`` is GiB.

Every count that depends on the model's architecture (a block's parameters, the embeddings and head,
the largest parameter, the matmul weights) is its family's (``etrain.workers.families``), checked
against the family's modules in tests/unit/test_families.py.

What a rank's layers hold under TP (Megatron/torchtitan sharding): column-parallel ``wq/wk/wv/w1``
(and SwiGLU's ``w3``) shard weight and bias by ``tp``; row-parallel ``wo/w2`` shard the weight but
keep any bias whole; norms are replicated; the token embedding and the output head are
vocab-parallel (sharded by ``tp``; a tied Llama shares one vocab shard); the GPT's learned
position embedding is replicated. A pipeline stage holds ``n_layers / (pp * virtual_stages)``
layers per chunk; stage 0 also holds the embeddings and the last stage the final norm and head.
The estimate reports the WORST stage.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from etrain.service.planning.plan_activations import (
    compute_regime,
    final_norm_bytes,
    layer_activation_bytes,
    logits_bytes,
    ring_transient_bytes,
    rope_table_bytes,
)
from etrain.workers.families import family
from etrain.workers.protocol import layout_rules
from etrain.workers.protocol.compiled_blocks import compiled_block_form
from etrain.workers.protocol.run_config import ModelConfig

__all__ = [
    "RUNTIME_OVERHEAD_GIB",
    "GiB",
    "MEMORY_COMPONENTS",
    "PHASES",
    "MemoryBreakdown",
    "bytes_per_param",
    "expert_split",
    "gib",
    "largest_param",
    "layer_params",
    "precision_bytes",
    "stage_memory",
    "stage_params",
]

GiB = 1024**3
#: Memory a rank uses before holding any tensor. CUDA: context, NCCL buffers, allocator slack.
#: CPU: the Python + torch + gloo process of a rank, measured by ``make bench`` as an empty rank's
#: peak RSS (274 MiB on x86_64 Linux, torch 2.13), rounded up.
RUNTIME_OVERHEAD_GIB = {"cuda": 1.0, "cpu": 0.27}
MEMORY_COMPONENTS = (
    "parameters",
    "gradients",
    "optimizer_states",
    "activations",
    "logits",
    "buffers",
    "transient",
    "overhead",
)
PHASES = ("init", "forward_backward", "optimizer_step")


def gib(nbytes: float) -> float:
    """Bytes as GiB, rounded to the MiB, for reports."""
    return round(nbytes / GiB, 3)


def bytes_per_param(
    zero: int, n: int, *, param_bytes: float = 2, grad_bytes: float = 2, optimizer_bytes: float = 8
) -> float:
    """Per-GPU bytes per parameter under ZeRO over ``n`` data-parallel ranks (the seed table).

    With the defaults (fp16 params and grads, fp32 Adam moments): 12, 4 + 8/N, 2 + 10/N, 12/N.
    """
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero}")
    if n < 1:
        raise ValueError(f"n (data-parallel ranks) must be >= 1, got {n}")
    params = param_bytes / n if zero >= 3 else param_bytes
    grads = grad_bytes / n if zero >= 2 else grad_bytes
    states = optimizer_bytes / n if zero >= 1 else optimizer_bytes
    return params + grads + states


def precision_bytes(precision: str) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes per parameter that this engine keeps resident.

    Both precisions keep fp32 master weights, fp32 gradients and AdamW's two fp32 moments: bf16
    training computes with bf16 *copies* (FSDP2's MixedPrecisionPolicy or autocast), counted as
    buffers by :func:`stage_memory`, not instead of the fp32 state.
    """
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision must be 'fp32' or 'bf16', got {precision!r}")
    return 4, 4, 8


def layer_params(model: ModelConfig, tp: int = 1) -> float:
    """Parameters of one transformer block held by one tensor-parallel rank (its family's count:
    column- and row-parallel weights and the column-parallel biases divided by ``tp``, norms and the
    row-parallel biases replicated)."""
    return family(model.arch).layer_params(model, tp)


def _embedding_params(model: ModelConfig, tp: int) -> float:
    """The token embedding (vocab-parallel) and any replicated position embedding (the GPT's)."""
    return family(model.arch).embedding_params(model, tp)


def _head_params(model: ModelConfig, tp: int, *, with_embedding: bool = False) -> float:
    """The final norm (replicated) and the output head (vocab-parallel). A tied head on the embedding's
    stage is the embedding's weight: not counted again."""
    return family(model.arch).head_params(model, tp, with_embedding=with_embedding)


def stage_params(model: ModelConfig, *, tp: int = 1, layers: int, first: bool, last: bool) -> float:
    """Parameters one rank holds: its layers plus the embeddings (first stage) and head (last).

    Tied embeddings are counted once when one stage holds both ends; a last stage without the
    embedding would need its own copy (the planner refuses pp > 1 for tied models)."""
    total = layers * layer_params(model, tp)
    if first:
        total += _embedding_params(model, tp)
    if last:
        total += _head_params(model, tp, with_embedding=first)
    return total


def largest_param(model: ModelConfig, *, first: bool = True, last: bool = True) -> int:
    """Elements of the largest single parameter a stage owns, whole (not sharded).

    Initialisation draws each parameter's full value (``workers/engine/init.py``) before a rank keeps its
    slice, so this is the transient on top of the rank's shards while it materialises."""
    return family(model.arch).largest_param(model, first=first, last=last)


def expert_split(model: ModelConfig, *, layers: int, ep: int = 1, tp: int = 1) -> tuple[float, float, float]:
    """Expert parallelism's split of a stage's ``layers`` (``parallelism.ep``): (the expert parameters
    split over the ep ranks, ``layers`` blocks' worth of every expert; the expert parameters one rank holds,
    ``1 / ep`` of them; one block's stacked experts, which DDP and FSDP2 leave out), all 0 when ``ep`` is
    1 (the experts are then parameters like any other). The local experts are not bucketed by DDP: their
    weights, gradients and AdamW moments (``4 + 4 + 8`` bytes per element) are divided by ``ep``, and by
    ``tp``, which splits every expert's width (as it does in the stage's parameter count these are taken
    out of); :func:`stage_memory` divides them by ``dp / ep`` too where FSDP2 shards them over those ranks."""
    if ep <= 1:
        return 0.0, 0.0, 0.0
    per_layer = family(model.arch).expert_params_per_layer(model) / tp
    return float(layers * per_layer), layers * per_layer / ep, float(per_layer)


def _matmul_params(model: ModelConfig, *, tp: int, layers: int, last: bool) -> float:
    """Weights a stage multiplies by (autocast keeps a bf16 cast of each until the backward): every
    projection weight of its layers and the output head's; not biases (``addmm`` keeps no cast of
    them), norms or the embedding lookup."""
    per_layer = family(model.arch).matmul_params_per_layer(model, tp)
    head = model.vocab_size * model.d_model / tp if last else 0.0
    return layers * per_layer + head


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Bytes one rank (of the worst pipeline stage) holds at its peak, by component.

    The components describe the *peak phase* (``phase``, one of :data:`PHASES`); ``phases`` gives
    every phase's total, so a plan shows e.g. that the optimizer step, not the backward, is the peak.
    ``parameters``, ``gradients`` and ``optimizer_states`` are the fp32 state on the device (sharded
    by ZeRO; zero under CPU offload, where ``host_bytes`` holds them); ``buffers`` are DDP's gradient
    buckets, FSDP2's gathered parameters and unsharded gradients, autocast's bf16 weight casts and the
    RoPE tables; ``transient`` is the init draw of the largest parameter or the optimizer's
    temporaries; ``overhead`` the runtime.
    """

    stage: int
    phase: str
    parameters: int
    gradients: int
    optimizer_states: int
    activations: int
    logits: int
    buffers: int
    transient: int
    overhead: int
    phases: dict[str, int] = dataclasses.field(default_factory=dict)
    host_bytes: int = 0
    #: The rank's checkpointed state (fp32 parameters and AdamW states, wherever they live; a tied embedding
    #: under both its names): the size of an async checkpoint's staging copy of it (``plan_host.py``).
    checkpoint_bytes: int = 0
    #: The same state as an in-memory snapshot holds it: a tied embedding once (``take_snapshot`` copies a
    #: tensor held under two names once); ``checkpoint_bytes`` where nothing is tied.
    snapshot_bytes: int = 0
    #: ``parameters``, ``gradients`` and ``optimizer_states`` live in host memory (FSDP2's CPU offload on a GPU)
    offloaded: bool = False
    #: What ``buffers`` holds at the peak phase: ddp_buckets, gathered_params, unsharded_grads,
    #: weight_casts (autocast) and rope_tables.
    buffer_parts: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.components().values())

    def components(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MEMORY_COMPONENTS}

    @property
    def biggest(self) -> str:
        parts = self.components()
        return max(parts, key=parts.__getitem__)

    def to_dict(self) -> dict:
        parts = self.components()
        return {
            "stage": self.stage,
            "phase": self.phase,
            "bytes": {**parts, "total": self.total},
            "gib": {**{k: gib(v) for k, v in parts.items()}, "total": gib(self.total)},
            "phases_gib": {k: gib(v) for k, v in self.phases.items()},
            "host_gib": gib(self.host_bytes),
            "buffers_gib": {k: gib(v) for k, v in self.buffer_parts.items()},
            "biggest": self.biggest,
        }


def stage_memory(
    model: ModelConfig,
    *,
    stage: int,
    pp: int,
    layers: int,
    virtual_stages: int,
    held: int,
    dp: int,
    tp: int,
    zero: int,
    micro_batch: int,
    microbatches: int,
    precision: str,
    checkpointing: str,
    device: str,
    overhead: float,
    dp_replicate: int = 1,
    offload: str = "none",
    sequence_parallel: bool = False,
    loss_chunk_tokens: int = 0,
    compiled: bool = False,
    ep: int = 1,
    cp: int = 1,
) -> MemoryBreakdown:
    """Peak bytes of one rank of pipeline stage ``stage`` (see the module docstring for the model).

    ``layers`` are the stage's layers (all its chunks), ``held`` the layer chunks x micro-batches
    whose activations it holds at its peak (:func:`layer_chunks_in_flight`). ``ep``: expert parallelism
    (:func:`expert_split`). ``cp``: context parallelism, one more data dimension for the parameters
    (replicated, or FSDP2-sharded, over ``dp · cp`` ranks), a ``1 / cp`` slice of every sequence for the
    activations and logits (``layer_activation_bytes(cp=)``), the ring's transient, and RoPE tables cached for
    the whole sequence.
    """
    first, last = stage == 0, stage == pp - 1
    v = virtual_stages if pp > 1 else 1
    # FSDP2 shards the experts too, over the ranks (of a replica, under HSDP) that hold the same ones (apply_dp)
    expert_shards = layout_rules.expert_fsdp_shards(
        n_experts=model.n_experts, zero=zero, dp=dp, ep=ep, dp_replicate=dp_replicate, cp=cp, offload=offload
    )
    edp_shard = expert_shards or 1
    dp = dp * cp  # the parameters' data-parallel group is dp·cp ranks
    local = dataclasses.replace(model, seq_len=model.seq_len // cp) if cp > 1 else model  # one rank's tokens
    fsdp = layout_rules.uses_fsdp(zero, dp)
    shard = dp // dp_replicate if fsdp else 1
    regime = compute_regime(precision, fsdp=fsdp)
    offloaded = fsdp and offload == "cpu" and device != "cpu"  # on a CPU run host memory is the device's
    s, b, d = local.seq_len, micro_batch, model.d_model
    sp_div = tp if sequence_parallel else 1

    params = stage_params(model, tp=tp, layers=layers, first=first, last=last)
    state_div = shard if fsdp else (dp if zero >= 1 and dp > 1 else 1)
    split, experts_local, layer_experts = expert_split(model, layers=layers, ep=ep, tp=tp)
    dense = params - split  # the stage's parameters outside the split experts (all of them at ep = 1)
    # per rank: dense shards, the local experts (whole, or FSDP2's shard of them over edp)
    held_params = dense / shard + experts_local / edp_shard
    parameters, gradients = 4 * held_params, 4 * held_params
    states = 8 * (dense / state_div + experts_local / edp_shard)
    if tp > 1 and first and not fsdp:
        # Measured (make bench): under TP the token embedding's gradient arrives *replicated* on every tp
        # rank, full vocabulary x d_model, although the weight is a vocab shard (DTensor's embedding
        # backward under RowwiseParallel returns a Replicate gradient for the Shard(0) weight).
        gradients += 4 * model.vocab_size * d * (1 - 1 / tp)

    layer = (layer_params(model, tp) - layer_experts) if layers else 0.0  # what DDP / FSDP2 handle per block
    # FSDP2's units over edp (one per block's experts): gathered and reduced whole, like the block's
    fsdp_experts, layer_fsdp_experts = (experts_local, layer_experts / ep) if expert_shards else (0.0, 0.0)
    root = (_embedding_params(model, tp) if first else 0.0) + (
        _head_params(model, tp, with_embedding=first) if last else 0.0
    )
    buckets = 4 * dense if dp > 1 and not fsdp and tp == 1 else 0.0  # DDP: gradient_as_bucket_view off
    gathered = unsharded_grads = 0.0
    if fsdp:
        gathered_elem = 2 if regime == "bf16_params" else 4
        if zero == 2 or pp > 1:
            gathered = (dense + fsdp_experts) * gathered_elem
        else:  # the root stays gathered from forward to backward; one block computing, one prefetched
            gathered = (root + 2 * (layer + layer_fsdp_experts)) * gathered_elem
        # No gradient sync while accumulating: the stage's gradients stay unsharded (fp32) until the
        # last micro-step; with one micro-batch only the unit being reduced and its reduce-scatter input.
        unsharded_grads = (
            4 * (dense + fsdp_experts) if microbatches > 1 else 2 * 4 * max(layer + layer_fsdp_experts, root)
        )
    elif dp > 1 and tp > 1:  # FSDP-based replicate(): all-reduces one unit's gradients at a time
        unsharded_grads = 4 * max(layer, root)
    # Autocast's bf16 weight copies, kept for backward; under compile with selective checkpointing the
    # partitioner recomputes them (measured: tests/unit/test_planner.py).
    keeps_casts = regime == "autocast" and not (compiled and checkpointing == "selective")
    matmul = _matmul_params(model, tp=tp, layers=layers, last=last) - (split - experts_local)  # local experts
    casts = 2 * matmul if keeps_casts else 0.0
    rope = layers * rope_table_bytes(model)

    # Under ep > 1 the token exchange and the experts it calls run eagerly between a block's graphs
    # (parallelize_stage): their eager count, an overestimate for the rest of the block; and a block that
    # runs eagerly (selective checkpointing around an eager region: compiled_blocks) has its eager count.
    form = compiled_block_form(ep=ep, tp=tp, moe=model.n_experts > 0, checkpointing=checkpointing)
    compiled_count = compiled and ep == 1 and form != "eager"
    per_layer = layer_activation_bytes(
        model,
        cp=cp,
        micro_batch=b,
        tp=tp,
        sequence_parallel=sequence_parallel,
        precision=precision,
        checkpointing=checkpointing,
        regime=regime,
        compiled=compiled_count,
        device=device,
    )
    if ep > 1:  # the exchange's regrouping permutation and its inverse, int64 per pick (balanced routing)
        per_layer += s * b * 16 * model.experts_per_token
    activations = held * (layers // v) * per_layer
    if checkpointing != "none":  # one block's activations live while it is recomputed
        activations += layer_activation_bytes(
            model,
            cp=cp,
            micro_batch=b,
            tp=tp,
            sequence_parallel=sequence_parallel,
            precision=precision,
            regime=regime,
            compiled=compiled_count,
            device=device,
        )
    hidden = s * b * d * (2 if regime == "bf16_params" else 4) / sp_div
    if pp > 1 and not last:  # the schedule keeps each in-flight chunk's output for its backward
        activations += held * hidden
    logits = 0.0
    if last:
        held_last = math.ceil(held / v)
        activations += held_last * final_norm_bytes(model, tokens=s * b, regime=regime, sp_div=sp_div)
        logits = logits_bytes(
            local,
            micro_batch=b,
            tp=tp,
            held=held_last,
            logits_elem=4 if regime == "fp32" else 2,
            pipeline=pp > 1,
            chunk_tokens=loss_chunk_tokens,
            compiled=compiled,
        )

    # A tied embedding is one parameter under two names (the embedding's and the head's) in the rank's state dict,
    # so DCP's staging copy of it for an async save holds its slice twice: on an H100, Llama-3.2-1B's staging
    # held 15.9 GB where 12 bytes per parameter make 14.8 GB. An in-memory snapshot copies it once (measured:
    # tests/integration/test_snapshot.py).
    tied_twice = 4 * model.vocab_size * d / tp / shard if model.tie_embeddings and first and last else 0.0
    # Each parameter's full fp32 value, plus the rank's slice that distribute_tensor cuts from it as a
    # copy when the parameter is sharded (FSDP2 and/or TP DTensors; a plain parameter is copied into).
    pieces = shard * tp
    host_draw = 4 * largest_param(model, first=first, last=last)
    init_draw = host_draw * (1 + (1 / pieces if pieces > 1 else 0))
    on_device = 0.0 if offloaded else 1.0
    host = parameters + gradients + states
    host_bytes = max(host, parameters + init_draw) if offloaded else (host_draw if device != "cpu" else 0.0)

    fb_buffers = dict(
        ddp_buckets=buckets,
        gathered_params=gathered,
        unsharded_grads=unsharded_grads,
        weight_casts=casts,
        rope_tables=rope,
    )
    fb = dict(
        parameters=parameters * on_device,
        gradients=gradients * on_device,
        optimizer_states=states * on_device,
        activations=activations,
        logits=logits,
        buffers=sum(fb_buffers.values()),
        transient=ring_transient_bytes(model, micro_batch=b, cp=cp, regime=regime, tp=tp, device=device),
    )
    # Accumulating micro-batches without FSDP2 (whose unsharded gradients are counted above), each backward
    # makes every gradient afresh and adds it to the one kept so far: at the end of the last backward, with
    # the activations freed, the largest (the embedding's, whole: under TP it arrives replicated) is held
    # twice. Counted whole on every stage: a last pipeline stage's vocab-sharded head under TP is overcounted
    # by its tp (an overestimate, never an underestimate). Measured on CPU (benchmarks/README.md#planner-accuracy): the peak RSS rose by exactly one
    # embedding gradient during every micro-batch's backward after the first, for TP, PP and DDP alike.
    accumulation = 4 * largest_param(model, first=first, last=last) if microbatches > 1 and not fsdp else 0.0
    opt = dict(
        parameters=parameters * on_device,
        gradients=gradients * on_device,
        optimizer_states=states * on_device,
        activations=0.0,
        logits=0.0,
        buffers=buckets + rope,
        transient=accumulation,  # fused AdamW itself steps in place (module docstring)
    )
    init_buffers = buckets if buckets >= init_draw else 0.0
    buffer_parts = {
        "forward_backward": fb_buffers,
        "optimizer_step": dict(ddp_buckets=buckets, rope_tables=rope),
        "init": dict(ddp_buckets=init_buffers),
    }
    init = dict(
        parameters=parameters * on_device,
        gradients=0.0,
        optimizer_states=0.0,
        activations=0.0,
        logits=0.0,
        buffers=init_buffers,
        transient=0.0 if offloaded or init_buffers else init_draw,
    )
    phases = {"init": init, "forward_backward": fb, "optimizer_step": opt}
    rounded = {name: {k: math.ceil(value) for k, value in parts.items()} for name, parts in phases.items()}
    totals = {name: sum(parts.values()) + math.ceil(overhead) for name, parts in rounded.items()}
    peak = max(("forward_backward", "optimizer_step", "init"), key=lambda name: totals[name])
    return MemoryBreakdown(
        stage=stage,
        phase=peak,
        overhead=math.ceil(overhead),
        phases=totals,
        host_bytes=math.ceil(host_bytes),
        checkpoint_bytes=math.ceil(parameters + states + tied_twice),
        snapshot_bytes=math.ceil(parameters + states),
        offloaded=offloaded,
        buffer_parts={k: math.ceil(v) for k, v in buffer_parts[peak].items() if v},
        **rounded[peak],
    )

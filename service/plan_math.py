"""The planner's formulas: memory per rank, pipeline bubble, communication and FLOPs of a layout.

Each one comes from the project's seed documents (named below by file) or the paper they cite,
adapted where this codebase differs, and is tested on its own in tests/unit/test_planner.py:

* ZeRO memory per parameter and the collectives of each stage (``bytes_per_param``): the ZeRO
  table of ``distributed-training-mathematics`` (Rajbhandari et al. 2020).
* Pipeline bubble ``(P - 1)/(M + P - 1)`` (``bubble_fraction``): GPipe (Huang et al. 2019), derived
  in ``distributed-training-mathematics`` and ``data-model-pipeline-parallelism``; the interleaved
  schedule's ``1/v`` from Megatron-LM (Narayanan et al. 2021).
* Activations per layer (``korthikanti_activation_bytes``): Korthikanti et al. 2022, cited in
  ``transformer-math-distributed-training``; ``layer_activation_bytes`` adapts it to our block.
* FLOPs per step (``_step_flops``): 6 per parameter per token (forward 2, backward 4) plus
  attention's ``12·L·d·s``.

service/planner.py applies them to a spec, checks the rules and chooses layouts.

Conventions (bytes per parameter; ``precision_bytes``):

* ``bf16``: parameters 2 + gradients 2 + optimizer states 12 (AdamW's two fp32 moments and an fp32
  master copy) = 16, the ZeRO paper's mixed-precision ``2 + 2 + K`` with K = 12.
* ``fp32``: parameters 4 + gradients 4 + optimizer states 8 (two fp32 moments; no master copy).
* The seed notes' table (``bytes_per_param``) uses 2 + 2 + 8 = 12 (no master copy); it is kept as
  its own function so its worked examples stay checkable.
* ZeRO shards across the ``dp`` ranks: stage 1 the optimizer states, 2 also the gradients, 3 also the
  parameters (the table). On top of the table, ``fsdp_buffers`` counts what FSDP2 holds at the peak
  as the workers run ZeRO-2/3 (``_fsdp_buffers``): notably, gradient accumulation without gradient
  sync keeps a stage's gradients unsharded, so with more than one micro-batch per step ZeRO-2/3 save
  no gradient memory in this build. Memory is in bytes and GiB; ``device_memory_gb`` is read as GiB.

What a rank holds (``workers/model.py``, TP as Megatron/torchtitan shard it): column-parallel
``wq/wk/wv/w1`` shard weight and bias by ``tp``; row-parallel ``wo/w2`` shard the weight but keep the
bias whole; LayerNorms are replicated; the token embedding and the output head are vocab-parallel
(sharded by ``tp``); the learned position embedding is replicated. A pipeline stage holds
``n_layers / (pp * virtual_stages)`` layers per chunk; stage 0 also holds the embeddings and the
last stage the final norm and head. The estimate reports the WORST stage.

Activations (``layer_activation_bytes``, ``in_flight_microbatches``): Korthikanti et al.'s per-layer
count adapted to our block (no dropout, fused attention), times the layers of a stage, times the
micro-batches the schedule keeps in flight on that stage; activation checkpointing keeps only each
block's input plus one block being recomputed. The last stage adds the fp32 log-softmax of the
logits, which ``workers/parallelize.py`` gathers over the vocabulary (not loss-parallel).

Communication (``CommVolume``): bytes the busiest rank sends per optimizer step, ring algorithms
(all-reduce ``2(N-1)/N·D``, reduce-scatter and all-gather ``(N-1)/N·D``); gradients are reduced once
per step, FSDP re-gathers parameters per micro-batch (``_dp_traffic``). Step time (``StepTime``, used
only to rank layouts) is compute at an assumed throughput plus bytes/bandwidth and a per-collective
latency (``Hardware``), stretched by the bubble; nothing is assumed to overlap.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from workers.config import ModelConfig

__all__ = [
    "DDP_BUCKET_BYTES",
    "GiB",
    "MEMORY_COMPONENTS",
    "CommVolume",
    "Hardware",
    "MemoryBreakdown",
    "StepTime",
    "bubble_fraction",
    "bytes_per_param",
    "hardware_for",
    "in_flight_microbatches",
    "korthikanti_activation_bytes",
    "layer_activation_bytes",
    "layer_params",
    "precision_bytes",
    "stage_params",
]

GiB = 1024**3
DDP_BUCKET_BYTES = 25 * 1024**2
MEMORY_COMPONENTS = ("parameters", "gradients", "optimizer_states", "activations", "fsdp_buffers", "overhead")


# ---------------------------------------------------------------------------------------------
# Formulas (each one tested on its own)
# ---------------------------------------------------------------------------------------------


def bytes_per_param(zero: int, n: int, *, param_bytes: float = 2, grad_bytes: float = 2,
                    optimizer_bytes: float = 8) -> float:
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
    """(parameter, gradient, optimizer-state) bytes per parameter for AdamW at this precision."""
    if precision == "bf16":
        return 2, 2, 12  # bf16 weights and grads; fp32 m, v and master copy
    if precision == "fp32":
        return 4, 4, 8  # fp32 weights and grads; fp32 m, v
    raise ValueError(f"precision must be 'fp32' or 'bf16', got {precision!r}")


def layer_params(model: ModelConfig, tp: int = 1) -> float:
    """Parameters of one transformer block held by one tensor-parallel rank.

    Sharded by tp: q/k/v/out and MLP weights, q/k/v and up-projection biases. Replicated: both
    LayerNorms (2 x 2d) and the biases of the row-parallel ``wo`` and ``w2`` (d each).
    """
    d, f = model.d_model, model.ffn_dim
    sharded = 4 * d * d + 3 * d + 2 * d * f + f
    replicated = 2 * d + 2 * d + d + d
    return sharded / tp + replicated


def _embedding_params(model: ModelConfig, tp: int) -> float:
    return model.vocab_size * model.d_model / tp + model.seq_len * model.d_model


def _head_params(model: ModelConfig, tp: int) -> float:
    return model.vocab_size * model.d_model / tp + 2 * model.d_model


def stage_params(model: ModelConfig, *, tp: int = 1, layers: int, first: bool, last: bool) -> float:
    """Parameters one rank holds: its layers plus the embeddings (first stage) and head (last)."""
    total = layers * layer_params(model, tp)
    if first:
        total += _embedding_params(model, tp)
    if last:
        total += _head_params(model, tp)
    return total


def korthikanti_activation_bytes(*, seq_len: int, micro_batch: int, d_model: int, n_heads: int,
                                 tp: int = 1, sequence_parallel: bool = False) -> float:
    """Activations one layer saves per micro-batch, half precision (Korthikanti et al. 2022).

    ``sbh(34 + 5as/h)`` without TP; ``sbh(10 + 24/t + 5as/(ht))`` with TP; ``sbh/t (34 + 5as/h)``
    with TP and sequence parallelism. Counts dropout masks and materialised attention scores.
    """
    s, b, h, a = seq_len, micro_batch, d_model, n_heads
    sbh, scores = s * b * h, 5 * a * s * s * b
    if sequence_parallel:
        return (34 * sbh + scores) / tp
    return sbh * (10 + 24 / tp) + scores / tp


def layer_activation_bytes(model: ModelConfig, *, micro_batch: int, tp: int = 1,
                           sequence_parallel: bool = False, precision: str = "bf16",
                           checkpointing: bool = False) -> float:
    """Activations one block of OUR model saves for backward, per micro-batch.

    Korthikanti's count adapted to ``workers/model.py`` (and checked against the tensors autograd
    saves): no dropout, so no masks, and fused ``scaled_dot_product_attention``, so no s x s scores,
    only an fp32 log-sum-exp per head and position. Per token it saves, in elements: replicated 4d
    (both LayerNorm inputs and outputs) plus the LayerNorms' fp32 mean and rstd; TP-sharded 4d + 2f
    (q, k, v, the attention output that ``wo`` reads, the GELU input and output). At f = 4d and 2
    bytes that is Korthikanti's 34 sbh less the 2 sbh of dropout masks: sbh (8 + 24/t).
    Element size is 2 bytes (bf16) or 4 (fp32). Sequence parallelism shards the replicated part
    too (Megatron's layout). With activation checkpointing only the block input (s·b·d) is saved.
    """
    elem = 2 if precision == "bf16" else 4
    s, b, d, f = model.seq_len, micro_batch, model.d_model, model.ffn_dim
    sp_div = tp if sequence_parallel else 1
    if checkpointing:
        return s * b * d * elem / sp_div
    replicated = (4 * d * elem + 2 * 2 * 4) * s * b / sp_div  # + two LayerNorms' fp32 mean and rstd
    sharded = s * b * (4 * d + 2 * f) * elem / tp
    log_sum_exp = 4 * model.n_heads * s * b / tp
    return replicated + sharded + log_sum_exp


def _layer_chunks_in_flight(schedule: str, *, pp: int, microbatches: int, virtual_stages: int,
                            stage: int) -> int:
    """Model chunks x micro-batches whose activations ``stage`` holds at its peak."""
    m, v = microbatches, virtual_stages
    if pp <= 1:
        return 1
    if schedule == "gpipe":
        return m * v
    if schedule == "interleaved_1f1b":
        return min(m * v, 2 * (pp - stage - 1) + (v - 1) * pp + 1)
    return min(pp - stage, m) * v


def in_flight_microbatches(schedule: str, *, pp: int, microbatches: int, virtual_stages: int = 1,
                           stage: int = 0) -> float:
    """Micro-batches of a full stage's layers whose activations a stage holds at its peak.

    Assumptions: ``pp == 1`` runs plain gradient accumulation (1). GPipe runs every forward before
    any backward (M). 1F1B warms up ``pp - stage`` forwards, so stage 0 holds ``min(P, M)``.
    Interleaved 1F1B (Megatron/torch) warms up ``2(P - stage - 1) + (v - 1)P + 1`` chunk forwards of
    ``1/v`` of the stage's layers each: ``P + (P - 1)/v`` micro-batches' worth on stage 0.
    """
    chunks = _layer_chunks_in_flight(schedule, pp=pp, microbatches=microbatches,
                                     virtual_stages=virtual_stages, stage=stage)
    return chunks / (virtual_stages if pp > 1 else 1)


def bubble_fraction(pp: int, microbatches: int, schedule: str = "1f1b", virtual_stages: int = 1) -> float:
    """Fraction of a step the pipeline idles: ``(P - 1) / (v·M + P - 1)``.

    GPipe and 1F1B: ``(P - 1)/(M + P - 1)`` (v = 1). Interleaved: Megatron's bubble relative to the
    ideal time is ``(1/v)(P - 1)/M``; as a fraction of the total step that is ``(P - 1)/(v·M + P - 1)``.
    """
    if pp <= 1:
        return 0.0
    v = virtual_stages if schedule == "interleaved_1f1b" else 1
    return (pp - 1) / (v * microbatches + pp - 1)


def _ring_all_reduce(n: int, nbytes: float) -> float:
    return 2 * (n - 1) / n * nbytes


def _ring_gather_or_scatter(n: int, nbytes: float) -> float:
    return (n - 1) / n * nbytes


# ---------------------------------------------------------------------------------------------
# Hardware assumptions for the cost model
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """Sustained throughput per rank the step-time model assumes (order of magnitude, not a promise)."""

    flops_per_s: float
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    intra_node_latency_s: float  # per collective / send: what makes many small ones expensive
    inter_node_latency_s: float
    ranks_per_node: int

    def link(self, span: int) -> tuple[float, float]:
        """(bytes/s, latency) of a group of consecutive ranks spanning ``span`` ranks."""
        if span <= self.ranks_per_node:
            return self.intra_node_bytes_per_s, self.intra_node_latency_s
        return self.inter_node_bytes_per_s, self.inter_node_latency_s


def hardware_for(device: str, precision: str, cpus_per_worker: float = 1.0) -> Hardware:
    """H100-class GPUs at ~40% MFU, NVLink inside an 8-GPU node (~400 GB/s all-reduce bus bandwidth),
    200 Gb/s InfiniBand per GPU across nodes; CPU workers on one machine talking gloo."""
    if device == "cuda":
        return Hardware(flops_per_s=400e12 if precision == "bf16" else 50e12,
                        intra_node_bytes_per_s=400e9, inter_node_bytes_per_s=25e9,
                        intra_node_latency_s=10e-6, inter_node_latency_s=30e-6, ranks_per_node=8)
    return Hardware(flops_per_s=2e10 * cpus_per_worker, intra_node_bytes_per_s=2e9, inter_node_bytes_per_s=1e9,
                    intra_node_latency_s=200e-6, inter_node_latency_s=500e-6, ranks_per_node=64)


# ---------------------------------------------------------------------------------------------
# Result types
# ---------------------------------------------------------------------------------------------


def _gib(nbytes: float) -> float:
    return round(nbytes / GiB, 3)


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Bytes one rank (of the worst pipeline stage) holds at its peak.

    ``parameters``, ``gradients`` and ``optimizer_states`` follow the ZeRO table
    (:func:`bytes_per_param` at this precision); ``fsdp_buffers`` is what FSDP2 holds on top of it at
    the peak, as the workers run ZeRO-2/3 (gathered parameters, gradients accumulated unsharded).
    """

    stage: int
    parameters: int
    gradients: int
    optimizer_states: int
    activations: int
    fsdp_buffers: int  # ZeRO-2/3: gathered parameters and unsharded gradients beyond the ZeRO table
    overhead: int

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
            "bytes": {**parts, "total": self.total},
            "gib": {**{k: _gib(v) for k, v in parts.items()}, "total": _gib(self.total)},
            "biggest": self.biggest,
        }


@dataclass(frozen=True, kw_only=True)
class CommVolume:
    """Bytes the busiest rank sends (about as many it receives) per optimizer step, by mesh axis,
    and how many collectives (or point-to-point sends) carry them."""

    dp: int
    tp: int
    pp: int
    dp_ops: int = 0
    tp_ops: int = 0
    pp_ops: int = 0

    @property
    def total(self) -> int:
        return self.dp + self.tp + self.pp

    def to_dict(self) -> dict:
        parts = {"dp": self.dp, "tp": self.tp, "pp": self.pp, "total": self.total}
        return {"bytes": parts, "gib": {k: _gib(v) for k, v in parts.items()},
                "collectives": {"dp": self.dp_ops, "tp": self.tp_ops, "pp": self.pp_ops}}


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """Cost model: ``(compute + tp + pp) / (1 - bubble) + dp`` seconds, nothing overlapped."""

    compute_s: float
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    bubble_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.tp_comm_s + self.pp_comm_s + self.dp_comm_s + self.bubble_s

    def to_dict(self) -> dict:
        fields = dataclasses.asdict(self)
        return {**{k: float(f"{v:.4g}") for k, v in fields.items()}, "total_s": float(f"{self.total_s:.4g}")}

# ---------------------------------------------------------------------------------------------
# Communication, FSDP buffers and FLOPs per step
# ---------------------------------------------------------------------------------------------


def _fsdp_buffers(*, zero: int, dp: int, pp: int, microbatches: int, params: float, unit: float,
                  param_bytes: int, grad_bytes: int) -> float:
    """What ZeRO-2/3 hold at the peak beyond the ZeRO table, as the workers run them.

    ZeRO-0/1 are DDP (+ ZeroRedundancyOptimizer): nothing extra (DDP's buckets are views of the
    gradients). ZeRO-2/3 are FSDP2 (``workers/parallelize.py``), one unit per block plus the root:

    * ZeRO-2 keeps parameters gathered from forward to backward: the table's full parameters are
      live, and FSDP's sharded copy (1/dp) sits beside them.
    * ZeRO-3 gathers one unit at a time and prefetches the next (2 units), except under a pipeline
      schedule, which keeps the stage's parameters gathered until its last backward
      (``set_reshard_after_backward(False)``): the full parameters then.
    * Gradient accumulation runs without gradient sync (``workers.parallelize.gradient_sync``, and
      the pipeline schedules do the same), so with more than one micro-batch per step the stage's
      full unsharded gradients live until the last micro-step's reduce-scatter; with one, only the
      unit being reduced.
    """
    if zero < 2 or dp <= 1:
        return 0.0
    if zero == 2:
        extra_params = params * param_bytes / dp
    else:
        extra_params = params * param_bytes if pp > 1 else 2 * unit * param_bytes
    extra_grads = params * grad_bytes if microbatches > 1 else unit * grad_bytes
    return extra_params + extra_grads


def _dp_traffic(*, zero: int, dp: int, pp: int, microbatches: int, params: float, param_bytes: int,
                grad_bytes: int, units: int, tensors: int) -> tuple[float, int]:
    """(bytes sent, collectives) per step on the dp axis, ring algorithms.

    ZeRO-0: one all-reduce of the gradients, 2(N-1)/N·G, in 25 MiB DDP buckets. ZeRO-1 adds
    ZeroRedundancyOptimizer's broadcast of the updated parameters, (N-1)/N·P, one per tensor (the
    seed table's "all-reduce + scatter"). ZeRO-2: one reduce-scatter of the gradients per step plus
    an all-gather of the parameters per forward, (N-1)/N·(G + P); ZeRO-3 one more all-gather for
    the backward, (N-1)/N·(G + 2P). FSDP reshards after every backward when no pipeline keeps the
    parameters gathered, so with M micro-batches per step those all-gathers happen M times (the
    seed formulas are the M = 1 case); a pipeline gathers ZeRO-2 once and ZeRO-3 once per forward
    plus once for the backwards.
    """
    if dp <= 1:
        return 0.0, 0
    grads, weights = params * grad_bytes, params * param_bytes
    if zero <= 1:
        volume = _ring_all_reduce(dp, grads)
        ops = math.ceil(grads / DDP_BUCKET_BYTES)
        if zero == 1:
            volume += _ring_gather_or_scatter(dp, weights)
            ops += tensors
        return volume, ops
    m = microbatches
    if zero == 2:
        gathers = m if pp == 1 else 1
    else:
        gathers = 2 * m if pp == 1 else m + 1
    return _ring_gather_or_scatter(dp, grads) + gathers * _ring_gather_or_scatter(dp, weights), units * (1 + gathers)


def _tp_traffic(*, tp: int, microbatches: int, layers: int, first: bool, last: bool, checkpointing: bool,
                hidden_bytes: float, logits_bytes: float) -> tuple[float, int]:
    """(bytes sent, collectives) per step on the tp axis of one stage, ring algorithms.

    Per layer per micro-batch 2 all-reduces forward + 2 backward of b·s·d (same volume as
    all-gather + reduce-scatter under sequence parallelism; +2 forward when recomputed); the
    vocab-parallel embedding (forward) and head (backward) one each; the head's logits are
    all-gathered over the vocabulary (``workers/parallelize.py``: output_layouts=Replicate()).
    """
    if tp <= 1:
        return 0.0, 0
    m = microbatches
    ar_per_layer = 6 if checkpointing else 4  # 2 fwd + 2 bwd all-reduces, +2 fwd in recompute
    edge_ops = int(first) + int(last)
    ops = m * (layers * ar_per_layer + edge_ops + int(last))
    volume = m * ((layers * ar_per_layer + edge_ops) * _ring_all_reduce(tp, hidden_bytes)
                  + int(last) * _ring_gather_or_scatter(tp, logits_bytes))
    return volume, ops


def _pp_traffic(*, pp: int, virtual_stages: int, microbatches: int, hidden_bytes: float,
                sp_div: int) -> tuple[float, int]:
    """(bytes sent, sends) per step by the busiest stage: each micro-batch's activations cross every
    chunk boundary forward, its gradients backward. ``sp_div`` is tp under sequence parallelism
    (the hidden states cross sharded), else 1."""
    v = virtual_stages
    sends = max(v - (i == pp - 1) + v - (i == 0) for i in range(pp)) if pp > 1 else 0
    return microbatches * sends * hidden_bytes / sp_div, microbatches * sends


def _step_flops(model: ModelConfig, *, global_batch: int, checkpointing: bool) -> tuple[float, float]:
    """(FLOPs per step, the same with activation recompute): 6 per matmul parameter per token
    (forward 2, backward 4) plus attention's 12·L·d·s per token; recompute runs the forward again."""
    s, d = model.seq_len, model.d_model
    tokens = global_batch * s
    matmul_params = model.num_params - (model.vocab_size + s) * d  # lookups are not matmuls
    attention = model.n_layers * d * s
    flops = 6 * matmul_params * tokens + 12 * attention * tokens
    flops_recompute = flops + (2 * matmul_params + 4 * attention) * tokens if checkpointing else flops
    return flops, flops_recompute


def _step_time(hw: Hardware, *, dp: int, tp: int, pp: int, comm: CommVolume, flops: float,
               bubble: float) -> StepTime:
    """Seconds per step under the :class:`StepTime` cost model, links chosen by :meth:`Hardware.link`."""

    def seconds(nbytes: float, ops: int, span: int) -> float:  # Megatron order: tp, then dp, then pp
        bandwidth, latency = hw.link(span)
        return nbytes / bandwidth + ops * latency

    world = dp * tp * pp
    compute = flops / world / hw.flops_per_s
    tp_s = seconds(comm.tp, comm.tp_ops, tp)
    pp_s = seconds(comm.pp, comm.pp_ops, world)
    dp_s = seconds(comm.dp, comm.dp_ops, tp * dp)
    busy = compute + tp_s + pp_s
    return StepTime(compute_s=compute, tp_comm_s=tp_s, pp_comm_s=pp_s, dp_comm_s=dp_s,
                    bubble_s=busy / (1 - bubble) - busy)

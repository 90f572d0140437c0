"""Communication, FLOPs and time of a step: what ranks layouts (never what rejects one).

Each formula is tested on its own in tests/unit/test_planner.py:

* The collectives of each ZeRO stage (``dp_traffic``): the ZeRO table of
  ``distributed-training-mathematics`` (Rajbhandari et al. 2020).
* Pipeline bubble ``(P - 1)/(M + P - 1)`` (``bubble_fraction``): GPipe (Huang et al. 2019), derived
  in ``distributed-training-mathematics`` and ``data-model-pipeline-parallelism``; the interleaved
  schedule's ``1/v`` from Megatron-LM (Narayanan et al. 2021).
* FLOPs per step (``step_flops``): 6 per matmul parameter per token (forward 2, backward 4) plus
  attention's ``12·L·(heads·head_dim)·s``.

Communication (``CommVolume``): bytes the busiest rank sends per optimizer step, ring algorithms
(all-reduce ``2(N-1)/N·D``, reduce-scatter and all-gather ``(N-1)/N·D``); gradients are reduced once
per step, FSDP re-gathers parameters per micro-batch (``dp_traffic``). Step time (``StepTime``, used
only to rank layouts) is compute at an assumed throughput plus bytes/bandwidth and a per-collective
latency (``Hardware``), stretched by the bubble; nothing is assumed to overlap.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from etrain.service.planning.plan_memory import gib
from etrain.workers.families import family
from etrain.workers.protocol import layout_rules
from etrain.workers.protocol.run_config import ModelConfig

__all__ = [
    "DDP_BUCKET_BYTES",
    "CommVolume",
    "Hardware",
    "StepTime",
    "bubble_fraction",
    "cp_traffic",
    "dp_traffic",
    "ep_traffic",
    "hardware_for",
    "pp_traffic",
    "step_flops",
    "step_time",
    "tp_traffic",
]

DDP_BUCKET_BYTES = 25 * 1024**2


def bubble_fraction(pp: int, microbatches: int, schedule: str = "1f1b", virtual_stages: int = 1) -> float:
    """Fraction of a step the pipeline idles: ``(P - 1) / (v·M + P - 1)``.

    GPipe and 1F1B: ``(P - 1)/(M + P - 1)`` (v = 1). Interleaved: Megatron's bubble relative to the
    ideal time is ``(1/v)(P - 1)/M``; as a fraction of the total step that is ``(P - 1)/(v·M + P - 1)``.
    """
    if pp <= 1:
        return 0.0
    v = virtual_stages if schedule == "interleaved_1f1b" else 1
    return (pp - 1) / (v * microbatches + pp - 1)


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
    #: expert parallelism's token all-to-alls (``ep_traffic``); 0 without it
    ep: int = 0
    ep_ops: int = 0
    #: context parallelism's ring exchanges of K/V blocks (``cp_traffic``); 0 without it
    cp: int = 0
    cp_ops: int = 0

    @property
    def total(self) -> int:
        return self.dp + self.tp + self.pp + self.ep + self.cp

    def to_dict(self) -> dict:
        parts = {"dp": self.dp, "tp": self.tp, "pp": self.pp, "ep": self.ep, "cp": self.cp, "total": self.total}
        return {
            "bytes": parts,
            "gib": {k: gib(v) for k, v in parts.items()},
            "collectives": {
                "dp": self.dp_ops,
                "tp": self.tp_ops,
                "pp": self.pp_ops,
                "ep": self.ep_ops,
                "cp": self.cp_ops,
            },
        }


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """Cost model: ``(compute + tp + ep + cp + pp) / (1 - bubble) + dp`` seconds, nothing overlapped."""

    compute_s: float
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    bubble_s: float
    ep_comm_s: float = 0.0  # expert parallelism's all-to-alls, counted with compute (inside the pipeline)
    cp_comm_s: float = 0.0  # context parallelism's ring, counted with compute (blocking, not overlapped)

    @property
    def total_s(self) -> float:
        return (
            self.compute_s
            + self.tp_comm_s
            + self.pp_comm_s
            + self.dp_comm_s
            + self.bubble_s
            + self.ep_comm_s
            + self.cp_comm_s
        )

    def to_dict(self) -> dict:
        fields = dataclasses.asdict(self)
        return {**{k: float(f"{v:.4g}") for k, v in fields.items()}, "total_s": float(f"{self.total_s:.4g}")}


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
        return Hardware(
            flops_per_s=400e12 if precision == "bf16" else 50e12,
            intra_node_bytes_per_s=400e9,
            inter_node_bytes_per_s=25e9,
            intra_node_latency_s=10e-6,
            inter_node_latency_s=30e-6,
            ranks_per_node=8,
        )
    return Hardware(
        flops_per_s=2e10 * cpus_per_worker,
        intra_node_bytes_per_s=2e9,
        inter_node_bytes_per_s=1e9,
        intra_node_latency_s=200e-6,
        inter_node_latency_s=500e-6,
        ranks_per_node=64,
    )


def _ring_all_reduce(n: int, nbytes: float) -> float:
    return 2 * (n - 1) / n * nbytes


def _ring_gather_or_scatter(n: int, nbytes: float) -> float:
    return (n - 1) / n * nbytes


def dp_traffic(
    *,
    zero: int,
    dp: int,
    pp: int,
    microbatches: int,
    params: float,
    param_bytes: int,
    grad_bytes: int,
    units: int,
    tensors: int,
    dp_replicate: int = 1,
) -> tuple[float, int]:
    """(bytes sent, collectives) per step on the dp axis, ring algorithms.

    ZeRO-0: one all-reduce of the gradients, 2(N-1)/N·G, in 25 MiB DDP buckets. ZeRO-1 adds
    ZeroRedundancyOptimizer's broadcast of the updated parameters, (N-1)/N·P, one per tensor (the
    seed table's "all-reduce + scatter"). ZeRO-2: one reduce-scatter of the gradients per step plus
    an all-gather of the parameters per forward, (N-1)/N·(G + P); ZeRO-3 one more all-gather for
    the backward, (N-1)/N·(G + 2P). FSDP reshards after every backward when no pipeline keeps the
    parameters gathered, so with M micro-batches per step those all-gathers happen M times (the
    seed formulas are the M = 1 case); a pipeline gathers ZeRO-2 once and ZeRO-3 once per forward
    plus once for the backwards. HSDP (``dp_replicate`` R > 1) runs those collectives inside a
    shard group of N = dp/R ranks and adds an all-reduce of the reduced gradient shard (G/N)
    across the R replicas.
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
    m, n, r = microbatches, dp // dp_replicate, dp_replicate
    if zero == 2:
        gathers = m if pp == 1 else 1
    else:
        gathers = 2 * m if pp == 1 else m + 1
    volume = _ring_gather_or_scatter(n, grads) + gathers * _ring_gather_or_scatter(n, weights)
    ops = units * (1 + gathers)
    if r > 1:
        volume += _ring_all_reduce(r, grads / n)
        ops += units
    return volume, ops


def tp_traffic(
    *,
    tp: int,
    microbatches: int,
    layers: int,
    first: bool,
    last: bool,
    checkpointing: str,
    hidden_bytes: float,
    tokens: int,
    mlp_factor: float = 1.0,
) -> tuple[float, int]:
    """(bytes sent, collectives) per step on the tp axis of one stage, ring algorithms.

    Per layer per micro-batch 2 all-reduces forward + 2 backward of b·s·d (same volume as
    all-gather + reduce-scatter under sequence parallelism; +2 forward when recomputed), the MLP's
    ``mlp_factor`` times a dense MLP's for a mixture of experts (``MoE`` reduces its tokens' outputs once
    summed over their picks, in the residual stream's dtype: fp32 under autocast, twice a bf16 hidden state;
    its routing weights' gradient, ``experts_per_token`` values a token, is not counted; under sequence
    parallelism it gathers the sequence and reduce-scatters its output, as a dense MLP, and its backward
    gathers the output's gradient and reduce-scatters the input's, ``MoEParallel``); the
    vocab-parallel embedding (forward) and head (backward) one each. The logits stay vocab-sharded:
    ``loss_parallel`` all-reduces three fp32 values per token (max, sum of exponentials, the target's
    logit) instead of gathering them.
    """
    if tp <= 1:
        return 0.0, 0
    m = microbatches
    # 2 fwd + 2 bwd all-reduces, +2 fwd when full checkpointing recomputes the block (selective keeps the
    # reduced outputs: etrain.workers.engine.parallelize.apply_ac).
    ar_per_layer = 6 if checkpointing == "full" else 4
    edge_ops = int(first) + int(last)
    ops = m * (layers * ar_per_layer + edge_ops + 3 * int(last))
    volume = m * (
        (layers * ar_per_layer * (1 + mlp_factor) / 2 + edge_ops) * _ring_all_reduce(tp, hidden_bytes)
        + int(last) * 3 * _ring_all_reduce(tp, 4 * tokens)
    )
    return volume, ops


def ep_traffic(
    *,
    ep: int,
    microbatches: int,
    moe_layers: int,
    tokens: int,
    top_k: int,
    d_model: int,
    elem_bytes: int,
    checkpointing: str,
) -> tuple[float, int]:
    """(bytes sent, collectives) per step of expert parallelism's token exchange on one rank
    (``etrain.workers.families.expert_parallel``).

    Per MoE layer per micro-batch: 2 all-to-alls forward (dispatch the ``tokens · top_k`` picked rows to
    their experts' ranks, combine the outputs back) and 2 backward (their reverse), each a buffer of
    ``tokens · top_k · d_model · elem_bytes``; activation checkpointing (full, and selective, which keeps no
    collective's output) replays the forward's 2 in the backward. With balanced routing ``(ep - 1) / ep`` of
    each buffer leaves the rank (what is counted, like the ring formulas' ``(N - 1) / N``). Before each
    forward exchange the per-expert counts are exchanged too (``n_experts`` integers: counted as a
    collective, not as bytes). No token is dropped, so the volume is the routing's, unbounded by a capacity.
    """
    if ep <= 1 or moe_layers == 0:
        return 0.0, 0
    exchanges = 6 if checkpointing != "none" else 4
    counts = 2 if checkpointing != "none" else 1
    buffer = tokens * top_k * d_model * elem_bytes
    volume = microbatches * moe_layers * exchanges * buffer * (ep - 1) / ep
    return volume, microbatches * moe_layers * (exchanges + counts)


def cp_traffic(
    *,
    cp: int,
    microbatches: int,
    layers: int,
    tokens: int,
    kv_width: int,
    elem_bytes: int,
    checkpointing: str,
) -> tuple[float, int]:
    """(bytes sent, exchanges) per step of context parallelism's ring on one rank
    (``etrain.workers.families.ring_attention``), ``tokens`` being a micro-batch's whole sequences
    (``micro_batch · seq_len``) and ``kv_width`` the key (= value) width a rank holds, ``n_kv_heads · head_dim
    / tp``.

    A rank's K/V block is ``tokens / cp · 2 · kv_width`` elements. Per layer and micro-batch the forward sends
    it ``cp − 1`` times (K and V of ``(cp − 1)/cp`` of the sequence, ``elem_bytes`` each, the activations'
    dtype); the backward sends the blocks round again (``cp − 1`` times) and their fp32 gradients ``cp``
    times (the last step hands them home); activation checkpointing (full or selective) replays the
    forward in the backward. Each step is one ``batch_isend_irecv`` (counted as one exchange)."""
    if cp <= 1 or layers == 0:
        return 0.0, 0
    block = tokens / cp * 2 * kv_width
    forwards = 2 if checkpointing != "none" else 1
    per_layer = forwards * (cp - 1) * block * elem_bytes + (cp - 1) * block * elem_bytes + cp * block * 4
    exchanges = forwards * (cp - 1) + (cp - 1) + cp
    return microbatches * layers * per_layer, microbatches * layers * exchanges


def pp_traffic(
    *, pp: int, virtual_stages: int, microbatches: int, hidden_bytes: float, sp_div: int
) -> tuple[float, int]:
    """(bytes sent, sends) per step by the busiest stage: each micro-batch's activations cross every
    chunk boundary forward, its gradients backward. ``sp_div`` is tp under sequence parallelism
    (the hidden states cross sharded), else 1."""
    v = virtual_stages
    # Stage i sends v chunks forward (one fewer on the last stage) and v backward (one fewer on the
    # first): the busiest is a middle stage (2v) when pp > 2; with pp == 2 both send 2v - 1.
    sends = 0 if pp <= 1 else (2 * v if pp > 2 else 2 * v - 1)
    return microbatches * sends * hidden_bytes / sp_div, microbatches * sends


def step_flops(model: ModelConfig, *, global_batch: int, checkpointing: str) -> tuple[float, float]:
    """(FLOPs per step, the same with activation recompute): the family's FLOPs per token
    (``ModelFamily.flops_per_token``: 6 per matmul weight, the output head included, plus attention's
    12·L·(n_heads·head_dim)·s) times the step's tokens; full checkpointing runs each block's forward
    again, selective only its element-wise ops (no matmul FLOPs)."""
    s = model.seq_len
    tokens = global_batch * s
    found = family(model.arch)  # the one FLOPs formula (MFU uses it too), and attention's width
    flops = found.flops_per_token(model) * tokens
    attention = model.n_layers * found.attention_width(model) * s
    # Full checkpointing runs each block's forward again: 2 per block weight, 4 for attention (not the head).
    block_weights = model.n_layers * found.active_matmul_params_per_layer(model)  # a token's (MoE: active experts)
    recompute = checkpointing == "full"
    flops_recompute = flops + (2 * block_weights + 4 * attention) * tokens if recompute else flops
    return flops, flops_recompute


def step_time(
    hw: Hardware,
    *,
    dp: int,
    tp: int,
    pp: int,
    comm: CommVolume,
    flops: float,
    bubble: float,
    ep: int = 1,
    cp: int = 1,
) -> StepTime:
    """Seconds per step under the :class:`StepTime` cost model, links chosen by :meth:`Hardware.link` (an ep
    group is ``ep`` consecutive dp ranks: it spans ``tp · ep`` ranks; a cp group spans ``tp · cp`` ranks, and
    the dp·cp gradient group ``tp · cp · dp``)."""

    def seconds(nbytes: float, ops: int, span: int) -> float:  # Megatron order: tp, then dp, then pp
        bandwidth, latency = hw.link(span)
        return nbytes / bandwidth + ops * latency

    world = layout_rules.world_size(pp=pp, dp=dp, tp=tp, cp=cp)
    compute = flops / world / hw.flops_per_s
    tp_s = seconds(comm.tp, comm.tp_ops, tp)
    pp_s = seconds(comm.pp, comm.pp_ops, world)
    dp_s = seconds(comm.dp, comm.dp_ops, tp * cp * dp)
    ep_s = seconds(comm.ep, comm.ep_ops, tp * ep) if comm.ep_ops else 0.0
    cp_s = seconds(comm.cp, comm.cp_ops, tp * cp) if comm.cp_ops else 0.0
    busy = compute + tp_s + pp_s + ep_s + cp_s
    return StepTime(
        compute_s=compute,
        tp_comm_s=tp_s,
        pp_comm_s=pp_s,
        dp_comm_s=dp_s,
        bubble_s=busy / (1 - bubble) - busy,
        ep_comm_s=ep_s,
        cp_comm_s=cp_s,
    )

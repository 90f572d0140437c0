"""The planner's formulas: memory per rank, pipeline bubble, communication and FLOPs of a layout.

Each one comes from the project's seed documents (named below by file) or the paper they cite,
adapted where this codebase differs, and is tested on its own in tests/unit/test_planner.py:

* ZeRO memory per parameter and the collectives of each stage (``bytes_per_param``): the ZeRO
  table of ``distributed-training-mathematics`` (Rajbhandari et al. 2020).
* Pipeline bubble ``(P - 1)/(M + P - 1)`` (``bubble_fraction``): GPipe (Huang et al. 2019), derived
  in ``distributed-training-mathematics`` and ``data-model-pipeline-parallelism``; the interleaved
  schedule's ``1/v`` from Megatron-LM (Narayanan et al. 2021).
* Activations per layer (``korthikanti_activation_bytes``): Korthikanti et al. 2022, cited in
  ``transformer-math-distributed-training``; ``layer_activation_bytes`` adapts it to our GPT block
  and ``llama_layer_activation_bytes`` derives the same count for the Llama block (SwiGLU, GQA,
  RMSNorm, RoPE), both checked byte for byte against what autograd saves.
* FLOPs per step (``_step_flops``): 6 per matmul parameter per token (forward 2, backward 4) plus
  attention's ``12·L·(heads·head_dim)·s``.

service/planning/planner.py applies them to a spec, checks the rules and chooses layouts.

What a rank holds (``stage_memory``), as the engine runs (``workers/parallelize.py``,
``workers/train.py``, ``workers/optim.py``, ``workers/init.py``); every byte count is per rank:

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
* Tensor parallelism as measured: the token embedding's gradient arrives replicated (full
  vocabulary) on every tp rank, though its weight is a vocab shard (``gradients`` counts it).
* CPU offload (``offload: cpu``, FSDP2's ``CPUOffloadPolicy``): sharded parameters, gradients and
  optimizer states live in host memory (``host_bytes``); the device keeps the gathered parameters,
  unsharded gradients, activations and logits.
* Initialisation builds on the meta device and materialises the rank's shards; each parameter's
  full fp32 initial value is drawn once on the host and, on a GPU, copied to the device before the
  rank copies out its slice: shards plus the largest single parameter (and its slice, when
  sharded) (``init`` phase).
* The optimizer step: on CPU parameters (CPU runs, and offload) AdamW's ``foreach`` kernels hold a
  temporary the size of the second moments (4 bytes per parameter the rank steps); fused AdamW on
  CUDA holds none.
* The peak is the largest of three phases (``MemoryBreakdown.phases``): ``init``,
  ``forward_backward`` (states + buffers + activations + logits of the micro-batches in flight) and
  ``optimizer_step`` (states + the optimizer's temporaries). ``overhead`` is the runtime itself
  (CUDA context and communicator buffers; on CPU the Python + torch process, measured by
  ``make bench`` as an empty rank's RSS). Memory is in bytes and GiB; ``device_memory_gb`` is GiB.

What a rank's layers hold under TP (Megatron/torchtitan sharding): column-parallel ``wq/wk/wv/w1``
(and SwiGLU's ``w3``) shard weight and bias by ``tp``; row-parallel ``wo/w2`` shard the weight but
keep any bias whole; norms are replicated; the token embedding and the output head are
vocab-parallel (sharded by ``tp``; a tied Llama shares one vocab shard); the GPT's learned
position embedding is replicated. A pipeline stage holds ``n_layers / (pp * virtual_stages)``
layers per chunk; stage 0 also holds the embeddings and the last stage the final norm and head.
The estimate reports the WORST stage.

Activations (``layer_activation_bytes``, ``in_flight_microbatches``): per-layer counts times the
layers of a stage, times the micro-batches the schedule keeps in flight on that stage; activation
checkpointing keeps only each block's input plus one block being recomputed. The last stage adds
the logits (``logits_bytes``): without TP the fp32 log-softmax kept for the backward plus the
loss backward's two full-vocabulary gradients; with TP the output layer keeps its logits
vocab-sharded and the loss runs under ``loss_parallel``, so the same buffers hold ``vocab / tp``
columns, plus one more for the sharded softmax.

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
from typing import Literal

from etrain.workers.protocol.run_config import ModelConfig

__all__ = [
    "DDP_BUCKET_BYTES",
    "GiB",
    "MEMORY_COMPONENTS",
    "PHASES",
    "CommVolume",
    "Hardware",
    "MemoryBreakdown",
    "Regime",
    "StepTime",
    "bubble_fraction",
    "bytes_per_param",
    "compute_regime",
    "hardware_for",
    "in_flight_microbatches",
    "korthikanti_activation_bytes",
    "largest_param",
    "layer_activation_bytes",
    "layer_params",
    "llama_layer_activation_bytes",
    "logits_bytes",
    "precision_bytes",
    "rope_table_bytes",
    "stage_memory",
    "stage_params",
]

GiB = 1024**3
DDP_BUCKET_BYTES = 25 * 1024**2
MEMORY_COMPONENTS = ("parameters", "gradients", "optimizer_states", "activations", "logits", "buffers",
                     "transient", "overhead")
PHASES = ("init", "forward_backward", "optimizer_step")
#: How a block computes: ``fp32``; ``autocast`` (fp32 weights, bf16 matmuls: DDP, ZeRO-1, TP, PP);
#: ``bf16_params`` (FSDP2's MixedPrecisionPolicy: bf16 gathered weights and activations).
Regime = Literal["fp32", "autocast", "bf16_params"]


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
    """(parameter, gradient, optimizer-state) bytes per parameter that this engine keeps resident.

    Both precisions keep fp32 master weights, fp32 gradients and AdamW's two fp32 moments: bf16
    training computes with bf16 *copies* (FSDP2's MixedPrecisionPolicy or autocast), counted as
    buffers by :func:`stage_memory`, not instead of the fp32 state.
    """
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision must be 'fp32' or 'bf16', got {precision!r}")
    return 4, 4, 8


def compute_regime(precision: str, *, fsdp: bool) -> Regime:
    """How blocks compute: fp32; bf16 under FSDP2's MixedPrecisionPolicy; else bf16 autocast."""
    if precision == "fp32":
        return "fp32"
    return "bf16_params" if fsdp else "autocast"


def _llama_widths(model: ModelConfig) -> tuple[int, int]:
    """(query width, key/value width): ``n_heads·head_dim`` and ``n_kv_heads·head_dim``."""
    return model.n_heads * model.head_dim, model.kv_heads * model.head_dim


def layer_params(model: ModelConfig, tp: int = 1) -> float:
    """Parameters of one transformer block held by one tensor-parallel rank.

    GPT: sharded by tp are q/k/v/out and MLP weights, q/k/v and up-projection biases; replicated
    are both LayerNorms (2 x 2d) and the biases of the row-parallel ``wo`` and ``w2`` (d each).
    Llama: sharded are ``wq`` (d x n_heads·head_dim), ``wk``/``wv`` (d x n_kv_heads·head_dim each:
    grouped-query attention), ``wo`` and SwiGLU's three d x ffn matrices, plus the q/k/v biases
    (Qwen2, ``attention_bias``); replicated are the two RMSNorm weights (no bias), Qwen3's per-head
    q/k norm weights (head_dim each) and ``wo``'s bias when ``attention_bias == "all"``.
    """
    d, f = model.d_model, model.ffn_dim
    if model.arch == "llama":
        q, kv = _llama_widths(model)
        sharded = d * q + 2 * d * kv + q * d + 3 * d * f
        if model.attention_bias != "none":
            sharded += q + 2 * kv
        replicated = 2 * d + (2 * model.head_dim if model.qk_norm else 0)
        replicated += d if model.attention_bias == "all" else 0
        return sharded / tp + replicated
    sharded = 4 * d * d + 3 * d + 2 * d * f + f
    replicated = 2 * d + 2 * d + d + d
    return sharded / tp + replicated


def _embedding_params(model: ModelConfig, tp: int) -> float:
    """The token embedding (vocab-parallel) and, for the GPT, the replicated position embedding."""
    positions = 0 if model.arch == "llama" else model.seq_len * model.d_model
    return model.vocab_size * model.d_model / tp + positions


def _head_params(model: ModelConfig, tp: int, *, with_embedding: bool = False) -> float:
    """The final norm (replicated; a LayerNorm has a bias, an RMSNorm none) and the output head
    (vocab-parallel). A tied head on the embedding's stage is the embedding's weight: not counted again."""
    norm = model.d_model if model.arch == "llama" else 2 * model.d_model
    tied = model.arch == "llama" and model.tie_embeddings and with_embedding
    return norm + (0 if tied else model.vocab_size * model.d_model / tp)


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

    Initialisation draws each parameter's full value (``workers/init.py``) before a rank keeps its
    slice, so this is the transient on top of the rank's shards while it materialises."""
    d, f = model.d_model, model.ffn_dim
    if model.arch == "llama":
        q, kv = _llama_widths(model)
        candidates = [d * q, d * kv, d * f]
    else:
        candidates = [d * d, d * f, model.seq_len * d if first else 0]
    if first or last:
        candidates.append(model.vocab_size * d)
    return max(candidates)


def _matmul_params(model: ModelConfig, *, tp: int, layers: int, last: bool) -> float:
    """Weights a stage multiplies by (autocast keeps a bf16 cast of each until the backward): every
    projection weight of its layers and the output head's; not biases (``addmm`` keeps no cast of
    them), norms or the embedding lookup."""
    d, f = model.d_model, model.ffn_dim
    if model.arch == "llama":
        q, kv = _llama_widths(model)
        per_layer = (2 * d * q + 2 * d * kv + 3 * d * f) / tp
    else:
        per_layer = (4 * d * d + 2 * d * f) / tp
    head = model.vocab_size * d / tp if last else 0.0
    return layers * per_layer + head


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
                           checkpointing: bool = False, regime: Regime | None = None) -> float:
    """Activations one block of OUR model saves for backward, per micro-batch.

    Llama blocks: :func:`llama_layer_activation_bytes` (``regime`` defaults to autocast for bf16).
    GPT blocks: Korthikanti's count adapted to ``workers/model.py`` (and checked against the tensors
    autograd saves): no dropout, so no masks, and fused ``scaled_dot_product_attention``, so no
    s x s scores, only an fp32 log-sum-exp per head and position. Per token it saves, in elements:
    replicated 4d (both LayerNorm inputs and outputs) plus the LayerNorms' fp32 mean and rstd;
    TP-sharded 4d + 2f (q, k, v, the attention output that ``wo`` reads, the GELU input and
    output). At f = 4d and 2 bytes that is Korthikanti's 34 sbh less the 2 sbh of dropout masks:
    sbh (8 + 24/t). Element size is 2 bytes (bf16) or 4 (fp32). Sequence parallelism shards the
    replicated part too (Megatron's layout). With activation checkpointing only the block input
    (s·b·d) is saved.
    """
    if model.arch == "llama":
        return llama_layer_activation_bytes(model, micro_batch=micro_batch, tp=tp,
                                            sequence_parallel=sequence_parallel, checkpointing=checkpointing,
                                            regime=regime or compute_regime(precision, fsdp=False))
    elem = 2 if precision == "bf16" else 4
    s, b, d, f = model.seq_len, micro_batch, model.d_model, model.ffn_dim
    sp_div = tp if sequence_parallel else 1
    if checkpointing:
        return s * b * d * elem / sp_div
    replicated = (4 * d * elem + 2 * 2 * 4) * s * b / sp_div  # + two LayerNorms' fp32 mean and rstd
    sharded = s * b * (4 * d + 2 * f) * elem / tp
    log_sum_exp = 4 * model.n_heads * s * b / tp
    return replicated + sharded + log_sum_exp


def llama_layer_activation_bytes(model: ModelConfig, *, micro_batch: int, tp: int = 1,
                                 sequence_parallel: bool = False, regime: Regime = "fp32",
                                 checkpointing: bool = False) -> float:
    """What one Llama block (``workers/llama.py``) saves for backward, per micro-batch, in bytes.

    Korthikanti-style count for RMSNorm + RoPE + grouped-query attention + SwiGLU, derived from the
    ops and checked against the tensors autograd saves (tests/unit/test_planner.py). Per token,
    with q = n_heads·head_dim, kv = n_kv_heads·head_dim, f = ffn_dim, H = n_heads:

    * Each RMSNorm (computed in fp32) saves its fp32 input (a ``.float()`` copy when the residual
      stream is bf16), ``rsqrt`` (1 fp32), and ``x·rsqrt`` (fp32 when that is the residual dtype,
      else its cast back to bf16); its output is saved by the projections that read it: once in
      fp32/bf16_params, but under autocast as one bf16 cast per consumer (wq, wk, wv; w1, w3).
      Sequence parallelism shards the norm's own tensors; the projections save the gathered output.
    * Attention saves q (after RoPE), k and v *repeated to n_heads* (``repeat_interleave`` before
      the fused kernel: grouped-query attention saves no activation memory here), the output
      (which ``wo`` reads as a view) and an fp32 log-sum-exp per head: 4q + H. RoPE's multiplies
      save only the cos/sin tables; the bf16 regimes cast them per call (4·s·head_dim, not per token).
    * SwiGLU saves the gate (silu's input), silu's output, the up projection and their product
      (``w2``'s input): 4f.
    * Qwen3's q/k norms save their input, ``rsqrt`` and normalised values: 2(q + kv) + H + n_kv_heads
      elements in fp32, ``6(q + kv)`` bytes + 4(H + n_kv_heads) in the bf16 regimes.

    Per token in bytes: fp32 ``2(3·4d + 4) + 4·4q + 4H + 4·4f``; autocast ``2(2·4d + 4) + 5·2d +
    4·2q + 4H + 4·2f``; bf16_params ``2(4d + 2d + 4) + 2·2d + 4·2q + 4H + 4·2f``. Everything but the
    norms is divided by ``tp`` (heads and the MLP width are sharded). With activation
    checkpointing only the block input is saved (residual dtype: fp32 unless bf16_params).
    The per-layer RoPE table cache is module state (:func:`rope_table_bytes`), not counted here.
    """
    s, b, d, f = model.seq_len, micro_batch, model.d_model, model.ffn_dim
    q, kv = _llama_widths(model)
    heads, kv_heads = model.n_heads, model.kv_heads
    sp_div = tp if sequence_parallel else 1
    tokens = s * b
    if checkpointing:
        return tokens * d * (2 if regime == "bf16_params" else 4) / sp_div
    if regime == "fp32":
        norms, norm_outputs, elem, qk_per_elem = 2 * (8 * d + 4), 2 * 4 * d, 4, 8
    elif regime == "autocast":
        norms, norm_outputs, elem, qk_per_elem = 2 * (8 * d + 4), 5 * 2 * d, 2, 6
    elif regime == "bf16_params":
        norms, norm_outputs, elem, qk_per_elem = 2 * (6 * d + 4), 2 * 2 * d, 2, 6
    else:
        raise ValueError(f"regime must be fp32, autocast or bf16_params, got {regime!r}")
    attention = 4 * q * elem + 4 * heads
    mlp = 4 * f * elem
    qk_norms = qk_per_elem * (q + kv) + 4 * (heads + kv_heads) if model.qk_norm else 0
    per_token = norms / sp_div + norm_outputs + (attention + mlp + qk_norms) / tp
    # RoPE's cos/sin cast to bf16 for q and for k on every call (not when q/k are fp32 after the
    # q/k norms under autocast, nor in fp32, where the cached fp32 tables themselves are used).
    casts_rope = regime == "bf16_params" or (regime == "autocast" and not model.qk_norm)
    rope = 4 * s * model.head_dim * 2 if casts_rope else 0
    return tokens * per_token + rope


def rope_table_bytes(model: ModelConfig) -> int:
    """The fp32 cos and sin tables each Llama attention module caches (``seq_len x head_dim`` each)."""
    return 2 * model.seq_len * model.head_dim * 4 if model.arch == "llama" else 0


def logits_bytes(model: ModelConfig, *, micro_batch: int, tp: int = 1, held: int = 1,
                 logits_elem: int = 4, pipeline: bool = False) -> float:
    """Peak bytes of the logits and the loss on the last stage, ``L = micro_batch·seq·vocab/tp`` each.

    Without TP (``F.cross_entropy`` on full logits): the fp32 log-softmax is saved for every
    micro-batch in flight (``held``), and the loss backward holds two more full fp32 buffers (the
    gradient into log-softmax and out of it): ``4L·held + 8L``. The forward's transient (the logits,
    an fp32 copy under bf16, and the log-softmax) is no larger. With TP the output layer keeps its
    logits vocab-sharded and the loss runs under ``loss_parallel`` (``torch.distributed.tensor.
    parallel.loss``), whose backward builds the softmax from the saved shard: ``4L·held + 12L``
    (the one-hot gradient, ``exp`` of the log-softmax and their sum). A pipeline stage also keeps
    each in-flight micro-batch's output, the logits (``logits_elem`` bytes, 2 under bf16).
    """
    shard = micro_batch * model.seq_len * model.vocab_size / tp
    kept = 4 + (logits_elem if pipeline else 0)
    return shard * (kept * held + (12 if tp > 1 else 8))


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
            "gib": {**{k: _gib(v) for k, v in parts.items()}, "total": _gib(self.total)},
            "phases_gib": {k: _gib(v) for k, v in self.phases.items()},
            "host_gib": _gib(self.host_bytes),
            "buffers_gib": {k: _gib(v) for k, v in self.buffer_parts.items()},
            "biggest": self.biggest,
        }


def _final_norm_bytes(model: ModelConfig, *, tokens: int, regime: Regime, sp_div: int) -> float:
    """What the final norm saves per micro-batch (its tensors, and its output saved by the head)."""
    d = model.d_model
    if model.arch != "llama":
        return 2 * tokens * d * (4 if regime == "fp32" else 2) / sp_div
    own = {"fp32": 8 * d + 4, "autocast": 8 * d + 4, "bf16_params": 6 * d + 4}[regime]
    output = 4 * d if regime == "fp32" else 2 * d
    return tokens * (own / sp_div + output)


def stage_memory(model: ModelConfig, *, stage: int, pp: int, layers: int, virtual_stages: int, held: int,
                 dp: int, tp: int, zero: int, micro_batch: int, microbatches: int, precision: str,
                 checkpointing: bool, device: str, overhead: float, dp_replicate: int = 1,
                 offload: str = "none", sequence_parallel: bool = False) -> MemoryBreakdown:
    """Peak bytes of one rank of pipeline stage ``stage`` (see the module docstring for the model).

    ``layers`` are the stage's layers (all its chunks), ``held`` the layer chunks x micro-batches
    whose activations it holds at its peak (:func:`_layer_chunks_in_flight`).
    """
    first, last = stage == 0, stage == pp - 1
    v = virtual_stages if pp > 1 else 1
    fsdp = zero in (2, 3) and dp > 1
    shard = dp // dp_replicate if fsdp else 1
    regime = compute_regime(precision, fsdp=fsdp)
    offloaded = fsdp and offload == "cpu" and device != "cpu"  # on a CPU run host memory is the device's
    s, b, d = model.seq_len, micro_batch, model.d_model
    sp_div = tp if sequence_parallel else 1

    params = stage_params(model, tp=tp, layers=layers, first=first, last=last)
    state_div = shard if fsdp else (dp if zero >= 1 and dp > 1 else 1)
    parameters, gradients, states = 4 * params / shard, 4 * params / shard, 8 * params / state_div
    if tp > 1 and first and not fsdp:
        # Measured (make bench): under TP the token embedding's gradient arrives *replicated* on every tp
        # rank, full vocabulary x d_model, although the weight is a vocab shard (DTensor's embedding
        # backward under RowwiseParallel returns a Replicate gradient for the Shard(0) weight).
        gradients += 4 * model.vocab_size * d * (1 - 1 / tp)

    layer = layer_params(model, tp) if layers else 0.0
    root = (_embedding_params(model, tp) if first else 0.0) + (
        _head_params(model, tp, with_embedding=first) if last else 0.0)
    buckets = 4 * params if dp > 1 and not fsdp and tp == 1 else 0.0  # DDP: gradient_as_bucket_view off
    gathered = unsharded_grads = 0.0
    if fsdp:
        gathered_elem = 2 if regime == "bf16_params" else 4
        if zero == 2 or pp > 1:
            gathered = params * gathered_elem
        else:  # the root stays gathered from forward to backward; one block computing, one prefetched
            gathered = (root + 2 * layer) * gathered_elem
        # No gradient sync while accumulating: the stage's gradients stay unsharded (fp32) until the
        # last micro-step; with one micro-batch only the unit being reduced and its reduce-scatter input.
        unsharded_grads = 4 * params if microbatches > 1 else 2 * 4 * max(layer, root)
    elif dp > 1 and tp > 1:  # FSDP-based replicate(): all-reduces one unit's gradients at a time
        unsharded_grads = 4 * max(layer, root)
    casts = 2 * _matmul_params(model, tp=tp, layers=layers, last=last) if regime == "autocast" else 0.0
    rope = layers * rope_table_bytes(model)

    per_layer = layer_activation_bytes(model, micro_batch=b, tp=tp, sequence_parallel=sequence_parallel,
                                       precision=precision, checkpointing=checkpointing, regime=regime)
    activations = held * (layers // v) * per_layer
    if checkpointing:  # one block's activations live while it is recomputed
        activations += layer_activation_bytes(model, micro_batch=b, tp=tp, sequence_parallel=sequence_parallel,
                                              precision=precision, regime=regime)
    hidden = s * b * d * (2 if regime == "bf16_params" else 4) / sp_div
    if pp > 1 and not last:  # the schedule keeps each in-flight chunk's output for its backward
        activations += held * hidden
    logits = 0.0
    if last:
        held_last = math.ceil(held / v)
        activations += held_last * _final_norm_bytes(model, tokens=s * b, regime=regime, sp_div=sp_div)
        logits = logits_bytes(model, micro_batch=b, tp=tp, held=held_last,
                              logits_elem=4 if regime == "fp32" else 2, pipeline=pp > 1)

    optimizer_temp = 4 * params / state_div if device == "cpu" or offloaded else 0.0  # foreach AdamW on CPU
    # Each parameter's full fp32 value, plus the rank's slice that distribute_tensor cuts from it as a
    # copy when the parameter is sharded (FSDP2 and/or TP DTensors; a plain parameter is copied into).
    pieces = shard * tp
    host_draw = 4 * largest_param(model, first=first, last=last)
    init_draw = host_draw * (1 + (1 / pieces if pieces > 1 else 0))
    on_device = 0.0 if offloaded else 1.0
    host = parameters + gradients + states
    host_bytes = max(host + optimizer_temp, parameters + init_draw) if offloaded else (
        host_draw if device != "cpu" else 0.0)

    fb_buffers = dict(ddp_buckets=buckets, gathered_params=gathered, unsharded_grads=unsharded_grads,
                      weight_casts=casts, rope_tables=rope)
    fb = dict(parameters=parameters * on_device, gradients=gradients * on_device,
              optimizer_states=states * on_device, activations=activations, logits=logits,
              buffers=sum(fb_buffers.values()), transient=0.0)
    opt = dict(parameters=parameters * on_device, gradients=gradients * on_device,
               optimizer_states=states * on_device, activations=0.0, logits=0.0, buffers=buckets + rope,
               transient=0.0 if offloaded else optimizer_temp)
    init_buffers = buckets if buckets >= init_draw else 0.0
    buffer_parts = {"forward_backward": fb_buffers, "optimizer_step": dict(ddp_buckets=buckets, rope_tables=rope),
                    "init": dict(ddp_buckets=init_buffers)}
    init = dict(parameters=parameters * on_device, gradients=0.0, optimizer_states=0.0, activations=0.0,
                logits=0.0, buffers=init_buffers, transient=0.0 if offloaded or init_buffers else init_draw)
    phases = {"init": init, "forward_backward": fb, "optimizer_step": opt}
    rounded = {name: {k: math.ceil(value) for k, value in parts.items()} for name, parts in phases.items()}
    totals = {name: sum(parts.values()) + math.ceil(overhead) for name, parts in rounded.items()}
    peak = max(("forward_backward", "optimizer_step", "init"), key=lambda name: totals[name])
    return MemoryBreakdown(stage=stage, phase=peak, overhead=math.ceil(overhead), phases=totals,
                           host_bytes=math.ceil(host_bytes),
                           buffer_parts={k: math.ceil(v) for k, v in buffer_parts[peak].items() if v},
                           **rounded[peak])


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
# Communication and FLOPs per step
# ---------------------------------------------------------------------------------------------


def _dp_traffic(*, zero: int, dp: int, pp: int, microbatches: int, params: float, param_bytes: int,
                grad_bytes: int, units: int, tensors: int, dp_replicate: int = 1) -> tuple[float, int]:
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


def _tp_traffic(*, tp: int, microbatches: int, layers: int, first: bool, last: bool, checkpointing: bool,
                hidden_bytes: float, tokens: int) -> tuple[float, int]:
    """(bytes sent, collectives) per step on the tp axis of one stage, ring algorithms.

    Per layer per micro-batch 2 all-reduces forward + 2 backward of b·s·d (same volume as
    all-gather + reduce-scatter under sequence parallelism; +2 forward when recomputed); the
    vocab-parallel embedding (forward) and head (backward) one each. The logits stay vocab-sharded:
    ``loss_parallel`` all-reduces three fp32 values per token (max, sum of exponentials, the target's
    logit) instead of gathering them.
    """
    if tp <= 1:
        return 0.0, 0
    m = microbatches
    ar_per_layer = 6 if checkpointing else 4  # 2 fwd + 2 bwd all-reduces, +2 fwd in recompute
    edge_ops = int(first) + int(last)
    ops = m * (layers * ar_per_layer + edge_ops + 3 * int(last))
    volume = m * ((layers * ar_per_layer + edge_ops) * _ring_all_reduce(tp, hidden_bytes)
                  + int(last) * 3 * _ring_all_reduce(tp, 4 * tokens))
    return volume, ops


def _pp_traffic(*, pp: int, virtual_stages: int, microbatches: int, hidden_bytes: float,
                sp_div: int) -> tuple[float, int]:
    """(bytes sent, sends) per step by the busiest stage: each micro-batch's activations cross every
    chunk boundary forward, its gradients backward. ``sp_div`` is tp under sequence parallelism
    (the hidden states cross sharded), else 1."""
    v = virtual_stages
    # Stage i sends v chunks forward (one fewer on the last stage) and v backward (one fewer on the
    # first): the busiest is a middle stage (2v) when pp > 2; with pp == 2 both send 2v - 1.
    sends = 0 if pp <= 1 else (2 * v if pp > 2 else 2 * v - 1)
    return microbatches * sends * hidden_bytes / sp_div, microbatches * sends


def _step_flops(model: ModelConfig, *, global_batch: int, checkpointing: bool) -> tuple[float, float]:
    """(FLOPs per step, the same with activation recompute): 6 per matmul parameter per token
    (forward 2, backward 4) plus attention's 12·L·(n_heads·head_dim)·s per token; recompute runs
    the forward again. Embedding lookups are not matmuls, but a tied output head multiplies by the
    embedding's weight, so a tied model's matmul parameters include it."""
    s, d = model.seq_len, model.d_model
    tokens = global_batch * s
    if model.arch == "llama":
        lookups = 0 if model.tie_embeddings else model.vocab_size * d
        width = model.n_heads * model.head_dim
    else:
        lookups, width = (model.vocab_size + s) * d, d
    matmul_params = model.num_params - lookups
    attention = model.n_layers * width * s
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

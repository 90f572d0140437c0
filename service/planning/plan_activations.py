"""Activations a rank keeps for the backward: per layer, per schedule, and the logits.

Each formula is tested on its own in tests/unit/test_planner.py, the per-layer counts byte for byte
against the tensors autograd saves:

* Activations per layer (``korthikanti_activation_bytes``): Korthikanti et al. 2022, cited in
  ``transformer-math-distributed-training``; ``layer_activation_bytes`` adapts it to our GPT block
  and ``llama_layer_activation_bytes`` derives the same count for the Llama block (SwiGLU, GQA,
  RMSNorm, RoPE).
* How many micro-batches a pipeline stage holds (``in_flight_microbatches``): each schedule's
  warm-up as torch runs it (interleaved 1F1B in torch's rounds, ``etrain.workers.layout_rules``).

Activations (``layer_activation_bytes``, ``in_flight_microbatches``): per-layer counts times the
layers of a stage, times the micro-batches the schedule keeps in flight on that stage; activation
checkpointing keeps only each block's input plus one block being recomputed. The last stage adds
the logits (``logits_bytes``): without TP the fp32 log-softmax kept for the backward plus the
loss backward's two full-vocabulary gradients; with TP the output layer keeps its logits
vocab-sharded and the loss runs under ``loss_parallel``, so the same buffers hold ``vocab / tp``
columns, plus one more for the sharded softmax.

``service/planning/plan_memory.py`` adds them to a rank's memory.
"""

from __future__ import annotations

from typing import Literal

from etrain.workers import layout_rules
from etrain.workers.protocol.run_config import ModelConfig

__all__ = [
    "Regime",
    "compute_regime",
    "final_norm_bytes",
    "in_flight_microbatches",
    "korthikanti_activation_bytes",
    "layer_activation_bytes",
    "layer_chunks_in_flight",
    "llama_layer_activation_bytes",
    "llama_widths",
    "logits_bytes",
    "rope_table_bytes",
]

#: How a block computes: ``fp32``; ``autocast`` (fp32 weights, bf16 matmuls: DDP, ZeRO-1, TP, PP);
#: ``bf16_params`` (FSDP2's MixedPrecisionPolicy: bf16 gathered weights and activations).
Regime = Literal["fp32", "autocast", "bf16_params"]


def compute_regime(precision: str, *, fsdp: bool) -> Regime:
    """How blocks compute: fp32; bf16 under FSDP2's MixedPrecisionPolicy; else bf16 autocast."""
    if precision == "fp32":
        return "fp32"
    return "bf16_params" if fsdp else "autocast"


def llama_widths(model: ModelConfig) -> tuple[int, int]:
    """(query width, key/value width): ``n_heads·head_dim`` and ``n_kv_heads·head_dim``."""
    return model.n_heads * model.head_dim, model.kv_heads * model.head_dim


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
    q, kv = llama_widths(model)
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


def final_norm_bytes(model: ModelConfig, *, tokens: int, regime: Regime, sp_div: int) -> float:
    """What the final norm saves per micro-batch (its tensors, and its output saved by the head)."""
    d = model.d_model
    if model.arch != "llama":
        return 2 * tokens * d * (4 if regime == "fp32" else 2) / sp_div
    own = {"fp32": 8 * d + 4, "autocast": 8 * d + 4, "bf16_params": 6 * d + 4}[regime]
    output = 4 * d if regime == "fp32" else 2 * d
    return tokens * (own / sp_div + output)


def layer_chunks_in_flight(schedule: str, *, pp: int, microbatches: int, virtual_stages: int,
                            stage: int) -> int:
    """Model chunks x micro-batches whose activations ``stage`` holds at its peak."""
    m, v = microbatches, virtual_stages
    if pp <= 1:
        return 1
    if schedule == "gpipe":
        return m * v
    if schedule == "interleaved_1f1b":  # torch's warm-up: (v - 1) rounds of R, two per hop, then one more
        _, per_round = layout_rules.interleaved_rounds(pp, m)
        return min(m * v, 2 * (pp - stage - 1) + (v - 1) * per_round + 1)
    return min(pp - stage, m) * v


def in_flight_microbatches(schedule: str, *, pp: int, microbatches: int, virtual_stages: int = 1,
                           stage: int = 0) -> float:
    """Micro-batches of a full stage's layers whose activations a stage holds at its peak.

    Assumptions: ``pp == 1`` runs plain gradient accumulation (1). GPipe runs every forward before
    any backward (M). 1F1B warms up ``pp - stage`` forwards, so stage 0 holds ``min(P, M)``.
    Interleaved 1F1B (Megatron/torch) warms up ``2(P - stage - 1) + (v - 1)R + 1`` chunk forwards of
    ``1/v`` of the stage's layers each, where ``R`` is torch's micro-batches per round (``P`` when
    ``M`` is a multiple of ``P``; :func:`etrain.workers.layout_rules.interleaved_rounds`): then
    ``P + (P - 1)/v`` micro-batches' worth on stage 0. Never more than all ``M·v`` chunks.
    """
    chunks = layer_chunks_in_flight(schedule, pp=pp, microbatches=microbatches,
                                     virtual_stages=virtual_stages, stage=stage)
    return chunks / (virtual_stages if pp > 1 else 1)

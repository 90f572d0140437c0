"""Activations a rank keeps for the backward: per layer, per schedule, and the logits.

Each formula is tested on its own in tests/unit/test_planner.py, the per-layer counts byte for byte
against the tensors autograd saves:

* Activations per layer (``korthikanti_activation_bytes``): Korthikanti et al. 2022, cited in
  ``transformer-math-distributed-training``; ``layer_activation_bytes`` asks the model's family
  (``etrain.workers.families``), whose count adapts it to its block (the GPT's; the Llama block's
  SwiGLU, GQA, RMSNorm and RoPE; ...), each checked against the tensors autograd saves.
* How many micro-batches a pipeline stage holds (``in_flight_microbatches``): each schedule's
  warm-up as torch runs it (interleaved 1F1B in torch's rounds, ``etrain.workers.protocol.layout_rules``).

Activations (``layer_activation_bytes``, ``in_flight_microbatches``): per-layer counts times the
layers of a stage, times the micro-batches the schedule keeps in flight on that stage; activation
checkpointing keeps only each block's input plus one block being recomputed. The last stage adds
the logits (``logits_bytes``): without TP the fp32 log-softmax kept for the backward plus the
loss backward's two full-vocabulary gradients; with TP the output layer keeps its logits
vocab-sharded and the loss runs under ``loss_parallel``, so the same buffers hold ``vocab / tp``
columns, plus one more for the sharded softmax; compiled (without TP), the logits themselves and
their gradient, in their own dtype.

``service/planning/plan_memory.py`` adds them to a rank's memory.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from etrain.workers.families import family
from etrain.workers.protocol import layout_rules
from etrain.workers.protocol.run_config import ModelConfig

__all__ = [
    "Regime",
    "compute_regime",
    "final_norm_bytes",
    "in_flight_microbatches",
    "korthikanti_activation_bytes",
    "layer_activation_bytes",
    "layer_chunks_in_flight",
    "logits_bytes",
    "ring_transient_bytes",
    "rope_table_bytes",
    "selective_activation_bytes",
]

#: How a block computes: ``fp32``; ``autocast`` (fp32 weights, bf16 matmuls: DDP, ZeRO-1, TP, PP);
#: ``bf16_params`` (FSDP2's MixedPrecisionPolicy: bf16 gathered weights and activations).
Regime = Literal["fp32", "autocast", "bf16_params"]


def compute_regime(precision: str, *, fsdp: bool) -> Regime:
    """How blocks compute: fp32; bf16 under FSDP2's MixedPrecisionPolicy; else bf16 autocast."""
    if precision == "fp32":
        return "fp32"
    return "bf16_params" if fsdp else "autocast"


def korthikanti_activation_bytes(
    *, seq_len: int, micro_batch: int, d_model: int, n_heads: int, tp: int = 1, sequence_parallel: bool = False
) -> float:
    """Activations one layer saves per micro-batch, half precision (Korthikanti et al. 2022).

    ``sbh(34 + 5as/h)`` without TP; ``sbh(10 + 24/t + 5as/(ht))`` with TP; ``sbh/t (34 + 5as/h)``
    with TP and sequence parallelism. Counts dropout masks and materialised attention scores.
    """
    s, b, h, a = seq_len, micro_batch, d_model, n_heads
    sbh, scores = s * b * h, 5 * a * s * s * b
    if sequence_parallel:
        return (34 * sbh + scores) / tp
    return sbh * (10 + 24 / tp) + scores / tp


def layer_activation_bytes(
    model: ModelConfig,
    *,
    micro_batch: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    precision: str = "bf16",
    checkpointing: str = "none",
    regime: Regime | None = None,
    compiled: bool = False,
    cp: int = 1,
    device: str = "cuda",
) -> float:
    """Activations one block of OUR model saves for backward, per micro-batch: its family's count
    (``ModelFamily.layer_activation_bytes``; ``compiled``: under ``training.compile``, where the family
    has a compiled count). ``regime`` defaults to autocast for bf16 (fp32 for fp32);
    the GPT's count reads the element size from ``precision`` alone. Korthikanti's count, adapted to
    the GPT block (no dropout, fused attention): sbh (8 + 24/t) at f = 4d in bf16, plus fp32 stats.
    With full activation checkpointing only the block input is saved; with selective, the block input
    and what :func:`selective_activation_bytes` counts. Context parallelism (``cp > 1``): the count at one
    cp rank's ``seq_len / cp`` tokens (compiled too: the ring op sits inside the block's graph), plus what
    the ring keeps beyond the fused kernel (``ModelFamily.ring_attention_bytes``, which depends on whether
    ``device`` runs the ring's blocks in a kernel and on ``compiled``; nothing extra under full
    checkpointing, which keeps the input; under selective, the ring's output and log-sum-exp, as a kernel's,
    in q's dtype).
    """
    regime = regime or compute_regime(precision, fsdp=False)
    if cp > 1:
        local = dataclasses.replace(model, seq_len=model.seq_len // cp)
        count = layer_activation_bytes(
            local,
            micro_batch=micro_batch,
            tp=tp,
            sequence_parallel=sequence_parallel,
            precision=precision,
            checkpointing=checkpointing,
            regime=regime,
            compiled=compiled,
        )
        if checkpointing == "full":
            return count
        extra, _ = family(model.arch).ring_attention_bytes(
            local,
            micro_batch=micro_batch,
            regime=regime,
            tp=tp,
            device=device,
            selective=checkpointing == "selective",
            compiled=compiled,
        )
        return count + extra
    if checkpointing == "selective":
        return selective_activation_bytes(
            model, micro_batch=micro_batch, tp=tp, sequence_parallel=sequence_parallel, regime=regime, compiled=compiled
        )
    return family(model.arch).layer_activation_bytes(
        model,
        micro_batch=micro_batch,
        tp=tp,
        sequence_parallel=sequence_parallel,
        precision=precision,
        regime=regime,
        checkpointing=checkpointing == "full",
        compiled=compiled,
    )


def selective_activation_bytes(
    model: ModelConfig,
    *,
    micro_batch: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    regime: Regime = "autocast",
    compiled: bool = False,
) -> float:
    """What one block keeps under selective checkpointing (``etrain.workers.engine.parallelize.apply_ac``),
    per micro-batch: its input (the residual dtype), and the outputs of the ops the policy saves, in
    the compute dtype: every matmul (the column-parallel ones ``column_output_width / tp`` wide, the two
    row-parallel ones a full ``d_model`` partial sum each), attention's output and its fp32 log-sum-exp
    per head, and under sequence parallelism the two reduce-scattered outputs (``d_model / tp``).
    Everything else (norms, activations, RoPE, casts) is recomputed. ``compiled`` (``training.compile``;
    measured on CPU for each dense family at tp=1 and on a tp=2 rank, and within 2% of the H100's peak for
    Llama at tp=1) keeps no weight casts (``plan_memory.stage_memory``), and of the two row-parallel
    outputs (``wo``'s and the MLP's last matmul's, each ``d`` wide):

    * at tp=1 it drops the last one where it feeds only the residual sum
      (``ModelFamily.last_matmul_feeds_the_residual``: every pre-norm family; OLMo 2's post-norm reads it);
    * under tp without sequence parallelism it keeps both partial sums (their all-reduce is not recomputed);
    * under sequence parallelism it keeps none of the partial sums, only the reduce-scattered outputs that a
      later op reads (``d / tp`` each: one where the last feeds only the residual sum, else both).
    """
    found = family(model.arch)
    tokens = model.seq_len * micro_batch
    d = model.d_model
    compute = 4 if regime == "fp32" else 2
    residual = 2 if regime == "bf16_params" else 4
    sp_div = tp if sequence_parallel else 1
    block_input = d * residual / sp_div
    read_later = 1 if found.last_matmul_feeds_the_residual else 2  # of the two row-parallel outputs
    if not compiled:  # torch's policy keeps every matmul and reduce-scatter output
        row_outputs, reduced = 2 * d, 2 * d / tp if sequence_parallel else 0.0
    elif tp == 1:
        row_outputs, reduced = read_later * d, 0.0
    elif sequence_parallel:
        row_outputs, reduced = 0.0, read_later * d / tp
    else:
        row_outputs, reduced = 2 * d, 0.0
    matmuls = compute * (found.column_output_width(model) / tp + row_outputs + reduced)
    attention = compute * found.attention_width(model) / tp + 4 * model.n_heads / tp
    return tokens * (block_input + matmuls + attention)


def ring_transient_bytes(
    model: ModelConfig, *, micro_batch: int, cp: int, regime: Regime, tp: int = 1, device: str = "cuda"
) -> float:
    """Context parallelism: the ring's largest transient while one block computes (on the math path one K/V
    block's scores and probabilities, and their gradients in the backward; with a kernel, a few copies of the
    rank's tokens: ``ModelFamily.ring_attention_bytes``); 0 at cp=1."""
    if cp <= 1:
        return 0.0
    local = dataclasses.replace(model, seq_len=model.seq_len // cp)
    return family(model.arch).ring_attention_bytes(local, micro_batch=micro_batch, regime=regime, tp=tp, device=device)[
        1
    ]


def rope_table_bytes(model: ModelConfig) -> int:
    """The module state each attention module caches (a rotary family's fp32 cos and sin tables)."""
    return family(model.arch).rope_table_bytes(model)


def logits_bytes(
    model: ModelConfig,
    *,
    micro_batch: int,
    tp: int = 1,
    held: int = 1,
    logits_elem: int = 4,
    pipeline: bool = False,
    chunk_tokens: int = 0,
    compiled: bool = False,
) -> float:
    """Peak bytes of the logits and the loss on the last stage, ``L = micro_batch·seq·vocab/tp`` each.

    Without TP (``F.cross_entropy`` on full logits): the fp32 log-softmax is saved for every
    micro-batch in flight (``held``), and the loss backward holds two more full fp32 buffers (the
    gradient into log-softmax and out of it): ``4L·held + 8L``. The forward's transient (the logits,
    an fp32 copy under bf16, and the log-softmax) is no larger. With TP the output layer keeps its
    logits vocab-sharded and the loss runs under ``loss_parallel`` (``torch.distributed.tensor.
    parallel.loss``), whose backward builds the softmax from the saved shard: ``4L·held + 12L``
    (the one-hot gradient, ``exp`` of the log-softmax and their sum). A pipeline stage also keeps
    each in-flight micro-batch's output, the logits (``logits_elem`` bytes, 2 under bf16).

    In chunks (``training.loss_chunk_tokens``, ``etrain.workers.families.head_loss``) nothing of the
    logits is kept between forward and backward: the peak is one chunk's, recomputed in the backward
    (its logits, their fp32 copy and the loss backward's buffers): ``L_chunk·(logits_elem + 4 + 8)``,
    ``+ 12`` under TP, with ``L_chunk = chunk_tokens·vocab/tp``.

    Compiled (``training.compile`` without TP: the cross-entropy under torch.compile, ``etrain.workers.
    families.head_loss``): the backward keeps the logits as they came (``logits_elem``, not a 4-byte
    log-softmax), two fp32 numbers and the target per token, and writes the gradient in the logits' dtype
    with no fp32 buffer: ``L·(logits_elem·held + logits_elem) + 16·tokens·held``, and
    ``L_chunk·2·logits_elem`` in chunks (what the partitioner saves is measured in
    tests/unit/test_planner.py). Under TP the loss stays eager.
    """
    fused = compiled and tp == 1
    if 0 < chunk_tokens < micro_batch * model.seq_len:
        chunk = chunk_tokens * model.vocab_size / tp
        if fused:
            return chunk * 2 * logits_elem
        return chunk * (logits_elem + 4 + (12 if tp > 1 else 8))
    shard = micro_batch * model.seq_len * model.vocab_size / tp
    rows = micro_batch * model.seq_len
    if fused:
        kept = logits_elem + (logits_elem if pipeline else 0)
        return shard * (kept * held + logits_elem) + rows * 16 * held
    kept = 4 + (logits_elem if pipeline else 0)
    return shard * (kept * held + (12 if tp > 1 else 8))


def final_norm_bytes(model: ModelConfig, *, tokens: int, regime: Regime, sp_div: int) -> float:
    """What the final norm saves per micro-batch (its tensors, and its output saved by the head)."""
    return family(model.arch).final_norm_bytes(model, tokens=tokens, regime=regime, sp_div=sp_div)


def layer_chunks_in_flight(schedule: str, *, pp: int, microbatches: int, virtual_stages: int, stage: int) -> int:
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


def in_flight_microbatches(
    schedule: str, *, pp: int, microbatches: int, virtual_stages: int = 1, stage: int = 0
) -> float:
    """Micro-batches of a full stage's layers whose activations a stage holds at its peak.

    Assumptions: ``pp == 1`` runs plain gradient accumulation (1). GPipe runs every forward before
    any backward (M). 1F1B warms up ``pp - stage`` forwards, so stage 0 holds ``min(P, M)``.
    Interleaved 1F1B (Megatron/torch) warms up ``2(P - stage - 1) + (v - 1)R + 1`` chunk forwards of
    ``1/v`` of the stage's layers each, where ``R`` is torch's micro-batches per round (``P`` when
    ``M`` is a multiple of ``P``; :func:`etrain.workers.protocol.layout_rules.interleaved_rounds`): then
    ``P + (P - 1)/v`` micro-batches' worth on stage 0. Never more than all ``M·v`` chunks.
    """
    chunks = layer_chunks_in_flight(
        schedule, pp=pp, microbatches=microbatches, virtual_stages=virtual_stages, stage=stage
    )
    return chunks / (virtual_stages if pp > 1 else 1)

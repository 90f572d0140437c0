"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3): its declaration (pure; the modules are
``workers/families/llama_model.py``).

RoPE (with Llama 3.1's or linear scaling), RMSNorm, SwiGLU, grouped-query attention (``n_kv_heads``),
optional q/k/v bias (Qwen2) or bias everywhere (Llama ``attention_bias``), optional per-head q/k
RMSNorm (Qwen3), tied or untied embeddings. Numerics follow ``transformers``' ``LlamaForCausalLM``,
``MistralForCausalLM``, ``Qwen2ForCausalLM`` and ``Qwen3ForCausalLM`` (tests/unit/test_family_numerics.py).
"""

from __future__ import annotations

from typing import Any

from etrain.workers.families.base import (
    ModelFamily,
    Sizes,
    TPPlan,
    hf_decoder_config,
    hf_problem,
    hf_rope,
    hf_sizes,
    refuse_hidden_act,
    ring_block_kernel,
    ring_block_transient,
)
from etrain.workers.protocol.errors import ConfigError

__all__ = ["FAMILY", "Llama", "llama_widths", "refuse_sliding_window"]

_LLAMA3_ROPE_8K = dict(
    kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)


def llama_widths(model: Sizes) -> tuple[int, int]:
    """(query width, key/value width): ``n_heads·head_dim`` and ``n_kv_heads·head_dim``."""
    return model.n_heads * model.head_dim, model.kv_heads * model.head_dim


def refuse_sliding_window(raw: dict[str, Any], seq_len: int, *, always: bool = False) -> None:
    """etrain runs full causal attention, which equals sliding-window attention only up to the window."""
    window = raw.get("sliding_window")
    uses_window = (
        always or raw.get("use_sliding_window") or any(t == "sliding_attention" for t in raw.get("layer_types") or [])
    )
    if uses_window and window and seq_len > int(window):
        raise ConfigError(
            f"model.seq_len={seq_len} exceeds the model's sliding_window={window}; etrain runs full causal "
            "attention, which equals sliding-window attention only up to the window.",
            field="model.seq_len",
            fix=f"use model.seq_len <= {window}",
        )


class Llama(ModelFamily):
    name = "llama"
    summary = "the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3): RoPE, RMSNorm, SwiGLU, grouped-query attention"
    model_module = "etrain.workers.families.llama_model"
    grouped_query_attention = True
    #: parallelism.cp: LlamaAttention runs as a ring over the cp ranks (workers/families/ring_attention.py).
    context_parallel = True
    # The published Hugging Face configs (meta-llama/Llama-3.2-1B, Llama-3.1-8B, Llama-3.1-70B,
    # Qwen/Qwen3-0.6B, mistralai/Mistral-7B-v0.1) with the training context set to 4096.
    presets = {
        "llama-tiny": dict(
            n_layers=4,
            d_model=64,
            n_heads=4,
            n_kv_heads=2,
            d_ff=176,
            vocab_size=256,
            seq_len=64,
            rope_theta=10000.0,
            hf_architecture="LlamaForCausalLM",
        ),
        "llama3-1b": dict(
            n_layers=16,
            d_model=2048,
            n_heads=32,
            n_kv_heads=8,
            d_ff=8192,
            vocab_size=128256,
            seq_len=4096,
            rope_theta=500000.0,
            rope_scaling=dict(
                kind="llama3",
                factor=32.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
            tie_embeddings=True,
            max_position_embeddings=131072,
            hf_architecture="LlamaForCausalLM",
        ),
        "llama3-8b": dict(
            n_layers=32,
            d_model=4096,
            n_heads=32,
            n_kv_heads=8,
            d_ff=14336,
            vocab_size=128256,
            seq_len=4096,
            rope_theta=500000.0,
            rope_scaling=_LLAMA3_ROPE_8K,
            max_position_embeddings=131072,
            hf_architecture="LlamaForCausalLM",
        ),
        "llama3-70b": dict(
            n_layers=80,
            d_model=8192,
            n_heads=64,
            n_kv_heads=8,
            d_ff=28672,
            vocab_size=128256,
            seq_len=4096,
            rope_theta=500000.0,
            rope_scaling=_LLAMA3_ROPE_8K,
            max_position_embeddings=131072,
            hf_architecture="LlamaForCausalLM",
        ),
        "qwen3-0.6b": dict(
            n_layers=28,
            d_model=1024,
            n_heads=16,
            n_kv_heads=8,
            head_dim_override=128,
            d_ff=3072,
            vocab_size=151936,
            seq_len=4096,
            rope_theta=1000000.0,
            norm_eps=1e-6,
            qk_norm=True,
            tie_embeddings=True,
            max_position_embeddings=40960,
            hf_architecture="Qwen3ForCausalLM",
        ),
        "mistral-7b": dict(
            n_layers=32,
            d_model=4096,
            n_heads=32,
            n_kv_heads=8,
            d_ff=14336,
            vocab_size=32000,
            seq_len=4096,
            rope_theta=10000.0,
            max_position_embeddings=32768,
            hf_architecture="MistralForCausalLM",
        ),
    }
    hf_architectures = {
        "LlamaForCausalLM": {"model_type": "llama"},
        "MistralForCausalLM": {"model_type": "mistral"},
        "Qwen2ForCausalLM": {"model_type": "qwen2", "attention_bias": "qkv"},
        "Qwen3ForCausalLM": {"model_type": "qwen3", "qk_norm": True},
    }
    hf_top_names = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    hf_layer_names = {
        "attention_norm.weight": "input_layernorm.weight",
        "attention.wq.weight": "self_attn.q_proj.weight",
        "attention.wq.bias": "self_attn.q_proj.bias",
        "attention.wk.weight": "self_attn.k_proj.weight",
        "attention.wk.bias": "self_attn.k_proj.bias",
        "attention.wv.weight": "self_attn.v_proj.weight",
        "attention.wv.bias": "self_attn.v_proj.bias",
        "attention.wo.weight": "self_attn.o_proj.weight",
        "attention.wo.bias": "self_attn.o_proj.bias",
        "attention.q_norm.weight": "self_attn.q_norm.weight",
        "attention.k_norm.weight": "self_attn.k_norm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "feed_forward.w1.weight": "mlp.gate_proj.weight",
        "feed_forward.w2.weight": "mlp.down_proj.weight",
        "feed_forward.w3.weight": "mlp.up_proj.weight",
    }

    # -- shape -------------------------------------------------------------------------------------

    def shape_errors(self, model: Sizes) -> list[ConfigError]:
        errors = super().shape_errors(model)
        if errors:
            return errors
        if model.n_heads % model.kv_heads:
            errors.append(
                ConfigError(
                    f"model.n_heads={model.n_heads} is not divisible by model.n_kv_heads={model.kv_heads}.",
                    field="model.n_kv_heads",
                    fix="grouped-query attention shares each kv head among n_heads / n_kv_heads query heads: "
                    "pick n_kv_heads dividing n_heads",
                )
            )
        if model.head_dim % 2:
            errors.append(
                ConfigError(
                    f"the head dimension {model.head_dim} is odd; RoPE rotates pairs.",
                    field="model.d_model",
                    fix="use an even head_dim (d_model / n_heads)",
                )
            )
        return errors

    def tp_dims(self, model: Sizes) -> tuple[tuple[str, int], ...]:
        """Whole query and key/value heads, the MLP width and the vocabulary."""
        return (
            ("n_heads", model.n_heads),
            ("n_kv_heads", model.kv_heads),
            ("ffn_dim", model.ffn_dim),
            ("vocab_size", model.vocab_size),
        )

    def tp_plan(self, model: Sizes) -> TPPlan:
        """Megatron's: ``wq/wk/wv`` and ``w1/w3`` column-parallel, ``wo/w2`` row-parallel; Qwen3's per-head
        q/k norms see ``[batch, seq, local heads, head_dim]`` (heads sharded, weights replicated)."""
        block = {
            "attention_norm": "norm",
            "attention.wq": "colwise",
            "attention.wk": "colwise",
            "attention.wv": "colwise",
            "attention.wo": "rowwise",
            "ffn_norm": "norm",
            "feed_forward.w1": "colwise",
            "feed_forward.w2": "rowwise",
            "feed_forward.w3": "colwise",
        }
        if model.qk_norm:
            block.update({"attention.q_norm": "head_norm", "attention.k_norm": "head_norm"})
        block.update({"attention": "gather_sequence", "feed_forward": "gather_sequence"})
        return TPPlan(root={"tok_embeddings": "vocab_embedding", "norm": "norm", "output": "vocab_head"}, block=block)

    # -- counts ------------------------------------------------------------------------------------

    def _attention_bias(self, model: Sizes) -> int:
        q_width, kv_width = llama_widths(model)
        return {"none": 0, "qkv": q_width + 2 * kv_width, "all": q_width + 2 * kv_width + model.d_model}[
            model.attention_bias
        ]

    def num_params(self, model: Sizes) -> int:
        d, f, v, n = model.d_model, model.ffn_dim, model.vocab_size, model.n_layers
        q_width, kv_width = llama_widths(model)
        per_layer = (
            d  # attention RMSNorm
            + d * q_width
            + 2 * d * kv_width
            + q_width * d
            + self._attention_bias(model)  # q, k, v, o
            + (2 * model.head_dim if model.qk_norm else 0)  # per-head q/k RMSNorm
            + d  # MLP RMSNorm
            + 3 * d * f  # SwiGLU: gate, up, down
        )
        head = d + (0 if model.tie_embeddings else v * d)  # final norm + output (shared when tied)
        return n * per_layer + v * d + head

    def layer_params(self, model: Sizes, tp: int = 1) -> float:
        """Sharded are ``wq`` (d x n_heads·head_dim), ``wk``/``wv`` (d x n_kv_heads·head_dim each:
        grouped-query attention), ``wo`` and SwiGLU's three d x ffn matrices, plus the q/k/v biases
        (Qwen2, ``attention_bias``); replicated are the two RMSNorm weights (no bias), Qwen3's per-head
        q/k norm weights (head_dim each) and ``wo``'s bias when ``attention_bias == "all"``."""
        d, f = model.d_model, model.ffn_dim
        q, kv = llama_widths(model)
        sharded = d * q + 2 * d * kv + q * d + 3 * d * f
        if model.attention_bias != "none":
            sharded += q + 2 * kv
        replicated = 2 * d + (2 * model.head_dim if model.qk_norm else 0)
        replicated += d if model.attention_bias == "all" else 0
        return sharded / tp + replicated

    def head_params(self, model: Sizes, tp: int, *, with_embedding: bool = False) -> float:
        """The final RMSNorm (no bias) and the vocab-parallel head; a tied head on the embedding's stage
        shares the embedding's vocab shard."""
        tied = model.tie_embeddings and with_embedding
        return model.d_model + (0 if tied else model.vocab_size * model.d_model / tp)

    def largest_param(self, model: Sizes, *, first: bool = True, last: bool = True) -> int:
        d, f = model.d_model, model.ffn_dim
        q, kv = llama_widths(model)
        candidates = [d * q, d * kv, d * f]
        if first or last:
            candidates.append(model.vocab_size * d)
        return max(candidates)

    def matmul_params_per_layer(self, model: Sizes, tp: int = 1) -> float:
        d, f = model.d_model, model.ffn_dim
        q, kv = llama_widths(model)
        return (2 * d * q + 2 * d * kv + 3 * d * f) / tp

    def column_output_width(self, model: Sizes) -> int:
        q, kv = llama_widths(model)
        return q + 2 * kv + 2 * model.ffn_dim  # wq, wk, wv; w1 (gate), w3 (up)

    def lookup_params(self, model: Sizes) -> int:
        """The token embedding, unless the output head multiplies by it (tied)."""
        return 0 if model.tie_embeddings else model.vocab_size * model.d_model

    def layer_activation_bytes(
        self,
        model: Sizes,
        *,
        micro_batch: int,
        tp: int = 1,
        sequence_parallel: bool = False,
        precision: str = "fp32",
        regime: str = "fp32",
        checkpointing: bool = False,
        compiled: bool = False,
    ) -> float:
        """What one Llama block (``workers/families/llama_model.py``) saves for backward, per micro-batch,
        in bytes.

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
        The per-layer RoPE table cache is module state (:meth:`rope_table_bytes`), not counted here.
        """
        s, b, d, f = model.seq_len, micro_batch, model.d_model, model.ffn_dim
        q, kv = llama_widths(model)
        heads, kv_heads = model.n_heads, model.kv_heads
        sp_div = tp if sequence_parallel else 1
        tokens = s * b
        if checkpointing:
            return tokens * d * (2 if regime == "bf16_params" else 4) / sp_div
        if compiled:
            return tokens * _compiled_per_token(
                d=d, q=q, f=f, heads=heads, regime=regime, tp=tp, sp_div=sp_div, qk_norm_widths=_qk(model, kv)
            )
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

    def final_norm_bytes(self, model: Sizes, *, tokens: int, regime: str, sp_div: int) -> float:
        d = model.d_model
        own = {"fp32": 8 * d + 4, "autocast": 8 * d + 4, "bf16_params": 6 * d + 4}[regime]
        output = 4 * d if regime == "fp32" else 2 * d
        return tokens * (own / sp_div + output)

    def rope_table_bytes(self, model: Sizes) -> int:
        """The fp32 cos and sin tables each attention module caches (``seq_len x head_dim`` each)."""
        return 2 * model.seq_len * model.head_dim * 4

    def ring_attention_bytes(
        self,
        model: Sizes,
        *,
        micro_batch: int,
        regime: str,
        tp: int = 1,
        device: str = "cuda",
        selective: bool = False,
        compiled: bool = False,
    ) -> tuple[float, float]:
        """Context parallelism (``workers/families/ring_attention.py``), ``model.seq_len`` being a cp rank's
        ``c = S / cp`` tokens. Saved beyond the block's count at ``c`` tokens: the ring keeps ``q``, ``k`` and
        ``v`` as they arrive (k/v *not* repeated to n_heads; q and k fp32 after the q/k norms under
        autocast) and its output, and ``wo`` may read a copy of it (below), where the fused kernel kept ``q``, repeated ``k``/``v`` and one output: per token ``2q·e_qk + kv·(e_qk + e_v) +
        copy − 4q·elem``, where ``copy = q·e_o`` is what ``wo`` reads when it is not a view of the ring's
        output: under autocast with q/k norms (an fp32 output, cast to bf16). Otherwise ``wo`` reads a view:
        the ring lays its output out token-major, as the fused kernel does, on every path. RoPE's tables indexed
        at the rank's positions (``2·c·head_dim`` fp32) are kept when the rotation runs in fp32 (fp32, or
        autocast with q/k norms), while the bf16 casts are counted already. Measured against autograd's
        saved tensors on CPU (tests/integration/test_context_parallel.py). Transient:
        :func:`ring_block_transient`. Under selective checkpointing (``selective``) the policy keeps the ring's
        output and log-sum-exp, as it keeps a fused kernel's, but the ring's output is in q's dtype: fp32 under
        autocast with q/k norms, ``q·2`` bytes more per token than the kernel's bf16 one. Compiled
        (``compiled``), the same beyond the compiled count, but in place of RoPE's indexed tables the
        partitioner keeps the rank's int64 positions (``8·c`` bytes, whatever the rotation's dtype) and
        recomputes the tables from them in the backward."""
        q, kv = llama_widths(model)
        tokens = model.seq_len * micro_batch
        fp32_rotation = regime == "fp32" or (regime == "autocast" and model.qk_norm)
        elem = 4 if regime == "fp32" else 2
        e_qk = 4 if fp32_rotation else 2
        e_v = e_o = elem
        kernel = ring_block_kernel(device, fp32=fp32_rotation, head_dim=model.head_dim)
        transient = ring_block_transient(
            kernel, micro_batch=micro_batch, n_heads=model.n_heads, tokens=model.seq_len, q_width=q, tp=tp
        )
        if selective:
            return tokens * q * (e_qk - elem) / tp, float(transient)
        copy = q * e_o if regime == "autocast" and fp32_rotation else 0
        per_token = 2 * q * e_qk + kv * (e_qk + e_v) + copy - 4 * q * elem
        if compiled:
            tables = 8 * model.seq_len
        else:
            tables = 2 * model.seq_len * model.head_dim * 4 if fp32_rotation else 0
        return tokens * per_token / tp + tables, float(transient)  # the widths and heads are tp-sharded

    # -- Hugging Face ------------------------------------------------------------------------------

    def config_from_hf(self, raw: dict[str, Any], architecture: str, *, seq_len: int | None) -> dict[str, Any]:
        traits = self.hf_architectures[architecture]
        sizes = hf_sizes(raw, seq_len=seq_len)
        refuse_hidden_act(raw)
        if raw.get("mlp_bias"):
            raise hf_problem(
                "model.hf has mlp_bias=true, which etrain's SwiGLU does not implement.",
                "use a model without MLP biases",
            )
        refuse_sliding_window(raw, sizes["seq_len"], always=architecture == "MistralForCausalLM")
        if architecture == "LlamaForCausalLM":
            bias = "all" if raw.get("attention_bias") else "none"
        else:
            bias = traits.get("attention_bias", "none")
        return dict(
            sizes,
            **hf_rope(raw),
            norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            attention_bias=bias,
            qk_norm=bool(traits.get("qk_norm", False)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        )

    def hf_config(self, model: Sizes) -> dict[str, Any]:
        arch = model.hf_architecture or "LlamaForCausalLM"
        if arch not in self.hf_architectures:
            raise ConfigError(
                f"the llama family does not export to {arch}.",
                field="checkpoint.export",
                fix=f"use one of {', '.join(self.hf_architectures)}",
            )
        config = hf_decoder_config(model, arch, self.hf_architectures[arch]["model_type"])
        if arch == "LlamaForCausalLM":
            config["attention_bias"] = model.attention_bias == "all"
            config["mlp_bias"] = False
        if arch == "MistralForCausalLM":
            # etrain trains full causal attention; without this key transformers would apply its
            # default 4096-token sliding window to longer inputs.
            config["sliding_window"] = None
        return config

    def hf_parameter_names(self, model: Sizes) -> list[str]:
        names = ["tok_embeddings.weight"]
        biased = {"none": (), "qkv": ("wq", "wk", "wv"), "all": ("wq", "wk", "wv", "wo")}[model.attention_bias]
        for i in range(model.n_layers):
            layer = [f"layers.{i}.attention_norm.weight"]
            for proj in ("wq", "wk", "wv", "wo"):
                layer.append(f"layers.{i}.attention.{proj}.weight")
                if proj in biased:
                    layer.append(f"layers.{i}.attention.{proj}.bias")
            if model.qk_norm:
                layer += [f"layers.{i}.attention.q_norm.weight", f"layers.{i}.attention.k_norm.weight"]
            layer += [
                f"layers.{i}.ffn_norm.weight",
                f"layers.{i}.feed_forward.w1.weight",
                f"layers.{i}.feed_forward.w2.weight",
                f"layers.{i}.feed_forward.w3.weight",
            ]
            names += layer
        names.append("norm.weight")
        if not model.tie_embeddings:
            names.append("output.weight")
        return names


FAMILY = Llama()


def _qk(model: Sizes, kv: int) -> tuple[int, int] | None:
    """``(kv width, n_kv_heads)`` of a block with Qwen3's per-head q/k norms, else None."""
    return (kv, model.kv_heads) if model.qk_norm else None


def _compiled_per_token(
    *,
    d: int,
    q: int,
    f: int,
    heads: int,
    regime: str,
    tp: int,
    sp_div: int,
    qk_norm_widths: tuple[int, int] | None = None,
) -> float:
    """Bytes per token a compiled Llama block saves: measured on CPU by the tensors autograd saves under
    inductor's partitioner (tests/unit/test_planner.py), and within 2.5% of the peaks measured on an H100
    without q/k norms (Llama-3.2-1B shapes: 43.2 GiB compiled, 33.5 GiB with the chunked loss; the planner
    44.2, 34.1).

    The partitioner keeps the block input (residual dtype), each norm's ``rsqrt`` (fp32) and output
    (compute dtype, once: the projections' shared input), ``wo``'s output (to recompute the mid-block
    residual for the second norm's backward), q, k and v (repeated to ``n_heads``), attention's output
    and log-sum-exp, and of SwiGLU the gate, the up projection and their product; it recomputes silu, the
    norms' scaling, the residual sum and the casts (where eager saves a bf16 cast per consumer). Heads and
    the MLP are sharded by ``tp``; the block input, ``rsqrt`` and ``wo``'s output by sequence parallelism.

    With Qwen3's per-head q/k norms (``qk_norm_widths``: the kv width and ``n_kv_heads``) the
    partitioner also keeps q and k as projected, before their norms (compute dtype, ``q + kv``), and each
    head's ``rsqrt`` (fp32), and recomputes the normalised q and k: ``elem·(q + kv) + 4·(H + H_kv)`` more,
    sharded by ``tp`` (measured exactly in the three regimes; eager keeps about twice that, in fp32).
    """
    residual = 2 if regime == "bf16_params" else 4
    elem = 4 if regime == "fp32" else 2
    own = residual * d + 2 * 4 + elem * d
    norm_outputs = 2 * elem * d
    sharded = 4 * elem * q + 4 * heads + 3 * elem * f
    if qk_norm_widths is not None:
        kv, kv_heads = qk_norm_widths
        sharded += elem * (q + kv) + 4 * (heads + kv_heads)
    return own / sp_div + norm_outputs + sharded / tp

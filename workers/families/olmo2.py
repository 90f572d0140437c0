"""OLMo 2 (AllenAI): its declaration (pure; the modules are ``workers/families/olmo2_model.py``).

A Llama-shaped decoder (RoPE, RMSNorm, SwiGLU, grouped-query attention) with two differences that
matter to every layer of etrain:

* **Norms after, not before.** A block is ``h = x + norm(attention(x))`` then ``h + norm(mlp(h))``
  (``post_attention_layernorm``, ``post_feedforward_layernorm``); there is no input norm.
* **q/k norms over the whole projection.** ``q_norm`` normalises all ``n_heads·head_dim`` query
  features at once (``k_norm`` the ``n_kv_heads·head_dim`` key features), before the heads are split.
  Under tensor parallelism those features are sharded by heads, so the norm's weights are sharded with
  them and its mean is reduced across the tp ranks (the ``width_norm`` style: DTensor all-reduces one
  value per token), where transformers' own plan gathers q, k and v whole.

Its RMSNorm multiplies by the weight in fp32 before casting back (``(w · x32).to(dtype)``, unlike
Llama's ``w · x32.to(dtype)``): equal in fp32, one rounding apart in bf16. Numerics follow
``transformers``' ``Olmo2ForCausalLM`` (tests/unit/test_family_numerics.py).
"""

from __future__ import annotations

from typing import Any

from etrain.workers.families.base import (
    Sizes,
    TPPlan,
    hf_decoder_config,
    hf_rope,
    hf_sizes,
    refuse_hidden_act,
)
from etrain.workers.families.llama import Llama, llama_widths

__all__ = ["FAMILY", "Olmo2"]


class Olmo2(Llama):
    """What differs from :class:`~etrain.workers.families.llama.Llama` (whose shape rules, embedding,
    head and FLOP counts it shares): the block's parameters and names, its TP plan, its activations."""

    name = "olmo2"
    summary = "OLMo 2: Llama-shaped with norms after attention and MLP and q/k norms over the whole width"
    model_module = "etrain.workers.families.olmo2_model"
    context_parallel = True  # its attention is LlamaAttention with whole-width q/k norms: the same ring
    last_matmul_feeds_the_residual = False  # the post-MLP norm reads it
    # allenai/OLMo-2-0425-1B's published config with its 4096-token context.
    presets = {
        "olmo2-tiny": dict(
            n_layers=4,
            d_model=64,
            n_heads=4,
            n_kv_heads=2,
            d_ff=176,
            vocab_size=256,
            seq_len=64,
            rope_theta=500000.0,
            norm_eps=1e-6,
            hf_architecture="Olmo2ForCausalLM",
        ),
        "olmo2-1b": dict(
            n_layers=16,
            d_model=2048,
            n_heads=16,
            n_kv_heads=16,
            d_ff=8192,
            vocab_size=100352,
            seq_len=4096,
            rope_theta=500000.0,
            norm_eps=1e-6,
            max_position_embeddings=4096,
            hf_architecture="Olmo2ForCausalLM",
        ),
    }
    hf_architectures = {"Olmo2ForCausalLM": {"model_type": "olmo2"}}
    # Llama's attention and MLP names; its two pre-norms give way to the post-norms.
    hf_layer_names = {
        **{
            name: hf
            for name, hf in Llama.hf_layer_names.items()
            if name not in ("attention_norm.weight", "ffn_norm.weight")
        },
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "post_ffn_norm.weight": "post_feedforward_layernorm.weight",
    }

    def tp_plan(self, model: Sizes) -> TPPlan:
        """Llama's, but q and k leave their projections as width-sharded DTensors for the q/k norms,
        whose weights are sharded the same way; the post-norms are ordinary d_model norms."""
        return TPPlan(
            root={"tok_embeddings": "vocab_embedding", "norm": "norm", "output": "vocab_head"},
            block={
                "attention.wq": "colwise_sharded_output",
                "attention.wk": "colwise_sharded_output",
                "attention.wv": "colwise",
                "attention.q_norm": "width_norm",
                "attention.k_norm": "width_norm",
                "attention.wo": "rowwise",
                "post_attention_norm": "norm",
                "feed_forward.w1": "colwise",
                "feed_forward.w2": "rowwise",
                "feed_forward.w3": "colwise",
                "post_ffn_norm": "norm",
                "attention": "gather_sequence",
                "feed_forward": "gather_sequence",
            },
        )

    def num_params(self, model: Sizes) -> int:
        d, f, v, n = model.d_model, model.ffn_dim, model.vocab_size, model.n_layers
        q_width, kv_width = llama_widths(model)
        per_layer = (
            d * q_width
            + 2 * d * kv_width
            + q_width * d
            + self._attention_bias(model)  # q, k, v, o
            + q_width
            + kv_width  # q/k RMSNorm over the whole projections
            + 3 * d * f  # SwiGLU
            + 2 * d  # the two post-norms
        )
        head = d + (0 if model.tie_embeddings else v * d)
        return n * per_layer + v * d + head

    def layer_params(self, model: Sizes, tp: int = 1) -> float:
        """Llama's sharded projections, plus the q/k norm weights (sharded with the heads); replicated
        are the two post-norms and ``wo``'s bias."""
        d, f = model.d_model, model.ffn_dim
        q, kv = llama_widths(model)
        sharded = d * q + 2 * d * kv + q * d + 3 * d * f + q + kv
        if model.attention_bias != "none":
            sharded += q + 2 * kv
        replicated = 2 * d + (d if model.attention_bias == "all" else 0)
        return sharded / tp + replicated

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
        """What one OLMo 2 block (``workers/families/olmo2_model.py``) saves for backward, per micro-batch,
        in bytes, checked against the tensors autograd saves (tests/unit/test_planner.py). Per token, with
        q, kv, f and H as for Llama:

        * No input norms: the projections read the block input and the MLP's input themselves, each
          saved once in fp32 (``2·4d``) and bf16_params (``2·2d``), as one bf16 cast per consumer under
          autocast (wq, wk, wv; w1, w3: ``5·2d``).
        * Every OLMo 2 norm (q and k over their whole width, the two post-norms) computes in fp32 and
          multiplies by its weight before casting back, so in every regime it saves an fp32 input (the
          projection's output, or its fp32 copy), the fp32 normalised values and one fp32 ``rsqrt`` per
          token: ``8(q + kv) + 8`` and ``2(8d + 4)``.
        * Attention and SwiGLU save what Llama's do: q after RoPE, k and v repeated to n_heads, the output
          and an fp32 log-sum-exp per head (``4q·elem + 4H``), and ``4f·elem``. q and k leave their norms
          in the compute dtype, so the bf16 regimes cast RoPE's tables per call (``4·s·head_dim·2``).

        Divided by ``tp``: everything inside attention and the MLP, the q/k norms' features included (their
        ``rsqrt`` is per token on every rank); the post-norms run on a sequence shard under sequence
        parallelism. With activation checkpointing only the block input is saved. The RoPE table cache is
        module state (:meth:`rope_table_bytes`).

        Compiled (``training.compile``; measured exactly under inductor's min-cut partitioner on CPU, in the
        three regimes): everything in the compute dtype ``e``, once. The projections' two inputs (the block
        input and the mid-block residual, ``2·e·d``), each post-norm's input and ``rsqrt`` (``2·e·d + 8``),
        the q/k norms' inputs and ``rsqrt`` (``e·(q + kv) + 8``), and attention and SwiGLU as compiled Llama
        keeps them (``4·e·q + 4H`` and ``3·e·f``: silu recomputed); the normalised values, RoPE's products
        and the casts are recomputed. About 30% less than eager in fp32, and half under the bf16 regimes.
        Under tensor parallelism the q/k norms' fp32 normalised values are kept too (``4·(q + kv) / tp``).
        """
        s, b, d, f = model.seq_len, micro_batch, model.d_model, model.ffn_dim
        q, kv = llama_widths(model)
        sp_div = tp if sequence_parallel else 1
        tokens = s * b
        if checkpointing:
            return tokens * d * (2 if regime == "bf16_params" else 4) / sp_div
        if compiled and regime in ("fp32", "autocast", "bf16_params"):
            e = 4 if regime == "fp32" else 2
            own = 2 * e * d + 8  # the post-norms' inputs and rsqrt: on a sequence shard under SP
            sharded = e * (q + kv) + 4 * e * q + 4 * model.n_heads + 3 * e * f
            if tp > 1:  # the q/k norms' fp32 normalised values too: their mean is an all-reduce over tp, which
                sharded += 4 * (q + kv)  # the partitioner does not recompute through (measured at tp=2)
            return tokens * (2 * e * d + own / sp_div + 8 + sharded / tp)
        if regime == "fp32":
            inputs, elem = 2 * 4 * d, 4
        elif regime == "autocast":
            inputs, elem = 5 * 2 * d, 2
        elif regime == "bf16_params":
            inputs, elem = 2 * 2 * d, 2
        else:
            raise ValueError(f"regime must be fp32, autocast or bf16_params, got {regime!r}")
        qk_norms = 8 * (q + kv)
        post_norms = 2 * (8 * d + 4)
        attention = 4 * q * elem + 4 * model.n_heads
        mlp = 4 * f * elem
        per_token = inputs + 2 * 4 + post_norms / sp_div + (qk_norms + attention + mlp) / tp
        rope = 4 * s * model.head_dim * 2 if regime != "fp32" else 0
        return tokens * per_token + rope

    def final_norm_bytes(self, model: Sizes, *, tokens: int, regime: str, sp_div: int) -> float:
        """Its fp32 input (or copy), normalised values and ``rsqrt``, in every regime; its output as the head
        reads it (fp32, or a bf16 cast)."""
        d = model.d_model
        return tokens * ((8 * d + 4) / sp_div + (4 * d if regime == "fp32" else 2 * d))

    def config_from_hf(self, raw: dict[str, Any], architecture: str, *, seq_len: int | None) -> dict[str, Any]:
        sizes = hf_sizes(raw, seq_len=seq_len)
        refuse_hidden_act(raw)
        return dict(
            sizes,
            **hf_rope(raw),
            norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            attention_bias="all" if raw.get("attention_bias") else "none",
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        )

    def hf_config(self, model: Sizes) -> dict[str, Any]:
        return hf_decoder_config(model, "Olmo2ForCausalLM", "olmo2", attention_bias=model.attention_bias == "all")

    def hf_parameter_names(self, model: Sizes) -> list[str]:
        biased = ("wq", "wk", "wv", "wo") if model.attention_bias == "all" else ()
        names = ["tok_embeddings.weight"]
        for i in range(model.n_layers):
            for proj in ("wq", "wk", "wv", "wo"):
                names.append(f"layers.{i}.attention.{proj}.weight")
                if proj in biased:
                    names.append(f"layers.{i}.attention.{proj}.bias")
            names += [
                f"layers.{i}.attention.q_norm.weight",
                f"layers.{i}.attention.k_norm.weight",
                f"layers.{i}.post_attention_norm.weight",
                f"layers.{i}.feed_forward.w1.weight",
                f"layers.{i}.feed_forward.w2.weight",
                f"layers.{i}.feed_forward.w3.weight",
                f"layers.{i}.post_ffn_norm.weight",
            ]
        names.append("norm.weight")
        if not model.tie_embeddings:
            names.append("output.weight")
        return names


FAMILY = Olmo2()

"""Mixtral (``MixtralForCausalLM``): its declaration (pure; the modules are ``workers/families/mixtral_model.py``).

Qwen3-MoE's mixture of experts (``workers/families/qwen3_moe.py``: a softmax top-k router, stacked SwiGLU
experts run as grouped matmuls, no capacity limit, the load-balancing loss, expert parallelism) with the
Llama family's attention (RoPE, grouped-query attention, RMSNorm; no q/k norms, no biases). What differs:

* **Router.** The top-k weights are always renormalised to sum to one (softmax in fp32, top-k, divided by
  their sum; ``norm_topk_prob`` is fixed on) and stay in fp32 (Qwen3-MoE casts them to the logits' dtype).
* **Experts.** ``intermediate_size`` is each expert's width (there is no dense MLP): ``d_ff`` here, with
  ``moe_d_ff`` left out (or equal).
* **Load-balancing loss.** ``router_aux_loss_coef`` times Switch Transformer's loss, per micro-batch and
  averaged like the language-model loss, as Qwen3-MoE's (``MixtralForCausalLM(..., output_router_logits=
  True)``'s loss). Mixtral-8x7B's published config has 0.02, Mixtral-8x22B's 0.001; a ``config.json``
  without the key reads as transformers' default, 0.001.
* **Hugging Face names.** The hub's and ``save_pretrained``'s (transformers 5 converts them to its fused
  in-memory ``mlp.experts.gate_up_proj`` on load and back on save): ``model.layers.N.block_sparse_moe.gate
  .weight`` and one tensor per expert and projection, ``...block_sparse_moe.experts.E.w1/w2/w3.weight``.

Parallelised like Qwen3-MoE (tensor parallelism splits every expert's width; pipeline stages pass the
routing statistics on with the activations). Refused when reading
``model.hf``: a ``hidden_act`` other than silu, ``router_jitter_noise > 0`` (transformers multiplies each
block's input by uniform noise while training; etrain does not), and a ``sliding_window`` shorter than
``model.seq_len`` (etrain runs full causal attention).

Numerics follow ``transformers``' ``MixtralForCausalLM`` (tests/unit/test_mixtral.py).
"""

from __future__ import annotations

from typing import Any

from etrain.workers.families.base import Sizes, hf_decoder_config, hf_problem, hf_rope, hf_sizes, refuse_hidden_act
from etrain.workers.families.llama import refuse_sliding_window
from etrain.workers.families.qwen3_moe import Qwen3Moe
from etrain.workers.protocol.errors import ConfigError

__all__ = ["FAMILY", "Mixtral"]

#: What mistralai/Mixtral-8x7B-v0.1's and Mixtral-8x22B-v0.1's published config.json share.
_MIXTRAL_COMMON = dict(
    n_kv_heads=8,
    seq_len=4096,
    rope_theta=1000000.0,
    norm_eps=1e-5,
    n_experts=8,
    experts_per_token=2,
    norm_topk_prob=True,
    hf_architecture="MixtralForCausalLM",
)


class Mixtral(Qwen3Moe):
    """Qwen3-MoE's experts, counts and refusals with Llama's attention and Mixtral's router and names."""

    name = "mixtral"
    summary = (
        "Mixtral: Llama attention (RoPE, grouped-query) and a sparse mixture-of-experts MLP (softmax top-k router "
        "always renormalised, SwiGLU experts, load-balancing loss)"
    )
    model_module = "etrain.workers.families.mixtral_model"
    # mistralai/Mixtral-8x7B-v0.1's and mistralai/Mixtral-8x22B-v0.1's published config.json, trained at
    # 4096 tokens.
    presets = {
        "mixtral-tiny": dict(
            _MIXTRAL_COMMON,
            n_layers=2,
            d_model=64,
            n_heads=4,
            n_kv_heads=2,
            d_ff=32,
            vocab_size=256,
            seq_len=64,
            router_aux_loss_coef=0.02,
        ),
        "mixtral-8x7b": dict(
            _MIXTRAL_COMMON,
            n_layers=32,
            d_model=4096,
            n_heads=32,
            d_ff=14336,
            vocab_size=32000,
            router_aux_loss_coef=0.02,
            max_position_embeddings=32768,
        ),
        "mixtral-8x22b": dict(
            _MIXTRAL_COMMON,
            n_layers=56,
            d_model=6144,
            n_heads=48,
            d_ff=16384,
            vocab_size=32768,
            router_aux_loss_coef=0.001,
            max_position_embeddings=65536,
        ),
    }
    hf_architectures = {"MixtralForCausalLM": {"model_type": "mixtral"}}
    hf_layer_names = {**Qwen3Moe.hf_layer_names, "feed_forward.router.weight": "block_sparse_moe.gate.weight"}
    hf_expert_names = {
        "feed_forward.experts.w1": "block_sparse_moe.experts.{expert}.w1.weight",
        "feed_forward.experts.w2": "block_sparse_moe.experts.{expert}.w2.weight",
        "feed_forward.experts.w3": "block_sparse_moe.experts.{expert}.w3.weight",
    }
    fixed_fields = {"norm_topk_prob": True}  # the router always renormalises
    fp32_routing_weights = True

    # -- shape -------------------------------------------------------------------------------------

    def shape_errors(self, model: Sizes) -> list[ConfigError]:
        """Llama's and the experts' rules; what Mixtral's modules do not have is refused, naming the field
        (an export could not write it)."""
        errors = super().shape_errors(model)
        if model.qk_norm:
            errors.append(
                ConfigError(
                    "model.qk_norm is set, but Mixtral's attention has no q/k norms.",
                    field="model.qk_norm",
                    fix="leave model.qk_norm off for model.kind 'mixtral' (qwen3_moe has q/k norms)",
                )
            )
        if model.attention_bias != "none":
            errors.append(
                ConfigError(
                    f"model.attention_bias={model.attention_bias!r}, but Mixtral's projections have no biases.",
                    field="model.attention_bias",
                    fix="use attention_bias 'none' for model.kind 'mixtral'",
                )
            )
        if model.moe_d_ff is not None and model.moe_d_ff != model.ffn_dim:
            errors.append(
                ConfigError(
                    f"model.moe_d_ff={model.moe_d_ff} differs from model.d_ff={model.ffn_dim}: Mixtral has no "
                    "dense MLP, its experts are d_ff wide (intermediate_size).",
                    field="model.moe_d_ff",
                    fix=f"give the experts' width as model.d_ff={model.moe_d_ff} and leave model.moe_d_ff out",
                )
            )
        return errors

    # -- Hugging Face ------------------------------------------------------------------------------

    def config_from_hf(self, raw: dict[str, Any], architecture: str, *, seq_len: int | None) -> dict[str, Any]:
        sizes = hf_sizes(raw, seq_len=seq_len)
        refuse_hidden_act(raw)
        try:
            jitter = float(raw.get("router_jitter_noise") or 0.0)
            moe = dict(
                n_experts=int(raw.get("num_local_experts", raw.get("num_experts", 8))),
                experts_per_token=int(raw.get("num_experts_per_tok", 2)),
                router_aux_loss_coef=float(raw.get("router_aux_loss_coef", 0.001)),
            )
        except (TypeError, ValueError) as exc:
            raise hf_problem(
                f"model.hf config.json mangles a mixture-of-experts setting ({exc}).",
                "restore the config.json written by transformers (num_local_experts, num_experts_per_tok, "
                "router_aux_loss_coef, router_jitter_noise)",
            ) from exc
        if jitter > 0:
            raise hf_problem(
                f"model.hf has router_jitter_noise={raw['router_jitter_noise']}: transformers multiplies each "
                "block's input by uniform noise in [1 - j, 1 + j] while training, which etrain does not implement.",
                "set router_jitter_noise to 0.0 in the folder's config.json (as published)",
            )
        refuse_sliding_window(raw, sizes["seq_len"], always=True)  # Mixtral applies any window it states
        return dict(
            sizes,
            **hf_rope(raw),
            **moe,
            norm_topk_prob=True,
            norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        )

    def hf_config(self, model: Sizes) -> dict[str, Any]:
        return hf_decoder_config(
            model,
            "MixtralForCausalLM",
            "mixtral",
            intermediate_size=model.expert_dim,  # each expert's width: Mixtral has no dense MLP
            num_local_experts=model.n_experts,
            num_experts_per_tok=model.experts_per_token,
            router_aux_loss_coef=model.router_aux_loss_coef,
            router_jitter_noise=0.0,
            sliding_window=None,  # etrain trains full causal attention
        )


FAMILY = Mixtral()
